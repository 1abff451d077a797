"""``kiln generate``: streams the continuation the engine produces, and leaves no frozen heap."""

from __future__ import annotations

import gc

from click.testing import CliRunner

import kiln
from kiln.cli import main


def test_generate_prints_the_prompt_then_the_greedy_continuation(tiny_llama):
    prompt = "def add(a, b):"
    result = CliRunner().invoke(main, ["generate", "--model", str(tiny_llama), "--prompt", prompt,
                                       "--max-tokens", "6", "--device", "cpu", "--dtype",
                                       "float32"])  # fmt: skip
    assert result.exit_code == 0, result.output
    llm = kiln.LLM(str(tiny_llama), device="cpu", dtype="float32")
    want = llm.generate(prompt, kiln.SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert want.outputs[0].text  # the comparison below has something to compare
    assert result.output == prompt + want.outputs[0].text + "\n"
    assert gc.get_freeze_count() == 0


def test_generate_chat_prints_only_the_reply():
    """--chat shows the model's reply, not the chat template's markup around the prompt."""
    args = ["generate", "--model", "kiln-tiny", "--prompt", "hello", "--chat", "--max-tokens", "5",
            "--device", "cpu", "--dtype", "float32"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    llm = kiln.LLM("kiln-tiny", device="cpu", dtype="float32")
    templated = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                                  tokenize=False, add_generation_prompt=True)
    want = llm.generate(templated, kiln.SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert result.stdout == want.outputs[0].text + "\n"
    assert "<|user|>" not in result.stdout


def test_generate_says_when_the_context_stops_it_before_max_tokens(tiny_llama):
    args = ["generate", "--model", str(tiny_llama), "--prompt", "def add(a, b):",
            "--max-tokens", "40", "--max-model-len", "16", "--device", "cpu", "--dtype", "float32"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "stopped at the model's context of 16 tokens" in result.stderr
    assert "of --max-tokens 40 generated" in result.stderr


def test_generate_rejects_sampling_values_by_their_flags():
    for flag, value in [("--temperature", "-1"), ("--top-p", "1.5"), ("--top-p", "0"),
                        ("--top-k", "-2")]:
        result = CliRunner().invoke(main, ["generate", "--prompt", "hi", flag, value])
        assert result.exit_code == 2 and f"Invalid value for '{flag}'" in result.output, flag

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

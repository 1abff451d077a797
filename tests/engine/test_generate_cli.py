"""``kiln generate``: streams the continuation the engine produces, and leaves no frozen heap;
runs a prompts file (lines or JSONL, or stdin) as one batch, in input order, refusing bad input
by file and line before anything runs."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
from cli_testing import assert_fails_cleanly
from click.testing import CliRunner, Result

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
    """--chat shows the model's reply, not the chat template's markup around the prompt, and
    renders it as kiln.LLM.chat does: kiln-tiny's template writes BOS, so encoding the templated
    text again, as the CLI once did, added a second."""
    args = ["generate", "--model", "kiln-tiny", "--prompt", "hello", "--chat", "--max-tokens",
            "16", "--device", "cpu", "--dtype", "float32"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    llm = kiln.LLM("kiln-tiny", device="cpu", dtype="float32")
    [want] = llm.chat([{"role": "user", "content": "hello"}],
                      kiln.SamplingParams(max_tokens=16, temperature=0.0))
    assert want.prompt_token_ids.count(llm.tokenizer.bos_token_id) == 1
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
                        ("--top-k", "-2"), ("--min-p", "1.5"), ("--repetition-penalty", "0"),
                        ("--presence-penalty", "3"), ("--frequency-penalty", "-2.5"),
                        ("--n", "0")]:
        result = CliRunner().invoke(main, ["generate", "--prompt", "hi", flag, value])
        assert result.exit_code == 2 and f"Invalid value for '{flag}'" in result.output, flag


CPU = ["--device", "cpu", "--dtype", "float32"]
PROMPTS = ["def add(a, b):", "import os", "The quick brown fox"]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> kiln.LLM:
    return kiln.LLM(str(tiny_llama), device="cpu", dtype="float32")


def generate(model: Path | str, *args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(main, ["generate", "--model", str(model), *CPU, *args], input=stdin)


def result_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_generate_runs_a_prompts_file_as_one_batch_in_input_order(tiny_llama, llm, tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n{PROMPTS[2]}")  # a blank line skipped
    out = tmp_path / "results" / "out.jsonl"
    result = generate(tiny_llama, "--prompts-file", str(prompts_file), "--max-tokens", "6",
                      "--output", str(out))
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert f"wrote 3 results to {out}" in result.stderr
    assert [p.name for p in out.parent.iterdir()] == ["out.jsonl"]  # no temporary file left
    want = llm.generate(PROMPTS, kiln.SamplingParams(max_tokens=6, temperature=0.0))
    lines = result_lines(out.read_text())
    assert [line["prompt"] for line in lines] == PROMPTS
    assert [line["text"] for line in lines] == [w.outputs[0].text for w in want]
    assert [line["token_ids"] for line in lines] == [w.outputs[0].token_ids for w in want]
    assert [line["num_prompt_tokens"] for line in lines] == [len(w.prompt_token_ids)
                                                             for w in want]
    assert {line["finish_reason"] for line in lines} == {"length"}
    # all went in at once: the first step prefilled every prompt and sampled its first token
    assert len({line["first_token_s"] for line in lines}) == 1
    assert all(line["finished_s"] > line["first_token_s"] > 0 for line in lines)


def test_generate_prints_a_batch_in_order_when_no_output_is_given(tiny_llama, llm, tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n")
    result = generate(tiny_llama, "--prompts-file", str(prompts_file), "--max-tokens", "4")
    assert result.exit_code == 0, result.output
    want = llm.generate(PROMPTS, kiln.SamplingParams(max_tokens=4, temperature=0.0))
    blocks = [f"==> {prompts_file}:{i + 1} <==\n{p}{w.outputs[0].text}\n"
              for i, (p, w) in enumerate(zip(PROMPTS, want, strict=True))]
    assert result.stdout == "\n".join(blocks)


def test_generate_reads_jsonl_prompts_and_chats_and_keeps_their_other_keys(tiny_llama, llm,
                                                                           tmp_path):
    chat = [{"role": "user", "content": "hello"}]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(json.dumps({"prompt": PROMPTS[0], "id": "a"}) + "\n"
                            + json.dumps({"messages": chat, "id": "b", "answer": 4}) + "\n")
    result = generate(tiny_llama, "--prompts-file", str(prompts_file), "--max-tokens", "5",
                      "--output", "-")
    assert result.exit_code == 0, result.output
    params = kiln.SamplingParams(max_tokens=5, temperature=0.0)
    [text] = llm.generate(PROMPTS[0], params)
    [reply] = llm.chat(chat, params)
    first, second = result_lines(result.stdout)
    assert {k: first[k] for k in ("prompt", "id", "text")} == {
        "prompt": PROMPTS[0], "id": "a", "text": text.outputs[0].text}
    assert {k: second[k] for k in ("messages", "id", "answer", "token_ids")} == {
        "messages": chat, "id": "b", "answer": 4, "token_ids": reply.outputs[0].token_ids}


def test_generate_reads_prompts_from_stdin(tiny_llama, llm):
    params = kiln.SamplingParams(max_tokens=4, temperature=0.0)
    batch = generate(tiny_llama, "--prompts-file", "-", "--max-tokens", "4", "--output", "-",
                     stdin="\n".join(PROMPTS[:2]) + "\n")
    assert batch.exit_code == 0, batch.output
    assert [line["text"] for line in result_lines(batch.stdout)] == [
        o.outputs[0].text for o in llm.generate(PROMPTS[:2], params)]
    # --prompt - streams the whole of stdin as one prompt, newlines and all
    text = "def add(a, b):\n    return"
    single = generate(tiny_llama, "--prompt", "-", "--max-tokens", "4", stdin=text)
    assert single.exit_code == 0, single.output
    assert single.stdout == text + llm.generate(text, params)[0].outputs[0].text + "\n"


def test_generate_seeds_each_prompt_of_a_batch_with_seed_plus_its_index(tiny_llama, llm,
                                                                        tmp_path):
    """Prompt i samples as a lone request seeded --seed + i: the batch repeats, and duplicate
    lines draw different samples; the first matches the streamed --prompt with that --seed."""
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text(f"{PROMPTS[0]}\n{PROMPTS[0]}\n")
    sampling = ["--temperature", "1.0", "--max-tokens", "12", "--seed", "5"]
    result = generate(tiny_llama, "--prompts-file", str(prompts_file), "--output", "-", *sampling)
    assert result.exit_code == 0, result.output
    texts = [line["text"] for line in result_lines(result.stdout)]
    want = [llm.generate(PROMPTS[0], kiln.SamplingParams(max_tokens=12, temperature=1.0,
                                                         seed=seed))[0].outputs[0].text
            for seed in (5, 6)]
    assert texts == want and texts[0] != texts[1]
    single = generate(tiny_llama, "--prompt", PROMPTS[0], *sampling)
    assert single.stdout == PROMPTS[0] + texts[0] + "\n"


def test_generate_draws_n_samples_of_each_prompt_one_result_line_each(tiny_llama, llm,
                                                                       tmp_path):
    """--n 3: three lines a prompt, in input order then sample order, as kiln.LLM draws them
    with n=3 and the prompt's seed; the samples differ, and share the request's times."""
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS[:2]) + "\n")
    result = generate(tiny_llama, "--prompts-file", str(prompts_file), "--n", "3",
                      "--temperature", "1.0", "--max-tokens", "8", "--seed", "3", "--output", "-")
    assert result.exit_code == 0, result.output
    lines = result_lines(result.stdout)
    assert [(line["prompt"], line["sample_index"]) for line in lines] == [
        (prompt, index) for prompt in PROMPTS[:2] for index in range(3)]
    for seed, prompt in enumerate(PROMPTS[:2], start=3):
        [want] = llm.generate(prompt, kiln.SamplingParams(n=3, max_tokens=8, temperature=1.0,
                                                          seed=seed))
        mine = [line for line in lines if line["prompt"] == prompt]
        assert [line["token_ids"] for line in mine] == [o.token_ids for o in want.outputs]
        assert len({line["text"] for line in mine}) == 3
        assert len({(line["first_token_s"], line["finished_s"]) for line in mine}) == 1


def test_generate_prints_the_n_samples_of_one_prompt_under_their_own_headers(tiny_llama, llm):
    """--prompt with --n 2 prints once both are done (no stream of two interleaved texts)."""
    result = generate(tiny_llama, "--prompt", PROMPTS[0], "--n", "2", "--temperature", "1.0",
                      "--max-tokens", "6", "--seed", "0")
    assert result.exit_code == 0, result.output
    [want] = llm.generate(PROMPTS[0], kiln.SamplingParams(n=2, max_tokens=6, temperature=1.0,
                                                          seed=0))
    assert result.stdout == "\n".join(
        f"==> --prompt [sample {o.index + 1} of 2] <==\n{PROMPTS[0]}{o.text}\n"
        for o in want.outputs)


def test_generate_stops_at_each_stop_string(tiny_llama, llm):
    greedy = llm.generate(PROMPTS[0], kiln.SamplingParams(max_tokens=12, temperature=0.0))
    text = greedy[0].outputs[0].text
    stop = text[len(text) // 2:][:2]
    assert stop.strip()  # a visible stop string, found in the middle of the greedy text
    result = generate(tiny_llama, "--prompt", PROMPTS[0], "--max-tokens", "12", "--output", "-",
                      "--stop", "never seen", "--stop", stop)
    assert result.exit_code == 0, result.output
    [line] = result_lines(result.stdout)
    assert (line["text"], line["finish_reason"], line["stop_reason"]) == (
        text[:text.index(stop)], "stop", stop)


@pytest.mark.parametrize(("content", "message"), [
    ("", "holds no prompts"),
    ("\n  \n", "holds no prompts"),
    ('{"prompt": "a"}\n\n{"prompt": "b"\n', "prompts.txt:3: not valid JSON"),
    ('{"prompt": "a"}\n["b"]\n', 'prompts.txt:2: a JSONL line is an object holding "prompt"'),
    ('{"prompt": "a", "messages": []}\n', "prompts.txt:1: a JSONL line is an object"),
    ('{"prompt": ""}\n', 'prompts.txt:1: "prompt" must be non-empty text'),
    ('{"messages": "hi"}\n', 'prompts.txt:1: "messages" must be a non-empty list'),
    ('{"prompt": "a", "text": "b"}\n', "prompts.txt:1: keys ['text'] are written by the result"),
    (b"caf\xe9\n", "prompts.txt is not UTF-8 text"),
])
def test_generate_refuses_a_bad_prompts_file_by_its_line_before_loading(tmp_path, content,
                                                                        message):
    prompts_file = tmp_path / "prompts.txt"
    if isinstance(content, bytes):
        prompts_file.write_bytes(content)
    else:
        prompts_file.write_text(content)
    # (a model that does not exist: the file is refused before any model loads)
    result = generate(tmp_path / "no-model", "--prompts-file", str(prompts_file))
    assert_fails_cleanly(result, message)


def test_generate_refuses_missing_prompts_and_an_output_that_is_the_prompts_file(tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("a\n")
    result = generate("kiln-tiny", "--prompts-file", str(tmp_path / "missing.txt"))
    assert_fails_cleanly(result, "does not exist")
    (tmp_path / "link.txt").hardlink_to(prompts_file)
    for same in (tmp_path / "sub" / ".." / "prompts.txt", tmp_path / "link.txt"):
        result = generate("kiln-tiny", "--prompts-file", str(prompts_file), "--output", str(same))
        assert_fails_cleanly(result, "is also the --prompts-file")
    assert prompts_file.read_text() == "a\n"
    assert_fails_cleanly(generate("kiln-tiny"), "give one of --prompt TEXT and --prompts-file")
    assert_fails_cleanly(generate("kiln-tiny", "--prompt", "-", stdin=""), "stdin is empty")


def test_generate_names_every_prompt_too_long_for_the_context_and_runs_none(tiny_llama,
                                                                            tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(["ok", "word " * 40, "fine", "x " * 60]) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text("an earlier run's results\n")
    result = generate(tiny_llama, "--prompts-file", str(prompts_file), "--max-model-len", "32",
                      "--output", str(out))
    assert_fails_cleanly(result, "2 of 4 prompts cannot run, so none ran")
    assert f"{prompts_file}:2: prompt has" in result.output
    assert f"{prompts_file}:4: prompt has" in result.output
    assert f"{prompts_file}:1:" not in result.output
    assert out.read_text() == "an earlier run's results\n"  # left whole, not truncated


def test_generate_batch_says_how_many_prompts_the_context_stopped(tiny_llama, tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n")
    result = generate(tiny_llama, "--prompts-file", str(prompts_file), "--max-tokens", "40",
                      "--max-model-len", "16", "--output", "-")
    assert result.exit_code == 0, result.output
    assert all(line["finish_reason"] == "length" for line in result_lines(result.stdout))
    assert ("3 of 3 prompts stopped at the model's context of 16 tokens before --max-tokens 40"
            in result.stderr)
    samples = generate(tiny_llama, "--prompts-file", str(prompts_file), "--max-tokens", "40",
                       "--max-model-len", "16", "--n", "2", "--output", "-")
    assert samples.exit_code == 0, samples.output
    assert "6 of 6 samples stopped at the model's context of 16 tokens" in samples.stderr



def test_generate_constrains_every_output_to_a_json_schema_file(tmp_path):
    """--json-schema FILE: each output parses and follows the schema, token for token what
    kiln.LLM gives with the same StructuredOutputsParams."""
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    args = ["--max-tokens", "48", "--temperature", "0.5", "--seed", "1", "--n", "2"]
    result = generate("kiln-tiny", "--prompt", "x = ", "--json-schema", str(schema_file),
                      "--output", "-", *args)
    assert result.exit_code == 0, result.output
    lines = result_lines(result.stdout)
    assert len(lines) == 2
    for line in lines:
        assert line["finish_reason"] == "stop"
        assert isinstance(json.loads(line["text"])["age"], int)
    llm = kiln.LLM("kiln-tiny", device="cpu", dtype="float32")
    [want] = llm.generate("x = ", kiln.SamplingParams(
        n=2, max_tokens=48, temperature=0.5, seed=1,
        structured_outputs=kiln.StructuredOutputsParams(json=schema)))
    assert [line["token_ids"] for line in lines] == [o.token_ids for o in want.outputs]


def test_generate_choice_and_inline_schema_options():
    choice = generate("kiln-tiny", "--prompt", "x = ", "--choice", "yes", "--choice", "no",
                      "--output", "-")
    assert choice.exit_code == 0, choice.output
    [line] = result_lines(choice.stdout)
    assert line["text"] in ("yes", "no") and line["finish_reason"] == "stop"
    inline = generate("kiln-tiny", "--prompt", "x = ", "--json-schema",
                      '{"type": "object", "properties": {"ok": {"type": "boolean"}}, '
                      '"required": ["ok"]}', "--max-tokens", "48", "--output", "-")
    assert inline.exit_code == 0, inline.output
    assert isinstance(json.loads(result_lines(inline.stdout)[0]["text"])["ok"], bool)


def test_generate_refuses_bad_structured_output_options_by_their_flag(tmp_path):
    assert_fails_cleanly(generate("kiln-tiny", "--prompt", "x", "--regex", "a", "--choice", "b"),
                         "give one structured-output option, not --regex and --choice")
    assert_fails_cleanly(generate("kiln-tiny", "--prompt", "x", "--json-schema", '{"type": '),
                         "Invalid value for --json-schema: StructuredOutputsParams.json is not "
                         "valid JSON")
    assert_fails_cleanly(generate("kiln-tiny", "--prompt", "x", "--json-schema",
                                  str(tmp_path / "missing.json")), "cannot read")
    # compiled once, before any prompt runs: one error naming the flag, not one a prompt
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("a\nb\n")
    bad = generate("kiln-tiny", "--prompts-file", str(prompts_file), "--regex", "[")
    assert_fails_cleanly(bad, "Invalid value for --regex")
    assert "the regex does not compile" in bad.output and "prompts cannot run" not in bad.output

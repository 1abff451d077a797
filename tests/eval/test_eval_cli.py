"""`kiln eval` through the real `kiln` entry point: user mistakes end in a one-line error
(no traceback), before the model loads where they can; a small run still scores."""

from __future__ import annotations

import pytest
from cli_testing import assert_fails_cleanly, kiln

# kiln-tiny's context, and kiln-tiny-draft's (it loads in a fraction of kiln-tiny's time)
CONTEXT = 1024


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max-tokens", "0"], "Invalid value for '--max-tokens'"),
        (["--max-tokens", "1"], "Invalid value for '--max-tokens'"),
        (["--max-tokens", "-5"], "Invalid value for '--max-tokens'"),
        (["--window", "0"], "Invalid value for '--window'"),
        (["--window", "1"], "Invalid value for '--window'"),
        (["--stride", "0"], "Invalid value for '--stride'"),
        (["--dataset", "bogus"], "Error: dataset='bogus'; valid: zoo-heldout"),
        (["--file", "/nonexistent.txt"], "'/nonexistent.txt' does not exist"),
    ],
)
def test_ppl_rejects_bad_options(args, message):
    assert_fails_cleanly(kiln("eval", "ppl", "--device", "cpu", *args), message)


def test_ppl_rejects_a_file_without_text(tmp_path):
    for name, text in [("empty.txt", ""), ("blank.txt", " \n\n")]:
        path = tmp_path / name
        path.write_text(text)
        result = kiln("eval", "ppl", "--device", "cpu", "--file", str(path))
        assert_fails_cleanly(result, f"Error: file {path} has no text to score")


def test_ppl_rejects_both_dataset_and_file(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text("x = 1\n")
    result = kiln("eval", "ppl", "--dataset", "zoo-heldout", "--file", str(path))
    assert_fails_cleanly(result, "Error: give exactly one of --dataset and --file")


@pytest.mark.parametrize("command", [["ppl"], ["agree", "--draft", "kiln-tiny-draft"]])
def test_window_past_the_model_context_fails_up_front(command):
    result = kiln("eval", *command, "--model", "kiln-tiny-draft", "--device", "cpu",
                  "--max-tokens", "2000", "--window", "2048")  # fmt: skip
    assert_fails_cleanly(
        result,
        f"Error: --window 2048 exceeds kiln-tiny-draft's context of {CONTEXT} tokens; "
        f"pass --window {CONTEXT} or less",
    )


@pytest.mark.parametrize("args", [["eval", "-h"], ["eval", "ppl", "-h"], ["eval", "agree", "-h"]])
def test_short_help_option(args):
    result = kiln(*args)
    assert result.exit_code == 0, result.output
    assert f"Usage: kiln {' '.join(args[:-1])}" in result.output


def test_ppl_defaults_to_kiln_tiny_and_scores_a_small_run():
    result = kiln("eval", "ppl", "--device", "cpu", "--max-tokens", "64", "--window", "32")
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "model: kiln-tiny  data: zoo-heldout  window: 32" in result.output
    assert "tokens evaluated: 63" in result.output
    assert 1.0 < float(result.output.split("perplexity:")[1]) < 1000.0


def test_ppl_refuses_a_model_without_tokenizer_files(tmp_path):
    """Scoring text needs the tokenizer: a one-line error, not an AttributeError traceback."""
    from tiny_models import build_model

    model = build_model("llama3.1", tmp_path / "no-tokenizer", tokenizer=False)
    text = tmp_path / "sample.py"
    text.write_text("x = 1\n")
    result = kiln("eval", "ppl", "--model", str(model), "--device", "cpu", "--file", str(text))
    assert_fails_cleanly(result, f"Error: {model} has no tokenizer files")


def test_ppl_reports_the_stride_it_ran():
    """A --stride past the window is capped at window - 1; the report says so, as the stride
    shapes the perplexity as much as the window does."""
    result = kiln("eval", "ppl", "--model", "kiln-tiny-draft", "--device", "cpu",
                  "--max-tokens", "40", "--window", "16", "--stride", "1000")  # fmt: skip
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "window: 16  stride: 15" in result.output

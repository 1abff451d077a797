"""`kiln zoo` through the real `kiln` entry point: -h works on every command, and bad options end
in a one-line error (no traceback) before the corpus is read or anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_testing import assert_fails_cleanly, kiln

from kiln.zoo.tokenizer import MIN_VOCAB_SIZE, train_tokenizer

# Valid settings that would train in seconds: each case below spoils one of them.
TRAIN = ["zoo", "train", "--size", "micro", "--steps", "1", "--max-files", "2", "--device", "cpu"]


@pytest.mark.parametrize("command", [[], ["list"], ["train"], ["tokenizer"]])
def test_short_help_option(command: list[str]):
    result = kiln("zoo", *command, "-h")
    assert result.exit_code == 0, result.output
    assert f"Usage: kiln {' '.join(['zoo', *command])} [OPTIONS]" in result.output
    assert "--install-completion" not in result.output  # kiln's other commands have none


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("not a directory\n")
    return path


@pytest.mark.parametrize("command", [TRAIN, ["zoo", "tokenizer"]])
@pytest.mark.parametrize("below", ["", "sub"])
def test_out_that_is_a_file_is_refused(command: list[str], below: str, a_file: Path):
    result = kiln(*command, "--out", str(a_file / below))
    assert_fails_cleanly(result, f"Invalid value for '--out': {a_file} is a file; pass a directory")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--device", "tpu"], "'tpu' is not a device; choose auto, cpu, cuda or cuda:N"),
        (["--device", "cuda0"], "'cuda0' is not a device"),
        (["--lr", "-1"], "Invalid value for '--lr': -1 must be > 0"),
        (["--lr", "0"], "Invalid value for '--lr': 0 must be > 0"),
        (["--budget-s", "0"], "Invalid value for '--budget-s': 0 must be > 0"),
        (["--budget-s", "nan"], "Invalid value for '--budget-s': nan must be > 0 and finite"),
        (["--lr", "inf"], "Invalid value for '--lr': inf must be > 0 and finite"),
        (["--lr", "nan"], "Invalid value for '--lr': nan must be > 0 and finite"),
        (["--max-files", "0"], "Invalid value for '--max-files'"),
        (["--steps", "0"], "Invalid value for '--steps'"),
        (["--batch-size", "0"], "Invalid value for '--batch-size'"),
    ],
)
def test_train_rejects_bad_options(args: list[str], message: str, tmp_path: Path):
    out = tmp_path / "out"
    assert_fails_cleanly(kiln(*TRAIN, "--out", str(out), *args), message)
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_is_refused_as_the_engine_does(device: str, tmp_path: Path):
    result = kiln(*TRAIN, "--out", str(tmp_path / "out"), "--device", device)
    assert_fails_cleanly(result, "device='cuda' was requested but no CUDA GPU is visible")


def test_corpus_root_without_python_files_is_refused(tmp_path: Path):
    empty = tmp_path / "empty"
    (empty / "site-packages").mkdir(parents=True)
    (empty / "site-packages" / "skipped.py").write_text("x = 1\n")
    (empty / "notes.txt").write_text("not python\n")
    result = kiln(*TRAIN, "--out", str(tmp_path / "out"), "--corpus-root", str(empty))
    assert_fails_cleanly(result, f"no *.py files under {empty}")


@pytest.mark.parametrize("extra", [[], ["--budget-s", "5"]])
def test_out_holding_a_model_without_a_checkpoint_is_refused(extra: list[str], tmp_path: Path):
    """Another model's directory (or a finished run whose checkpoint is gone) would be
    overwritten: refused before any training, with its files left as they were."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    result = kiln(*TRAIN[:4], "--max-files", "2", "--device", "cpu", "--out", str(tmp_path),
                  *extra)  # fmt: skip
    assert_fails_cleanly(result, f"{tmp_path} holds a model (config.json) but no zoo checkpoint")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == b"weights"


def test_setup_errors_are_one_line(tmp_path: Path):
    """Errors found once training starts (here: a --tokenizer without tokenizer.json)."""
    result = kiln(*TRAIN, "--out", str(tmp_path / "out"), "--tokenizer", str(tmp_path))
    assert_fails_cleanly(result, f"Error: no tokenizer.json in {tmp_path}")


@pytest.mark.parametrize("vocab_size", [0, MIN_VOCAB_SIZE - 1])
def test_tokenizer_refuses_a_vocab_without_merges(vocab_size: int, tmp_path: Path):
    out = tmp_path / "tok"
    result = kiln("zoo", "tokenizer", "--out", str(out), "--vocab-size", str(vocab_size))
    assert_fails_cleanly(
        result,
        f"vocab size {vocab_size} leaves no room for a BPE merge: the base vocabulary is "
        f"256 byte symbols + 6 special tokens; use at least {MIN_VOCAB_SIZE}",
    )
    assert not out.exists()


def test_smallest_vocab_size_learns_a_merge():
    texts = ["def add(a, b):\n    return a + b\n"] * 20
    assert train_tokenizer(texts, vocab_size=MIN_VOCAB_SIZE).get_vocab_size() == MIN_VOCAB_SIZE
    with pytest.raises(ValueError, match=f"use at least {MIN_VOCAB_SIZE}"):
        train_tokenizer(texts, vocab_size=MIN_VOCAB_SIZE - 1)

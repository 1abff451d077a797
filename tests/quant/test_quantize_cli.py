"""``kiln quantize`` checks its options and --out before any work, never overwrites a
checkpoint unasked, replaces one cleanly when asked, and writes files the umask allows."""

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_models import build_model

import kiln.models.loader
from kiln.models.loader import load_model
from kiln.quant.checkpoint import COPIED_FILES, process_umask
from kiln.quant.cli import quantize_cmd
from kiln.quant.config import CONFIG_FILE


def quantize(model_dir: Path, out: Path | str, *args: str):
    return CliRunner().invoke(quantize_cmd, ["--model", str(model_dir), "--out", str(out),
                                             "--device", "cpu", *args])


def fast_rtn(calib_file: Path) -> list[str]:
    """rtn on the tiny model, calibrating (the KV-cache scales) on a few short windows."""
    return ["--method", "rtn", "--bits", "8", "--calibration", str(calib_file),
            "--num-samples", "2", "--seq-len", "32"]


@pytest.fixture
def no_loading(monkeypatch):
    """Loading the model fails loudly: what reaches it has passed every up-front check."""
    def load(*_args, **_kwargs):
        raise RuntimeError("model loading reached")

    monkeypatch.setattr(kiln.models.loader, "load_model", load)


# command line -> what the error says
INAPPLICABLE = {
    "--method fp8 --bits 4": "--bits 4 does not apply to --method fp8 (FP8 W8A8, 8-bit), which "
                             "takes --weight-scale, --activation-scheme, --observer; drop --bits",
    "--method fp8 --group-size 32": "--group-size 32 does not apply to --method fp8",
    "--method smoothquant --bits 4": "--bits 4 does not apply to --method smoothquant",
    "--method rtn --w8a8-dtype fp8": "--w8a8-dtype fp8 does not apply to --method rtn (weight-only "
                                     "W4A16 / W8A16), which takes --bits, --group-size, --asym, "
                                     "--dense-lm-head; drop --w8a8-dtype (it is for --method "
                                     "smoothquant)",
    "--method rtn --act-order": "--act-order does not apply to --method rtn",
    "--method gptq --alpha 0.8": "--alpha 0.8 does not apply to --method gptq",
    "--method fp8 --observer mse": "--observer mse does not apply to --activation-scheme dynamic",
    "--method awq --seq-len 5000": "--seq-len 5000 exceeds the context of",
}


@pytest.mark.parametrize("command", INAPPLICABLE)
def test_inapplicable_options_are_refused_before_any_work(tiny_llama, tmp_path, no_loading,
                                                          command):
    result = quantize(tiny_llama, tmp_path / "q", *command.split())
    assert result.exit_code == 2, result.output
    assert INAPPLICABLE[command] in " ".join(result.output.split())  # (click wraps lines)
    assert not any(tmp_path.iterdir())  # nothing written, nothing left behind


def test_seq_len_past_the_context_names_the_fix(tiny_llama, tmp_path, no_loading):
    result = quantize(tiny_llama, tmp_path / "q", "--method", "awq", "--seq-len", "513")
    assert f"--seq-len 513 exceeds the context of {tiny_llama} (512 tokens); pass --seq-len " \
           "512 or less" in " ".join(result.output.split())


@pytest.mark.parametrize("args", [
    ["--method", "fp8"],  # defaults of other methods' options (--bits 4, --seq-len 512) are fine
    ["--method", "smoothquant", "--w8a8-dtype", "fp8", "--alpha", "0.8", "--weight-scale",
     "tensor", "--activation-scheme", "static", "--observer", "mse"],
    ["--method", "gptq", "--bits", "8", "--asym", "--act-order", "--dense-lm-head"],
    ["--method", "awq", "--seq-len", "512"],
], ids=lambda v: " ".join(v))
def test_applicable_options_pass_the_checks(tiny_llama, tmp_path, no_loading, args):
    result = quantize(tiny_llama, tmp_path / "q", *args)
    assert "model loading reached" in result.output, result.output
    assert not any(tmp_path.iterdir())  # the staged output is removed after the failure


def test_unwritable_out_is_refused_before_any_work(tiny_llama, tmp_path, no_loading):
    (tmp_path / "file").write_text("")
    under_a_file = quantize(tiny_llama, tmp_path / "file" / "q", "--method", "rtn")
    assert under_a_file.exit_code == 2
    assert "file is a file, not a directory; choose another --out" in under_a_file.output
    a_file = quantize(tiny_llama, tmp_path / "file", "--method", "rtn", "--overwrite")
    assert a_file.exit_code == 2 and "is a file; choose a directory path" in a_file.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    if Path("/proc/self").is_dir():  # Linux: exists, but nothing can be created in it
        proc = quantize(tiny_llama, "/proc/kiln_nope", "--method", "rtn")
        assert proc.exit_code == 1 and "cannot write --out /proc/kiln_nope: No such file or " \
            "directory" in proc.output and "choose a location you can write to" in proc.output


def test_failure_removes_the_parents_it_created(tiny_llama, tmp_path, no_loading):
    result = quantize(tiny_llama, tmp_path / "new" / "deep" / "q", "--method", "rtn")
    assert "model loading reached" in result.output
    assert not any(tmp_path.iterdir())


def test_existing_checkpoint_is_kept_unless_overwrite(tiny_llama, calib_file, tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    stale = {"config.json": "{}", CONFIG_FILE: "{}", "model.safetensors.index.json": "{}",
             "model-00001-of-00002.safetensors": "", "model-00002-of-00002.safetensors": ""}
    for name, text in stale.items():
        (out / name).write_text(text)
    refused = quantize(tiny_llama, out, *fast_rtn(calib_file))
    assert refused.exit_code == 2
    assert f"--out {out} already exists and is not empty; choose another --out or pass " \
           "--overwrite to replace it" in " ".join(refused.output.split())
    assert {p.name: p.read_text() for p in out.iterdir()} == stale
    # a non-empty directory that is no checkpoint is never wiped, --overwrite or not
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    kept = quantize(tiny_llama, tmp_path / "notes", *fast_rtn(calib_file), "--overwrite")
    assert kept.exit_code == 2 and "holds no checkpoint" in kept.output
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"

    replaced = quantize(tiny_llama, out, *fast_rtn(calib_file), "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    expected = {n for n in COPIED_FILES if (tiny_llama / n).is_file()}
    assert {p.name for p in out.iterdir()} == expected | {"model.safetensors", CONFIG_FILE}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "q"]  # no staging left
    assert load_model(str(out), device="cpu").model.lm_head.qweight is not None


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=oct)
def test_checkpoint_files_follow_the_umask(tiny_llama, calib_file, tmp_path, umask):
    previous = os.umask(umask)
    try:
        assert process_umask() == umask and process_umask() == umask  # reading keeps it
        result = quantize(tiny_llama, tmp_path / "q", *fast_rtn(calib_file))
    finally:
        os.umask(previous)
    assert result.exit_code == 0, result.output
    out = tmp_path / "q"
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~umask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    # model.safetensors above all: safetensors creates it 0600, which other users cannot load
    assert modes["model.safetensors"] == modes[CONFIG_FILE] == oct(0o666 & ~umask), modes


def test_default_seq_len_is_capped_at_a_shorter_context(tmp_path, calib_file):
    """Only an explicit --seq-len past the context is an error; the default 512 adapts."""
    short = build_model("llama2", tmp_path / "short", max_position_embeddings=256)
    result = quantize(short, tmp_path / "q", "--method", "rtn", "--bits", "8",
                      "--calibration", str(calib_file), "--num-samples", "1")
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "q" / CONFIG_FILE).read_text())
    assert saved["calibration"]["seq_len"] == 256


def test_out_that_is_the_model_is_refused(tiny_llama, no_loading):
    """--overwrite would replace the dense checkpoint with its quantized copy."""
    result = quantize(tiny_llama, tiny_llama, "--method", "rtn", "--overwrite")
    assert result.exit_code == 2
    assert "is the --model directory; the quantized checkpoint would replace the dense one: " \
           "choose another --out" in " ".join(result.output.split())
    assert (tiny_llama / "model.safetensors").is_file()


def test_quantized_checkpoint_as_model_is_refused(tiny_llama, calib_file, tmp_path):
    first = quantize(tiny_llama, tmp_path / "q", *fast_rtn(calib_file))
    assert first.exit_code == 0, first.output
    again = quantize(tmp_path / "q", tmp_path / "q2", *fast_rtn(calib_file))
    assert again.exit_code == 1
    assert "is already quantized (W8A16 channel sym (rtn)); kiln quantize takes a dense " \
           "checkpoint" in " ".join(again.output.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # nothing half-written


def test_out_that_holds_the_model_is_refused(tiny_llama, tmp_path, no_loading):
    """--overwrite replaced the checkpoint directory holding --model, deleting the dense
    weights the run was reading."""
    parent = tmp_path / "checkpoints"
    parent.mkdir()
    (parent / "config.json").write_text("{}")
    dense = shutil.copytree(tiny_llama, parent / "dense")
    result = quantize(dense, parent, "--method", "rtn", "--overwrite")
    assert result.exit_code == 2
    assert f"--out {parent} holds the --model directory {dense}" in " ".join(result.output.split())
    assert sorted(p.name for p in parent.iterdir()) == ["config.json", "dense"]

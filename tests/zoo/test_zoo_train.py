"""`kiln zoo train` end to end on CPU with the micro preset: the loss falls, and a run stopped
at a checkpoint resumes to the same weights as an uninterrupted one."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from kiln.zoo.checkpoint import read_log
from kiln.zoo.cli import zoo_app
from kiln.zoo.train import TrainConfig, lr_at

STEPS = 30
# 12 files per split keep tokenization and the held-out sample under a second.
COMMON = ["--size", "micro", "--steps", str(STEPS), "--max-files", "12", "--log-every", "5"]
COMMON += ["--eval-every", "15", "--checkpoint-every", "10", "--device", "cpu"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def train(out: Path, *extra: str) -> str:
    args = ["train", *COMMON, "--out", str(out), *extra]
    # training.json records sys.argv and the commit as kiln bench does; the runner would leave
    # pytest's argv there, so set what `kiln zoo train ...` from a shell would.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["/usr/local/bin/kiln", "zoo", *args])
        patch.setenv("KILN_GIT_COMMIT", COMMIT)
        result = CliRunner().invoke(zoo_app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zoo-micro") / "full"
    train(out)
    return out


def test_loss_falls_and_hf_model_dir_is_written(full_run: Path):
    rows = read_log(full_run)
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] - 0.5
    assert rows[-1]["heldout_loss"] is not None and rows[-1]["heldout_loss"] < 9.0
    for name in ("config.json", "generation_config.json", "model.safetensors", "loss.png"):
        assert (full_run / name).is_file(), name
    for name in ("tokenizer.json", "tokenizer_config.json", "training.json"):
        assert (full_run / name).is_file(), name
    config = json.loads((full_run / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]
    weights = load_file(full_run / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    summary = json.loads((full_run / "training.json").read_text())
    assert summary["steps"] == STEPS and summary["tokens_seen"] == STEPS * 8 * 64
    # Every flag as given (--device, --log-every ... too), and the commit trained.
    given = ["kiln", "zoo", "train", *COMMON, "--out", str(full_run)]
    assert summary["command"] == shlex.join(given)
    assert summary["git_commit"] == COMMIT


def test_resumed_run_continues_from_its_checkpoint(full_run: Path, tmp_path: Path):
    out = tmp_path / "resumed"
    train(out, "--stop-at", "20")
    assert not (out / "config.json").exists(), "a stopped run must not write the final model"
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == 20
    # Resuming with other settings would silently change the run: it is refused.
    refused = CliRunner().invoke(zoo_app, ["train", *COMMON, "--out", str(out), "--lr", "0.01"])
    assert refused.exit_code != 0
    assert "other settings" in str(refused.exception) and "'lr'" in str(refused.exception)
    output = train(out)
    assert "resumed from" in output and "at step 20" in output
    assert [r["step"] for r in read_log(out)] == [5, 10, 15, 20, 25, 30]
    # The data order depends only on (seed, step): resuming reproduces the uninterrupted run.
    assert read_log(out)[-1]["train_loss"] == pytest.approx(read_log(full_run)[-1]["train_loss"])
    a, b = load_file(full_run / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_a_fresh_start_drops_the_log_rows_of_a_run_stopped_before_its_first_checkpoint(
    tmp_path: Path,
):
    """Such a run leaves training_log.csv and no checkpoint; the new run logs those steps again,
    and the CSV (and loss.png) must hold them once, from this run."""
    out = tmp_path / "restarted"
    out.mkdir()
    stale = "step,tokens_seen,lr,train_loss,heldout_loss,grad_norm,wall_s\n5,2560,0.003,99,,1,1\n"
    (out / "training_log.csv").write_text(stale)
    train(out, "--stop-at", "10")
    rows = read_log(out)
    assert [r["step"] for r in rows] == [5, 10] and rows[0]["train_loss"] != 99


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(size="micro", out_dir=Path("unused"), steps=100, warmup_steps=10, lr=1.0)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(x >= y for x, y in zip(lrs[9:], lrs[10:], strict=False))
    assert lr_at(100, cfg) == pytest.approx(cfg.min_lr_ratio)


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="size='huge'; valid: tiny, draft, micro"):
        TrainConfig(size="huge", out_dir=Path("x"))
    with pytest.raises(ValueError, match="stop_at=50"):
        TrainConfig(size="micro", out_dir=Path("x"), steps=10, stop_at=50)

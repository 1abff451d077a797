"""kiln profile's edges: the context the recorded steps need, checked before loading; an empty
recorded step refused; the files it lists are the files it wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.profile import run
from kiln.profile.run import ProfileConfig, tokens_needed

FAST = ["--device", "cpu", "--num-kv-blocks", "64", "--peak-gbps", "10", "--peak-tflops", "1"]


def _profile(model: Path, out: Path, *args: str) -> object:
    return CliRunner().invoke(main, ["profile", "--model", str(model), *FAST,
                                     "--output-dir", str(out), *args])


def test_tokens_needed_counts_the_prefill_step_and_its_chunks():
    """The prefill step samples the first token; chunks before the prompt's last sample none."""
    cfg = ProfileConfig("m", batch_size=1, input_len=40, num_steps=10, skip_steps=2)
    assert tokens_needed(cfg, max_num_batched_tokens=8192) == 40 + 2 + 10
    assert tokens_needed(cfg, max_num_batched_tokens=16) == 40 + 2 + 10 - 2  # 3 chunks
    assert tokens_needed(ProfileConfig("m", input_len=40, num_steps=1), 16) == 41  # chunks only


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the context was checked")

    monkeypatch.setattr(run.offline, "build_llm", refuse)
    monkeypatch.setattr(run, "ceilings", refuse)


def test_refuses_steps_past_the_context_before_loading(tiny_llama, tmp_path, no_loading):
    res = _profile(tiny_llama, tmp_path / "p", "--batch-size", "1", "--input-len", "500",
                   "--skip-steps", "5", "--num-steps", "10")
    assert res.exit_code == 1
    assert ("--input-len 500 + --skip-steps 5 + --num-steps 10 needs 515 tokens of context; "
            f"{tiny_llama} has 512: lower one of them\n") in res.output
    res = _profile(tiny_llama, tmp_path / "p", "--input-len", "30", "--num-steps", "10",
                   "--max-model-len", "32", "--max-num-batched-tokens", "8")
    assert res.exit_code == 1
    assert ("--input-len 30 + --skip-steps 0 + --num-steps 10 - 3 prompt chunks that sample no "
            "token (--max-num-batched-tokens 8) needs 37 tokens of context; "
            f"{tiny_llama} has 32: lower one of them or raise --max-model-len (up to 512)"
            ) in res.output
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("budget", ["8192", "8"])  # one prefill step; two chunks of the prompt
def test_steps_up_to_the_context_all_run(tiny_llama, tmp_path, budget):
    """Exactly the context the check allows: the first request runs in the last recorded step
    (a step without it would fail the empty-step check), and the workload asks for no more
    than the context holds."""
    chunks = 1 if budget == "8192" else 2
    res = _profile(tiny_llama, tmp_path / "p", "--batch-size", "1", "--input-len", "16",
                   "--max-model-len", "24", "--max-num-batched-tokens", budget, "--skip-steps",
                   "2", "--num-steps", str(6 + chunks - 1), "--nvtx-only")
    assert res.exit_code == 0, res.output
    result = json.loads((tmp_path / "p" / "result.json").read_text())
    assert result["metrics"][0]["step_ms"]["n"] == 6 + chunks - 1
    assert result["workload"]["output_len"] == 24 - 16


def test_an_empty_recorded_step_is_an_error(tiny_llama, tmp_path, monkeypatch):
    """The safety net under check_context: a step that runs no sequence is not recorded."""
    monkeypatch.setattr(run, "check_context", lambda cfg: None)
    res = _profile(tiny_llama, tmp_path / "p", "--batch-size", "1", "--input-len", "16",
                   "--max-model-len", "20", "--num-steps", "8", "--nvtx-only")
    assert res.exit_code == 1
    assert "recorded step 4 ran no sequence" in res.output
    assert not (tmp_path / "p" / "result.json").exists()


def test_nvtx_only_on_cpu_lists_its_files_and_says_why_no_kernels(tiny_llama, tmp_path):
    out = tmp_path / "nvtx"
    res = _profile(tiny_llama, out, "--batch-size", "1", "--input-len", "4", "--num-steps", "2",
                   "--nvtx-only")
    assert res.exit_code == 0, res.output
    assert f"results in {out}/ (result.json, summary.md)\n" in res.output
    assert {p.name for p in out.iterdir()} == {"result.json", "summary.md"}
    note = "NVTX ranges need a CUDA device"
    assert note in " ".join(res.output.split())  # the console wraps lines
    summary = (out / "summary.md").read_text()
    assert note in summary and "| kernel / op |" not in summary
    result = json.loads((out / "result.json").read_text())
    assert result["metrics"][0]["step_ms"]["n"] == 2 and result["metrics"][0]["kernels"] == []
    assert result["ceilings"]["bandwidth_source"] == "given"
    assert result["config"]["nvtx"] is False and result["config"]["trace"] is None


def test_an_output_dir_holding_a_run_is_refused_before_the_run(tiny_llama, tmp_path,
                                                               monkeypatch):
    """As kiln bench's: the old run's plots would stay beside the new result.json."""
    (tmp_path / "result.json").write_text("{}")
    monkeypatch.setattr(run, "run_profile", lambda *a: pytest.fail("the run started"))
    result = _profile(tiny_llama, tmp_path)
    assert result.exit_code == 2 and "already holds a run's results" in result.output, \
        result.output

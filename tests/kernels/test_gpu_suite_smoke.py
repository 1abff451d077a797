"""benchmarks/gpu_kernels.py, the GPU suite's kernel script, runs as a user would on a CPU under
the interpreter (--smoke: tiny shapes), every kernel against its reference: the script the device
runs cannot rot between GPU sessions."""

import json
import os
import subprocess
import sys

import pytest
from kernel_testing import needs_triton

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu_kernels.py")


@needs_triton
@pytest.mark.parametrize("mode", [[], ["--decode-sweep"], ["--window-sweep"]],
                         ids=["kernels", "decode-sweep", "window-sweep"])
def test_gpu_kernels_smoke_run_checks_every_kernel(mode, tmp_path):
    out = tmp_path / "kernels.json"
    run = subprocess.run(
        [sys.executable, SCRIPT, "--smoke", *mode, "--out", str(out)], capture_output=True,
        text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "all steps ran" in run.stdout
    report = json.loads(out.read_text())
    assert report["errors"] == []
    rows = report["sweeps"] if mode else report["results"]
    assert rows and all(row["ok"] for row in rows), [r for r in rows if not r["ok"]]
    if mode == ["--window-sweep"]:
        assert {row["window"] for row in rows} == {40, 16}
    if not mode:  # every kernel family has its row
        kernels = {row["kernel"].split("_")[0] for row in rows}
        assert {"rms", "silu", "gated", "argmax", "rotary", "prefill", "decode"} <= kernels

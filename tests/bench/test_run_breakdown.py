"""benchmarks/run_breakdown.py on kiln-tiny (CPU): every step of the run is counted once, in the
group of what it ran, and the profiled second run sums its ops. The script the device runs
cannot rot between GPU sessions."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "run_breakdown.py")


def test_run_breakdown_groups_every_step(tmp_path):
    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps({"dataset_name": "fixed", "num_prompts": 6, "input_len": 24,
                                    "output_len": 5, "seed": 1}))
    run = subprocess.run(
        [sys.executable, SCRIPT, "--model", "kiln-tiny", "--workload", str(workload),
         "--max-num-seqs", "4", "--kernels", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "breakdown.json").read_text())
    assert report["output_tokens"] == 6 * 5
    groups = {g["kind"]: g for g in report["steps"]["groups"]}
    # the first step runs prompts alone (an idle engine), the last ones decode alone
    assert "prompts" in groups and "decode <= 8" in groups
    assert sum(g["steps"] for g in groups.values()) == report["steps"]["total"]["steps"]
    assert all(g["floor_ms"] > 0 and g["device_ms"] > 0 for g in groups.values())
    assert report["kernels"] and all(k["calls"] > 0 for k in report["kernels"])
    assert "| decode <= 8 |" in run.stdout

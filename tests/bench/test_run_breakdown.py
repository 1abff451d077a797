"""benchmarks/run_breakdown.py on kiln-tiny (CPU): every step of the run is counted once, in the
group of what it ran, and the profiled second run sums its ops. The script the device runs
cannot rot between GPU sessions."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

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
    total = report["steps"]["total"]
    # the steps and the idle gaps between them tile the span from the first start to the last end
    assert math.isclose(total["device_ms"] + total["idle_after_ms"], total["span_ms"],
                        rel_tol=1e-6)
    assert all(g["floor_ms"] > 0 and g["device_ms"] > 0 for g in groups.values())
    assert report["kernels"] and all(k["calls"] > 0 for k in report["kernels"])
    assert "| decode <= 8 |" in run.stdout


def test_step_table_counts_idle_time_and_a_last_step_of_its_own_kind():
    spec = importlib.util.spec_from_file_location("run_breakdown", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    clock = module.StepClock(SimpleNamespace(execute=None), on_cuda=False)
    # (decodes, prompt tokens, start s, end s): a prompt step, two decode steps, then a lone
    # mixed step; the GPU idles 1 ms before the second decode step
    for decodes, prompt, start, end in [(0, 8, 0.000, 0.004), (2, 0, 0.004, 0.006),
                                        (2, 0, 0.007, 0.009), (1, 3, 0.009, 0.012)]:
        clock.steps.append(module.Step(decodes, decodes * 9, prompt, prompt * prompt,
                                       decodes + (prompt > 0), 0.1, start, end))
    arch = SimpleNamespace(hidden_size=8, num_layers=2, q_size=8, kv_size=4, num_heads=2,
                           head_dim=4, intermediate_size=16, vocab_size=32)
    roofs = {"compute_tflops": 1.0, "bandwidth_gbps": 1.0}
    table = module.step_table(clock, arch, 2, roofs, prefill_tflops=1.0)
    groups = {g["kind"]: g for g in table["groups"]}
    assert set(groups) == {"prompts", "decode <= 8", "prompts + decodes"}
    assert groups["decode <= 8"]["steps"] == 2
    assert math.isclose(groups["decode <= 8"]["device_ms"], 4.0)
    assert math.isclose(groups["decode <= 8"]["idle_after_ms"], 1.0)
    assert groups["prompts + decodes"]["idle_after_ms"] == 0.0
    assert math.isclose(table["total"]["span_ms"], 12.0)
    assert math.isclose(table["total"]["device_ms"] + table["total"]["idle_after_ms"], 12.0)

"""kiln profile: shape-based estimates, phase ranges, and a real profile of the tiny model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from kiln.cli import main
from kiln.profile.annotate import annotate_engine
from kiln.profile.cli import summary_markdown
from kiln.profile.kernels import Estimate, KernelRow, collect_rows, estimate, table
from kiln.profile.launches import launch_rows


def test_gemm_estimates_from_shapes():
    e = estimate("aten::mm", [[4, 64], [64, 192]], ["float", "float"], 2)
    assert e.flops == 2 * 4 * 64 * 192
    assert e.bytes == (4 * 64 + 64 * 192 + 4 * 192) * 4  # recorded dtype wins over default
    e = estimate("aten::addmm", [[192], [4, 64], [64, 192], [], []], None, 2)
    assert e.flops == 2 * 4 * 64 * 192
    assert e.bytes == (192 + 4 * 64 + 64 * 192 + 4 * 192) * 2
    e = estimate("aten::bmm", [[3, 5, 7], [3, 7, 11]], ["c10::BFloat16"] * 2, 4)
    assert e.flops == 2 * 3 * 5 * 7 * 11 and e.bytes == (3 * 5 * 7 + 3 * 7 * 11 + 3 * 5 * 11) * 2


def test_attention_copy_view_and_indexing_estimates():
    q, kv = [2, 8, 16, 64], [2, 8, 32, 64]
    e = estimate("aten::_scaled_dot_product_flash_attention", [q, kv, kv], None, 2)
    assert e.flops == 4 * 2 * 8 * 16 * 32 * 64
    assert e.bytes == (2 * 8 * 16 * 64 * 2 + 2 * 2 * 8 * 32 * 64) * 2
    assert estimate("aten::copy_", [[10, 10], [10, 10], []], None, 2).bytes == 400
    assert estimate("aten::copy_", [[10, 10], [10, 10], []], None, 2).flops == 0
    assert estimate("aten::view", [[1 << 20], []], None, 2).bytes == 0
    assert estimate("aten::index", [[1000, 16], []], None, 2).bytes is None
    for forwarder in ("aten::to", "aten::contiguous", "aten::type_as"):  # the copy is a child's
        assert estimate(forwarder, [[32, 384], [], [], []], None, 4) == Estimate(0.0, 0.0)
    assert estimate("aten::result_type", [[32, 384], []], None, 4) == Estimate(0.0, 0.0)
    e = estimate("aten::add", [[8, 8], [8, 8], []], None, 4)
    assert e.flops == 64 and e.bytes == 3 * 64 * 4  # two reads, one write


def test_table_classifies_against_the_ridge():
    rows = [KernelRow("gemm", "gemm", "", set(), 1, 1000.0, 4e9, 1e6),  # 4000 FLOP/B
            KernelRow("norm", "norm", "", set(), 1, 1000.0, 1e6, 1e7)]  # 0.1 FLOP/B
    out = table(rows, peak_tflops=10.0, peak_gbps=100.0)  # ridge: 100 FLOP/byte
    assert [r["bound"] for r in out] == ["compute", "memory"]
    assert out[0]["tflops"] == pytest.approx(4.0) and out[0]["roof_fraction"] == pytest.approx(0.4)
    assert out[1]["gbps"] == pytest.approx(10.0) and out[1]["roof_fraction"] == pytest.approx(0.1)
    assert sum(r["share"] for r in out) == pytest.approx(1.0)
    assert not any(r["above_roof"] for r in out)


def test_table_flags_a_row_above_the_roof():
    """1 GB in 1 ms is 1000 GB/s against a 100 GB/s roof: 10x, flagged."""
    out = table([KernelRow("copy", "copy", "", set(), 1, 1000.0, 0.0, 1e9)],
                peak_tflops=10.0, peak_gbps=100.0)
    assert out[0]["gbps"] == pytest.approx(1000.0)
    assert out[0]["roof_fraction"] == pytest.approx(10.0) and out[0]["above_roof"] is True


def _event(name, device="DeviceType.CPU", shapes=(), kernels=(), us=0.0, annotation=False):
    return SimpleNamespace(
        name=name, device_type=device, input_shapes=[list(x) for x in shapes],
        input_dtypes=None, cpu_children=[], self_cpu_time_total=0.0,
        kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels],
        time_range=SimpleNamespace(elapsed_us=lambda: us), is_user_annotation=annotation)


def test_cuda_rows_attribute_kernels_to_ops():
    """The CUDA grouping on synthetic profiler events (no GPU here): an op's kernels make
    one call, Python-launched kernels keep their own rows, annotations are not kernels."""
    cuda = "DeviceType.CUDA"
    events = [
        _event("aten::mm", shapes=[(4, 64), (64, 192)], kernels=[("gemm", 100.0),
                                                                 ("splitk_reduce", 5.0)]),
        _event("kiln.forward", kernels=[("_paged_attention_kernel", 50.0)], annotation=True),
        _event("gemm", cuda, us=100.0), _event("splitk_reduce", cuda, us=5.0),
        _event("_paged_attention_kernel", cuda, us=50.0),
        _event("Memcpy HtoD (Pageable -> Device)", cuda, us=10.0),
        _event("kiln.forward", cuda, us=500.0, annotation=True),  # the range on the GPU row
    ]
    rows = {r.name: r for r in collect_rows(events, on_cuda=True, default_elsize=2)}
    assert set(rows) == {"aten::mm", "_paged_attention_kernel",
                         "Memcpy HtoD (Pageable -> Device)"}
    mm = rows["aten::mm"]
    assert (mm.calls, mm.time_us, mm.flops) == (1, 105.0, 2 * 4 * 64 * 192)
    assert mm.kernels == {"gemm", "splitk_reduce"}
    attn = rows["_paged_attention_kernel"]
    assert attn.launched_by == "kiln.forward" and attn.time_us == 50.0 and attn.flops is None
    assert rows["Memcpy HtoD (Pageable -> Device)"].launched_by == "(no aten op)"
    assert sum(r.time_us for r in rows.values()) == 165.0


def test_launch_rows_tell_one_kernels_layers_apart():
    """Kernel events grouped by (name, grid, block): the same Triton kernel at two grids gives
    two rows; CPU ops, instants and flows are not kernels; a kernel without launch args still
    counts (grid "?")."""
    def kernel(name, dur, grid=None, block=(128, 1, 1)):
        args = {} if grid is None else {"grid": list(grid), "block": list(block)}
        return {"ph": "X", "cat": "kernel", "name": name, "dur": dur, "args": args}

    trace = {"traceEvents": [
        kernel("_wint_mma_kernel", 10.0, (1, 96, 4)), kernel("_wint_mma_kernel", 12.0, (1, 96, 4)),
        kernel("_wint_mma_kernel", 30.0, (1, 64, 8)), kernel("Memcpy HtoD", 1.5),
        {"ph": "X", "cat": "cpu_op", "name": "_wint_mma_kernel", "dur": 99.0, "args": {}},
        {"ph": "i", "cat": "kernel", "name": "_wint_mma_kernel", "args": {}},
        {"ph": "f", "cat": "ac2g", "name": "launch"},
    ]}
    rows = launch_rows(trace)
    assert [(r["name"], r["grid"], r["calls"], r["time_us"]) for r in rows] == [
        ("_wint_mma_kernel", "1x64x8", 1, 30.0), ("_wint_mma_kernel", "1x96x4", 2, 22.0),
        ("Memcpy HtoD", "?", 1, 1.5)]
    assert rows[1]["mean_us"] == 11.0 and rows[1]["block"] == "128x1x1"
    assert launch_rows({}) == []


def test_launch_rows_share_a_streams_busy_time_where_kernels_overlap():
    """A PDL launch starts before the kernel before it ends: its share of the stream runs from
    that completion to its own; idle time before a kernel is nobody's; streams count apart."""
    def kernel(name, ts, dur, stream=7):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"grid": [64, 1, 1], "block": [256, 1, 1], "stream": stream}}

    trace = {"traceEvents": [
        kernel("gemm", 0.0, 10.0), kernel("norm", 5.0, 7.0),  # norm waits from 5 to 10
        kernel("gemm", 20.0, 10.0),  # after 8 idle
        kernel("copy", 3.0, 4.0, stream=8),  # another stream, overlapping in time
    ]}
    rows = {r["name"]: r for r in launch_rows(trace)}
    assert rows["gemm"]["path_us"] == 20.0 and rows["gemm"]["time_us"] == 20.0
    assert rows["norm"]["path_us"] == 2.0 and rows["norm"]["time_us"] == 7.0
    assert rows["copy"]["path_us"] == 4.0
    assert [r["name"] for r in launch_rows(trace)] == ["gemm", "copy", "norm"]
    assert sum(r["path_us"] for r in rows.values() if r["name"] != "copy") == 10.0 + 2.0 + 10.0


def test_annotate_engine_wraps_and_restores(tiny_llama):
    from kiln.llm import LLM

    llm = LLM(str(tiny_llama), device="cpu", num_kv_blocks=64)
    engine = llm.engine
    before = (type(engine.scheduler).schedule, type(engine.runner).prepare)
    llm.generate([[5, 6, 7]], None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, \
            annotate_engine(engine, nvtx=False):
        assert "schedule" in vars(engine.scheduler) and "forward" in vars(engine.runner.model)
        llm.generate([[5, 6, 7, 8]], None)
    names = {e.name for e in prof.events()}
    assert {"kiln.schedule", "kiln.prepare_inputs", "kiln.forward", "kiln.logits",
            "kiln.sample", "kiln.update"} <= names
    for obj, method in ((engine.scheduler, "schedule"), (engine.runner, "prepare"),
                        (engine.runner.model, "forward"), (engine.runner.model, "compute_logits"),
                        (engine.runner.sampler, "sample"),
                        (engine, "_update")):
        assert method not in vars(obj)
    assert (type(engine.scheduler).schedule, type(engine.runner).prepare) == before


def test_gemm_flops_agree_with_torch_counter(tiny_llama):
    """Our shape-based GEMM FLOPs equal torch.profiler's own with_flops counts."""
    from kiln.llm import LLM

    llm = LLM(str(tiny_llama), device="cpu", num_kv_blocks=64)
    with torch.profiler.profile(record_shapes=True, with_flops=True) as prof:
        llm.generate([[5, 6, 7, 8, 9]] * 2, None)
    events = list(prof.events())
    torch_flops = sum(e.flops for e in events if e.name in ("aten::mm", "aten::addmm"))
    rows = collect_rows(events, on_cuda=False, default_elsize=4)
    ours = sum(r.flops for r in rows if r.name in ("aten::mm", "aten::addmm"))
    assert torch_flops > 0 and ours == torch_flops


def test_profile_command_on_tiny_model(tiny_llama, tmp_path):
    out = tmp_path / "prof"
    res = CliRunner().invoke(main, [
        "profile", "--model", str(tiny_llama), "--device", "cpu", "--batch-size", "2",
        "--input-len", "8", "--num-steps", "3", "--skip-steps", "1", "--num-kv-blocks", "64",
        "--output-dir", str(out)])
    assert res.exit_code == 0, res.output
    assert f"results in {out}/ (result.json, summary.md, trace.json, roofline.png)\n" in res.output
    assert {"result.json", "summary.md", "trace.json", "roofline.png"} <= {
        p.name for p in out.iterdir()}
    trace = json.loads((out / "trace.json").read_text())
    ranges = {e.get("name") for e in trace["traceEvents"]}
    assert {"kiln.step 0", "kiln.step 2", "kiln.forward", "kiln.sample"} <= ranges
    result = json.loads((out / "result.json").read_text())
    assert result["kind"] == "profile" and result["requests"] == []
    # the profiled batch; the warm-up batch before it is the config's
    assert (result["workload"]["num_prompts"], result["workload"]["output_len"]) == (2, 5)
    assert (result["config"]["warmup_prompts"], result["config"]["warmup_output_len"]) == (2, 4)
    m = result["metrics"][0]
    assert m["step_ms"]["n"] == 3 and m["phases"]["forward"]["calls"] == 3
    rows = m["kernels"]
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    gemms = [r for r in rows if r["name"] in ("aten::mm", "aten::addmm")]
    assert gemms and all(r["flops"] > 0 and r["bound"] in ("compute", "memory")
                         for r in gemms)
    assert all(r["above_roof"] == (r["roof_fraction"] is not None and r["roof_fraction"] > 1)
               for r in rows)
    assert not any(r["gbps"] for r in rows if r["name"] == "aten::to")  # moves nothing itself
    summary = (out / "summary.md").read_text()
    assert "| kernel / op |" in summary
    assert m["launches"] == [] and "launch configurations" not in summary  # no device kernels
    m["launches"] = [{"name": "_gemm_kernel", "grid": "1x128x1", "block": "128x1x1",
                      "calls": 64, "time_us": 900.0, "mean_us": 14.0625, "path_us": 640.0}]
    with_launches = summary_markdown(result, top=5)
    assert "top 1 of 1 launch configurations" in with_launches
    assert "| _gemm_kernel | 1x128x1 | 128x1x1 | 64 | 0.6 | 0.9 | 14.1 |" in with_launches

"""``kiln profile``: a torch.profiler trace of N engine steps, per-kernel and per-launch-grid tables
and a roofline.

The engine first runs one batch of the same shape (so Triton compilation and allocator growth
stay out of the trace), then ``batch_size`` fresh prompts are added and ``skip_steps`` steps run
unrecorded (skip the prefill to look at decode only), then ``num_steps`` steps are recorded.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.bench import offline
from kiln.bench.env import ceilings
from kiln.bench.result import make_result
from kiln.bench.stats import summarize
from kiln.bench.workload import BenchRequest, WorkloadSpec, build_requests
from kiln.engine.gc_heap import finite_loop_heap
from kiln.models.loader import resolve_device
from kiln.profile.annotate import PHASES, PREFIX, annotate_engine, step_range
from kiln.profile.kernels import collect_rows, table
from kiln.profile.launches import launch_rows


@dataclass
class ProfileConfig:
    model: str
    batch_size: int = 8
    input_len: int = 128
    num_steps: int = 8
    skip_steps: int = 0
    peak_gbps: float | None = None
    peak_tflops: float | None = None
    torch_profiler: bool = True  # False: NVTX ranges only, for running under nsys
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


def _phase_times(events: list[Any], num_steps: int) -> dict[str, dict[str, float]]:
    """Mean host and device milliseconds per step spent in each phase range."""
    out = {}
    for phase in PHASES:
        hits = [e for e in events if e.name == PREFIX + phase and "CPU" in str(e.device_type)]
        host = sum(e.cpu_time_total for e in hits) / 1e3 / num_steps
        device = sum(getattr(e, "device_time_total", 0.0) for e in hits) / 1e3 / num_steps
        out[phase] = {"host_ms": host, "device_ms": device, "calls": len(hits)}
    return out


def _step(engine: Any, index: int, nvtx: bool, device: torch.device) -> tuple[float, int]:
    offline.sync(device)
    start = time.perf_counter()
    with step_range(index, nvtx):
        outputs = engine.step()
    offline.sync(device)
    return (time.perf_counter() - start) * 1e3, len(outputs)


def run_profile(cfg: ProfileConfig, output_dir: Path) -> dict[str, Any]:
    device = resolve_device(cfg.engine_kwargs.get("device", "auto"))
    roofs = ceilings(device, cfg.peak_gbps, cfg.peak_tflops)  # before the KV pool takes memory
    llm = offline.build_llm(cfg.model, cfg.engine_kwargs)
    engine = llm.engine
    vocab = engine.loaded.arch.vocab_size
    seed = int(cfg.engine_kwargs.get("seed", 0))
    output_len = cfg.skip_steps + cfg.num_steps + 1  # nobody finishes inside the window
    spec = WorkloadSpec("fixed", 2 * cfg.batch_size, cfg.input_len, output_len, seed=seed)
    requests = build_requests(spec, vocab)
    offline.run_requests(llm, [BenchRequest(r.prompt, 4) for r in requests[:cfg.batch_size]])
    for i, r in enumerate(requests[cfg.batch_size:]):
        engine.add_request(f"profile-{i}", r.prompt, offline.greedy_params(r.output_len))
    with finite_loop_heap():  # no full collection inside the window
        for _ in range(cfg.skip_steps):
            engine.step()
        nvtx = device.type == "cuda"
        step_ms: list[float] = []
        events: list[Any] = []
        launches: list[dict[str, Any]] = []
        output_dir.mkdir(parents=True, exist_ok=True)
        with annotate_engine(engine, nvtx):
            if cfg.torch_profiler:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if device.type == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                with torch.profiler.profile(activities=activities, record_shapes=True,
                                            with_flops=True) as prof:
                    step_ms = [_step(engine, i, nvtx, device)[0] for i in range(cfg.num_steps)]
                prof.export_chrome_trace(str(output_dir / "trace.json"))
                events = list(prof.events())
                with open(output_dir / "trace.json") as f:
                    launches = launch_rows(json.load(f))
            else:
                step_ms = [_step(engine, i, nvtx, device)[0] for i in range(cfg.num_steps)]
        engine.run_to_completion()
    elsize = torch.empty((), dtype=engine.loaded.dtype).element_size()
    rows = table(collect_rows(events, device.type == "cuda", elsize),
                 roofs["compute_tflops"], roofs["bandwidth_gbps"]) if events else []
    metrics = {"case": {"batch_size": cfg.batch_size, "input_len": cfg.input_len,
                        "num_steps": cfg.num_steps, "skip_steps": cfg.skip_steps},
               "step_ms": summarize(step_ms), "step_ms_each": step_ms,
               "phases": _phase_times(events, cfg.num_steps) if events else None,
               "kernel_time_us": sum(r["time_us"] for r in rows),
               "kernel_time_source": "device kernels" if device.type == "cuda"
               else "self CPU time of aten ops",
               "kernels": rows, "launches": launches}
    config = {k: v for k, v in asdict(cfg).items() if k != "engine_kwargs"}
    config.update(engine=cfg.engine_kwargs, engine_defaults=offline.BENCH_ENGINE_DEFAULTS,
                  dtype=str(engine.loaded.dtype),
                  trace="trace.json" if cfg.torch_profiler else None)
    offline.free_llm(llm)
    return make_result("profile", device, config, spec.to_dict(), [metrics], [], roofs)

"""``kiln profile``: a torch.profiler trace of N engine steps, per-kernel and per-launch-grid tables
and a roofline.

The engine first runs one warm-up batch of the same shape on other prompts (so Triton
compilation and allocator growth stay out of the trace), then ``batch_size`` fresh prompts are
added and ``skip_steps`` steps run unrecorded (skip the prefill to look at decode only), then
``num_steps`` steps are recorded. The recorded workload is those ``batch_size`` prompts; the
warm-up is in the config.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.bench import offline
from kiln.bench.env import ceilings
from kiln.bench.result import make_result
from kiln.bench.stats import summarize
from kiln.bench.workload import WARMUP_SEED_OFFSET, WorkloadSpec, build_requests, derived_requests
from kiln.config import EngineConfig
from kiln.engine.gc_heap import finite_loop_heap
from kiln.engine.sizing import resolve_max_model_len
from kiln.llm import offline_options
from kiln.models.loader import read_arch, resolve_device, resolve_model_path
from kiln.profile.annotate import PHASES, PREFIX, annotate_engine, step_range
from kiln.profile.kernels import collect_rows, table
from kiln.profile.launches import launch_rows

WARMUP_OUTPUT_LEN = 4  # a prefill and a few decode steps: every kernel of a step has run once


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


def prefill_steps(input_len: int, max_num_batched_tokens: int) -> int:
    """Steps the first request's prompt takes: it is admitted alone into an idle engine and
    continues with the whole token budget, so one unless the budget chunks it."""
    return math.ceil(input_len / max_num_batched_tokens)


def tokens_needed(cfg: ProfileConfig, max_num_batched_tokens: int) -> int:
    """Context the first request holds after the last recorded step, which it must still run in.

    A request samples one token a step from the step that computes its prompt's last chunk on.
    The engine finishes a sequence once it holds ``max_model_len`` tokens, so every recorded
    step runs the full batch while this stays within it. At least one token more than the
    prompt: a prompt must leave room for one (check_prompt_length).
    """
    sampling_steps = cfg.skip_steps + cfg.num_steps - prefill_steps(cfg.input_len,
                                                                     max_num_batched_tokens) + 1
    return cfg.input_len + max(sampling_steps, 1)


def check_context(cfg: ProfileConfig) -> None:
    """Refuse, before loading anything, a run whose recorded steps would go past the context:
    the requests would finish early and the steps after record an empty engine."""
    config = EngineConfig.from_kwargs(cfg.model, **offline_options(cfg.engine_kwargs))
    path = resolve_model_path(cfg.model, config.model.revision)
    arch = read_arch(path)
    max_len = resolve_max_model_len(config.model.max_model_len, arch)
    budget = config.scheduler.max_num_batched_tokens
    needed = tokens_needed(cfg, budget)
    if needed <= max_len:
        return
    chunks = prefill_steps(cfg.input_len, budget)
    chunked = (f" - {chunks - 1} prompt chunks that sample no token "
               f"(--max-num-batched-tokens {budget})" if chunks > 1 else "")
    limit = resolve_max_model_len(None, arch)
    raise_it = f" or raise --max-model-len (up to {limit})" if max_len < limit else ""
    raise ValueError(f"--input-len {cfg.input_len} + --skip-steps {cfg.skip_steps} + --num-steps "
                     f"{cfg.num_steps}{chunked} needs {needed} tokens of context; {cfg.model} "
                     f"has {max_len}: lower one of them{raise_it}")


def _step(engine: Any, index: int, nvtx: bool, device: torch.device) -> float:
    """Milliseconds of one recorded step; an error if it ran no sequence (nothing to profile)."""
    offline.sync(device)
    start = time.perf_counter()
    with step_range(index, nvtx):
        engine.step()
    offline.sync(device)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    if engine.num_scheduled_last_step == 0:
        # check_context keeps every request running through the window; this one was emptied
        # some other way (KV preemption, an engine change): an idle step is no profile
        raise RuntimeError(f"recorded step {index} ran no sequence: the profiled requests had "
                           f"finished or were waiting; lower --skip-steps or --num-steps, or give "
                           f"the KV cache more room (--num-kv-blocks, --gpu-memory-utilization)")
    return elapsed_ms


def run_profile(cfg: ProfileConfig, output_dir: Path) -> dict[str, Any]:
    check_context(cfg)
    device = resolve_device(cfg.engine_kwargs.get("device", "auto"))
    roofs = ceilings(device, cfg.peak_gbps, cfg.peak_tflops)  # before the KV pool takes memory
    llm = offline.build_llm(cfg.model, cfg.engine_kwargs)
    engine = llm.engine
    vocab = engine.loaded.arch.vocab_size
    seed = int(cfg.engine_kwargs.get("seed", 0))
    # nobody finishes before the window's last step (check_context), nor asks for more than
    # the context holds: the workload records what the requests could run to
    output_len = min(cfg.skip_steps + cfg.num_steps + 1, engine.max_model_len - cfg.input_len)
    spec = WorkloadSpec("fixed", cfg.batch_size, cfg.input_len, output_len, seed=seed)
    warmup = derived_requests(spec, vocab, WARMUP_SEED_OFFSET, output_len=WARMUP_OUTPUT_LEN)
    offline.run_requests(llm, warmup)
    for i, r in enumerate(build_requests(spec, vocab)):
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
                    step_ms = [_step(engine, i, nvtx, device) for i in range(cfg.num_steps)]
                prof.export_chrome_trace(str(output_dir / "trace.json"))
                events = list(prof.events())
                with open(output_dir / "trace.json") as f:
                    launches = launch_rows(json.load(f))
            else:
                step_ms = [_step(engine, i, nvtx, device) for i in range(cfg.num_steps)]
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
                  dtype=str(engine.loaded.dtype), nvtx=nvtx,
                  warmup_prompts=len(warmup), warmup_output_len=warmup[0].output_len,
                  trace="trace.json" if cfg.torch_profiler else None)
    offline.free_llm(llm)
    return make_result("profile", device, config, spec.to_dict(), [metrics], [], roofs)

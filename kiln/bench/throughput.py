"""``kiln bench throughput``: N requests from a workload, all submitted at once.

Elapsed time runs from the first ``add_request`` to the last finished request (after a few
short warm-up requests on other prompts, not counted). Input and output token counts are the
engine's own (prompt token ids it holds, tokens it generated).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.bench import offline
from kiln.bench.hf_peer import HFPeer
from kiln.bench.result import make_result
from kiln.bench.stats import latency_metrics
from kiln.bench.telemetry import GpuTelemetry
from kiln.bench.workload import (
    WARMUP_SEED_OFFSET,
    WorkloadSpec,
    build_requests,
    derived_requests,
)
from kiln.models.loader import resolve_device, resolve_model_path
from kiln.progress import make_progress

WARMUP_OUTPUT_LEN = 16


@dataclass
class ThroughputConfig:
    model: str
    workload: WorkloadSpec
    num_warmups: int = 4
    peer: str | None = None
    peer_batch_size: int | None = None  # None: every request in one generate call
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


def throughput_metrics(records: list[dict], elapsed_s: float) -> dict[str, Any]:
    num_in = sum(r["prompt_tokens"] for r in records)
    num_out = sum(r["output_tokens"] for r in records)
    return {"elapsed_s": elapsed_s, "num_requests": len(records),
            "total_input_tokens": num_in, "total_output_tokens": num_out,
            "requests_per_s": len(records) / elapsed_s,
            "output_tokens_per_s": num_out / elapsed_s,
            "total_tokens_per_s": (num_in + num_out) / elapsed_s,
            **latency_metrics(records)}


def _run_kiln(cfg: ThroughputConfig, progress: Any) -> tuple[dict, list[dict], dict]:
    llm = offline.build_llm(cfg.model, cfg.engine_kwargs)
    loaded = llm.engine.loaded
    requests = build_requests(cfg.workload, loaded.arch.vocab_size)
    if cfg.num_warmups:
        warm = derived_requests(cfg.workload, loaded.arch.vocab_size, WARMUP_SEED_OFFSET,
                                cfg.num_warmups, WARMUP_OUTPUT_LEN)
        offline.run_requests(llm, warm, progress, "warm-up")
    offline.sync(loaded.device)
    with GpuTelemetry.of(loaded.device) as gpu:
        t0 = time.monotonic()
        outs = offline.run_requests(llm, requests, progress, f"{len(requests)} requests")
        offline.sync(loaded.device)
        elapsed = time.monotonic() - t0
    records = [offline.request_record(out, 0, t0) for out in outs]
    metrics = {"case": {"num_prompts": len(requests)}, **throughput_metrics(records, elapsed)}
    metrics["gpu"] = gpu.summary(elapsed, metrics["total_output_tokens"])
    info = {"dtype": loaded.dtype, "device": loaded.device, "path": loaded.path,
            "startup_seconds": llm.engine.startup_seconds, "requests": requests,
            "scheduler": asdict(llm.engine.config.scheduler)}
    del loaded, outs
    offline.free_llm(llm)  # before the peer loads into the same device memory
    return metrics, records, info


def _run_peer(cfg: ThroughputConfig, info: dict, metrics: dict, progress: Any) -> str:
    task = progress.add_task("HF peer", total=None)
    requests = info["requests"]
    peer = HFPeer(Path(info["path"] or resolve_model_path(cfg.model)), info["dtype"],
                  info["device"], cfg.engine_kwargs.get("load_format", "auto"))
    if cfg.num_warmups:
        peer.generate([r.prompt for r in requests[:cfg.num_warmups]], WARMUP_OUTPUT_LEN)
    pm = peer.run_batches(requests, cfg.peer_batch_size or len(requests))
    metrics["peer"] = pm
    metrics["peer_speedup"] = {  # > 1: Kiln is faster
        k: metrics[k] / pm[k] for k in ("requests_per_s", "output_tokens_per_s",
                                        "total_tokens_per_s")}
    progress.remove_task(task)
    return peer.name


def run_throughput(cfg: ThroughputConfig) -> dict[str, Any]:
    device = resolve_device(cfg.engine_kwargs.get("device", "auto"))
    with make_progress() as progress:
        metrics, records, info = _run_kiln(cfg, progress)
        peer_name = _run_peer(cfg, info, metrics, progress) if cfg.peer == "hf" else None
    config = {k: v for k, v in asdict(cfg).items() if k not in ("engine_kwargs", "workload")}
    config.update(engine=cfg.engine_kwargs, engine_defaults=offline.BENCH_ENGINE_DEFAULTS,
                  peer_engine=peer_name, warmup_output_len=WARMUP_OUTPUT_LEN,
                  dtype=str(info["dtype"]), startup_seconds=info["startup_seconds"],
                  scheduler=info["scheduler"])  # as resolved: the offline step budget
    return make_result("throughput", device, config, cfg.workload.to_dict(), [metrics], records)

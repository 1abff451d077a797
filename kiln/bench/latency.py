"""``kiln bench latency``: batch size x prompt length x output length on ``kiln.LLM``.

Each case runs ``num_iters`` batches of fresh random prompts (after ``num_iters_warmup``
shorter ones), all submitted at once. Reported per case: TTFT, TPOT (per-token latency), ITL,
decode tok/s (``batch_size / TPOT``), and the bandwidth a decode step achieves: the bytes it
must read (weights as stored, quantized codes and scales included, minus the embedding table,
plus the KV cache of the batch at its mean context) over TPOT, set against the device's copy
bandwidth.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.bench import offline
from kiln.bench.env import measure_bandwidth_gbps
from kiln.bench.hf_peer import HFPeer
from kiln.bench.result import make_result
from kiln.bench.stats import latency_metrics, request_latencies, summarize
from kiln.bench.telemetry import GpuTelemetry
from kiln.bench.workload import BenchRequest, WorkloadSpec, build_requests
from kiln.models.loader import resolve_device, resolve_model_path
from kiln.progress import make_progress

WARMUP_OUTPUT_LEN = 32  # enough decode steps to compile every kernel variant, not a full run


@dataclass
class LatencyConfig:
    model: str
    batch_sizes: list[int]
    input_lens: list[int]
    output_lens: list[int]
    num_iters: int = 3
    num_iters_warmup: int = 1
    peer: str | None = None  # "hf": the same cases through transformers generate
    peer_num_iters: int = 1
    bandwidth_gbps: float | None = None  # the ceiling; measured when None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def seed(self) -> int:
        return int(self.engine_kwargs.get("seed", 0))

    def cases(self) -> list[tuple[int, int, int]]:
        return [(b, i, o) for b in self.batch_sizes for i in self.input_lens
                for o in self.output_lens]


def case_requests(cfg: LatencyConfig, case: int, batch_size: int, input_len: int,
                  output_len: int, vocab_size: int) -> list[list[BenchRequest]]:
    """Warm-up then measured batches of one case: fresh prompts each, the same for the peer."""
    num_batches = cfg.num_iters_warmup + max(cfg.num_iters, cfg.peer_num_iters)
    spec = WorkloadSpec("fixed", batch_size * num_batches, input_len, output_len,
                        seed=cfg.seed + 1000 * case)
    reqs = build_requests(spec, vocab_size)
    return [reqs[i * batch_size:(i + 1) * batch_size] for i in range(num_batches)]


def _case_metrics(records: list[dict], batch_seconds: list[float], batch_size: int,
                  output_len: int) -> dict[str, Any]:
    m: dict[str, Any] = {"latency_s": summarize(batch_seconds), **latency_metrics(records)}
    tpot_ms = m["tpot_ms"]["mean"]  # None when every output is one token long
    m["decode_tokens_per_s"] = None if tpot_ms is None else batch_size / (tpot_ms / 1e3)
    m["output_tokens_per_s"] = batch_size * output_len / m["latency_s"]["mean"]
    return m


def _bandwidth(m: dict[str, Any], batch_size: int, input_len: int, output_len: int,
               weight_bytes: int, kv_bytes_per_token: int, ceiling_gbps: float) -> None:
    # a decode step reads every weight once and the KV of each sequence at its mean context
    kv_read = batch_size * (input_len + output_len / 2) * kv_bytes_per_token
    step_bytes = weight_bytes + kv_read
    m["bytes_per_decode_step"] = step_bytes
    m["roofline_decode_tokens_per_s"] = batch_size * ceiling_gbps * 1e9 / step_bytes
    if m["tpot_ms"]["mean"] is None:  # one-token outputs: no decode step to measure
        m["achieved_gbps"] = m["bandwidth_utilization"] = None
        return
    tpot_s = m["tpot_ms"]["mean"] / 1e3
    m["achieved_gbps"] = step_bytes / tpot_s / 1e9
    m["bandwidth_utilization"] = m["achieved_gbps"] / ceiling_gbps


def check_cases(cfg: LatencyConfig, max_model_len: int) -> None:
    """Refuse a case past the context before any case runs: run_requests checks each batch as
    it comes, so the case would otherwise fail only after the cases before it had run."""
    for i in cfg.input_lens:
        for o in cfg.output_lens:
            if i + o > max_model_len:
                raise ValueError(
                    f"--input-len {i} + --output-len {o} needs {i + o} tokens of context, more "
                    f"than max_model_len={max_model_len}: lower them (or raise --max-model-len "
                    f"where the model allows)")


def _run_kiln(cfg: LatencyConfig, progress: Any) -> tuple[list[dict], list[dict], dict]:
    llm = offline.build_llm(cfg.model, cfg.engine_kwargs)
    check_cases(cfg, llm.engine.max_model_len)
    loaded = llm.engine.loaded
    info = {"weight_bytes": offline.weight_bytes(loaded.model),
            "kv_bytes_per_token": offline.kv_bytes_per_token(llm), "dtype": loaded.dtype,
            "device": loaded.device, "vocab_size": loaded.arch.vocab_size,
            "startup_seconds": llm.engine.startup_seconds,
            "scheduler": asdict(llm.engine.config.scheduler)}
    metrics, records = [], []
    gpu = GpuTelemetry.of(loaded.device)
    for case, (b, i, o) in enumerate(cfg.cases()):
        batches = case_requests(cfg, case, b, i, o, info["vocab_size"])
        for w in range(cfg.num_iters_warmup):
            warm = [BenchRequest(r.prompt, min(o, WARMUP_OUTPUT_LEN)) for r in batches[w]]
            offline.run_requests(llm, warm, progress, f"warm-up bs={b} in={i} out={o}")
        seconds, case_records = [], []
        offline.sync(loaded.device)
        with gpu:  # the case's iterations back to back
            span_start = time.monotonic()
            for it in range(cfg.num_iters):
                offline.sync(loaded.device)
                t0 = time.monotonic()
                outs = offline.run_requests(
                    llm, batches[cfg.num_iters_warmup + it], progress,
                    f"bs={b} in={i} out={o} iter {it + 1}/{cfg.num_iters}")
                offline.sync(loaded.device)
                seconds.append(time.monotonic() - t0)
                case_records += [offline.request_record(out, case, t0) for out in outs]
            span_s = time.monotonic() - span_start
        m = {"case": {"batch_size": b, "input_len": i, "output_len": o},
             "num_iters": cfg.num_iters, **_case_metrics(case_records, seconds, b, o)}
        m["gpu"] = gpu.summary(span_s, sum(r["output_tokens"] for r in case_records))
        metrics.append(m)
        records += case_records
    info["model_path"] = loaded.path
    del loaded
    offline.free_llm(llm)  # before the peer loads into the same device memory
    return metrics, records, info


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _run_peer(cfg: LatencyConfig, info: dict, metrics: list[dict], progress: Any) -> str:
    path = info["model_path"] or resolve_model_path(cfg.model)
    peer = HFPeer(Path(path), info["dtype"], info["device"],
                  cfg.engine_kwargs.get("load_format", "auto"))
    task = progress.add_task("HF peer", total=len(metrics))
    for case, (m, (b, i, o)) in enumerate(zip(metrics, cfg.cases(), strict=True)):
        batches = case_requests(cfg, case, b, i, o, info["vocab_size"])
        if cfg.num_iters_warmup:
            peer.generate([r.prompt for r in batches[0]], min(o, WARMUP_OUTPUT_LEN))
        seconds, recs = [], []
        for it in range(cfg.peer_num_iters):
            start, times, end, _ = peer.generate(
                [r.prompt for r in batches[cfg.num_iters_warmup + it]], o)
            seconds.append(end - start)
            lat = request_latencies(start, times, end, o)
            recs += [{"ttft_ms": lat.ttft_ms, "tpot_ms": lat.tpot_ms, "itl_ms": lat.itl_ms,
                      "e2e_ms": lat.e2e_ms}] * b
        pm = {"num_iters": cfg.peer_num_iters, **_case_metrics(recs, seconds, b, o)}
        m["peer"] = pm
        m["peer_speedup"] = {  # > 1: Kiln is faster
            "decode_tokens_per_s": _ratio(m["decode_tokens_per_s"], pm["decode_tokens_per_s"]),
            "output_tokens_per_s": _ratio(m["output_tokens_per_s"], pm["output_tokens_per_s"]),
            "ttft_ms": _ratio(pm["ttft_ms"]["mean"], m["ttft_ms"]["mean"]),
            "latency_s": _ratio(pm["latency_s"]["mean"], m["latency_s"]["mean"])}
        progress.advance(task)
    progress.remove_task(task)
    name = peer.name
    del peer
    return name


def run_latency(cfg: LatencyConfig) -> dict[str, Any]:
    device = resolve_device(cfg.engine_kwargs.get("device", "auto"))
    # measured before the engine takes most of the device memory for its KV pool
    ceiling = cfg.bandwidth_gbps or measure_bandwidth_gbps(device)
    ceilings = {"bandwidth_gbps": ceiling,
                "bandwidth_source": "given" if cfg.bandwidth_gbps
                else "measured: device-to-device copy"}
    with make_progress() as progress:
        metrics, records, info = _run_kiln(cfg, progress)
        for m in metrics:
            c = m["case"]
            _bandwidth(m, c["batch_size"], c["input_len"], c["output_len"], info["weight_bytes"],
                       info["kv_bytes_per_token"], ceiling)
        peer_name = _run_peer(cfg, info, metrics, progress) if cfg.peer == "hf" else None
    config = {k: v for k, v in asdict(cfg).items() if k != "engine_kwargs"}
    config.update(engine=cfg.engine_kwargs, engine_defaults=offline.BENCH_ENGINE_DEFAULTS,
                  peer_engine=peer_name, warmup_output_len=WARMUP_OUTPUT_LEN,
                  weight_bytes=info["weight_bytes"], kv_bytes_per_token=info["kv_bytes_per_token"],
                  dtype=str(info["dtype"]), startup_seconds=info["startup_seconds"],
                  scheduler=info["scheduler"])  # as resolved: the offline step budget
    workload = {"dataset_name": "fixed", "seed": cfg.seed,
                "prompts": "fresh random token ids per iteration, in [10, min(120000, vocab))"}
    return make_result("latency", device, config, workload, metrics, records, ceilings)

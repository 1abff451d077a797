"""``kiln bench serve``: load a running OpenAI-compatible server and measure what clients see.

Requests leave on a schedule (Poisson or constant arrivals at ``request_rate``; ``inf`` sends
them all at once), optionally capped at ``max_concurrency`` in flight (with ``inf``, a fixed
concurrency load). Each rate of a sweep draws fresh prompts of the same lengths (seed + 1000 *
its index; a JSONL dataset is replayed as is), so no rate hits prefix-cache blocks left by
another; the arrival draw uses the workload seed.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np
import torch

from kiln.bench.env import device_info
from kiln.bench.result import make_result
from kiln.bench.serve_client import (
    StreamResult,
    completion_payload,
    stream_completion,
)
from kiln.bench.serve_client import wait_for_server as _wait
from kiln.bench.stats import goodput, latency_metrics, request_latencies
from kiln.bench.workload import (
    WARMUP_SEED_OFFSET,
    BenchRequest,
    WorkloadSpec,
    derived_requests,
)
from kiln.progress import make_progress

ARRIVALS = ("poisson", "constant")
WARMUP_OUTPUT_LEN = 16
RATE_SEED_STEP = 1000  # rate i of a sweep draws its prompts with seed + i * 1000


@dataclass
class ServeConfig:
    base_url: str
    workload: WorkloadSpec
    request_rates: list[float] = field(default_factory=lambda: [math.inf])
    arrival: str = "poisson"
    max_concurrency: int | None = None
    num_warmups: int = 1
    model: str | None = None  # the name sent in each request; the server's first model if None
    endpoint: str = "/v1/completions"
    ignore_eos: bool = True
    slos: dict[str, float] = field(default_factory=dict)  # metric name -> ms
    ready_check_timeout_s: float = 60.0
    request_timeout_s: float = 600.0
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival={self.arrival!r}; choose one of {', '.join(ARRIVALS)}")
        if not self.request_rates or any(not r > 0 for r in self.request_rates):
            raise ValueError(f"request rates must be > 0 (inf for all at once), got "
                             f"{self.request_rates}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


def arrival_offsets(n: int, rate: float, arrival: str, seed: int) -> np.ndarray:
    """Send times in seconds after the start; the first request leaves at 0."""
    if math.isinf(rate):
        return np.zeros(n)
    if arrival == "constant":
        return np.arange(n) / rate
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def serve_record(res: StreamResult, req: BenchRequest, case: int, t0: float,
                 index: int) -> dict[str, Any]:
    lat = request_latencies(res.start, res.chunk_times, res.end, res.completion_tokens)
    return {
        "case": case, "id": str(index), "ok": res.ok, "error": res.error,
        "prompt_tokens": res.prompt_tokens, "output_tokens": res.completion_tokens,
        "requested_prompt_tokens": req.prompt_len, "requested_output_tokens": req.output_len,
        "finish_reason": res.finish_reason, "num_chunks": len(res.chunk_times),
        "start_s": round(res.start - t0, 6), "ttft_ms": lat.ttft_ms, "tpot_ms": lat.tpot_ms,
        "e2e_ms": lat.e2e_ms, "itl_ms": [round(x, 4) for x in lat.itl_ms],
        "output_times_s": [round(t - t0, 6) for t in res.chunk_times],
    }


def serve_metrics(records: list[dict], duration_s: float, slos: dict[str, float]
                  ) -> dict[str, Any]:
    ok = [r for r in records if r["ok"]]
    num_in = sum(r["prompt_tokens"] or 0 for r in ok)
    num_out = sum(r["output_tokens"] or 0 for r in ok)
    m: dict[str, Any] = {
        "duration_s": duration_s, "num_completed": len(ok),
        "num_failed": len(records) - len(ok),
        "num_missing_usage": sum(r["output_tokens"] is None for r in ok),
        "total_input_tokens": num_in, "total_output_tokens": num_out,
        "requests_per_s": len(ok) / duration_s, "output_tokens_per_s": num_out / duration_s,
        "total_tokens_per_s": (num_in + num_out) / duration_s,
        **latency_metrics(ok)}
    if slos:
        m["slos_ms"] = slos
        m["goodput_requests_per_s"] = goodput(records, slos, duration_s)
    return m


async def _run_rate(client: httpx.AsyncClient, cfg: ServeConfig, model: str,
                    requests: list[BenchRequest], rate: float, case: int, progress: Any
                    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    url = cfg.base_url.rstrip("/") + cfg.endpoint
    offsets = arrival_offsets(len(requests), rate, cfg.arrival, cfg.workload.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency or len(requests))
    task = progress.add_task(f"rate {rate:g} req/s", total=len(requests))
    max_in_flight = in_flight = 0

    async def one(req: BenchRequest) -> StreamResult:
        nonlocal max_in_flight, in_flight
        async with limit:
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            try:
                return await stream_completion(
                    client, url, completion_payload(model, req.prompt, req.output_len,
                                                    cfg.ignore_eos))
            finally:
                in_flight -= 1
                progress.advance(task)

    t0 = time.monotonic()
    tasks = []
    for offset, req in zip(offsets, requests, strict=True):
        delay = t0 + float(offset) - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    results = await asyncio.gather(*tasks)
    duration = max(r.end or t0 for r in results) - t0
    progress.remove_task(task)
    records = [serve_record(r, q, case, t0, i)
               for i, (r, q) in enumerate(zip(results, requests, strict=True))]
    metrics = {"case": {"request_rate": rate, "arrival": cfg.arrival,
                        "max_concurrency": cfg.max_concurrency},
               "max_in_flight": max_in_flight, **serve_metrics(records, duration, cfg.slos)}
    return metrics, records


async def run_serve_async(cfg: ServeConfig, transport: httpx.AsyncBaseTransport | None = None
                          ) -> dict[str, Any]:
    """Every rate of ``cfg``; ``transport`` replaces the network (tests)."""
    served = await _wait(cfg.base_url, cfg.ready_check_timeout_s, transport)
    model = cfg.model or (served[0] if served else None)
    if model is None:
        raise ValueError(f"{cfg.base_url}/v1/models lists no model; pass --served-model-name")
    vocab_size = cfg.vocab_size or local_vocab_size(model)
    metrics, records = [], []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=cfg.request_timeout_s, limits=limits,
                                 transport=transport) as client:
        with make_progress() as progress:
            if cfg.num_warmups:
                url = cfg.base_url.rstrip("/") + cfg.endpoint
                warm = await asyncio.gather(*[
                    stream_completion(client, url, completion_payload(
                        model, r.prompt, r.output_len, cfg.ignore_eos))
                    for r in derived_requests(cfg.workload, vocab_size, WARMUP_SEED_OFFSET,
                                              cfg.num_warmups, WARMUP_OUTPUT_LEN)])
                failed = [w.error for w in warm if not w.ok]
                if failed:
                    raise RuntimeError(f"warm-up request failed: {failed[0]}")
            for case, rate in enumerate(cfg.request_rates):
                requests = derived_requests(cfg.workload, vocab_size, case * RATE_SEED_STEP)
                m, recs = await _run_rate(client, cfg, model, requests, rate, case, progress)
                metrics.append(m)
                records += recs
    config = {k: v for k, v in asdict(cfg).items() if k != "workload"}
    config.update(served_model=model, vocab_size=vocab_size, warmup_output_len=WARMUP_OUTPUT_LEN)
    return make_result("serve", server_device(cfg.base_url), config, cfg.workload.to_dict(),
                       metrics, records)


def local_vocab_size(model: str) -> int | None:
    """The vocabulary of the served ``model`` where its name is a Kiln zoo model or a local
    checkpoint directory (servers started with a path name the model so), else None: without
    --model the random token ids then still fit the server's vocabulary (kiln-tiny has 8192
    ids, the workloads' default range reaches 120000). Never downloads."""
    from kiln.models.loader import read_json
    from kiln.zoo import ZOO_MODELS, model_path

    path = Path(model_path(model)) if model in ZOO_MODELS else Path(model).expanduser()
    try:
        return int(read_json(path / "config.json")["vocab_size"])
    except (FileNotFoundError, ValueError, KeyError, OSError):
        return None


def server_device(base_url: str) -> dict[str, Any]:
    """The server's device when it runs on this machine (loopback); otherwise unknown."""
    host = urlparse(base_url).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1"):
        return {"type": "remote", "name": f"unknown (server at {host})"}
    info = device_info("cuda" if torch.cuda.is_available() else "cpu")
    info["note"] = "server on loopback: this machine's device"
    return info


def run_serve(cfg: ServeConfig) -> dict[str, Any]:
    return asyncio.run(run_serve_async(cfg))

"""Running a batch of benchmark requests through the in-process engine, and what to record.

Requests are added to ``kiln.LLM``'s engine all at once and stepped to completion; the
timestamps come from each ``RequestOutput.metrics`` (time.monotonic, taken by the engine as
tokens are appended), so no client-side guessing enters the figures.
"""

from __future__ import annotations

import gc
import itertools
from typing import Any

import torch
from rich.progress import Progress
from torch import nn

from kiln.bench.stats import request_latencies
from kiln.bench.workload import BenchRequest
from kiln.layers.embedding import VocabParallelEmbedding
from kiln.layers.rotary import RotaryEmbedding
from kiln.llm import LLM
from kiln.outputs import RequestOutput
from kiln.sampling.params import SamplingParams

# The benchmark measures compute, not cache reuse: repeated or warm-up prompts would otherwise
# hit the prefix cache (the peers in shared/GPU.md ran with prefix caching off too).
BENCH_ENGINE_DEFAULTS = {"enable_prefix_caching": False}

_ids = itertools.count()


def build_llm(model: str, engine_kwargs: dict[str, Any]) -> LLM:
    kwargs = {**BENCH_ENGINE_DEFAULTS, **engine_kwargs}
    return LLM(model, **kwargs)


def free_llm(llm: LLM) -> None:
    """Drop the engine's weights and KV pool so a peer can load into the same GPU memory."""
    engine = llm.engine
    engine.kv_cache = engine.runner = engine.loaded = None  # type: ignore[assignment]
    llm.engine = None  # type: ignore[assignment]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def greedy_params(output_len: int) -> SamplingParams:
    """Greedy, and every request runs to its full output length."""
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def run_requests(llm: LLM, requests: list[BenchRequest], progress: Progress | None = None,
                 description: str = "requests") -> list[RequestOutput]:
    """Submit every request at once, step to completion; outputs in request order. A request
    that cannot run to its full output length within max_model_len is an error before any is
    submitted: it would stop short, and the figures cover fewer tokens than they say."""
    engine = llm.engine
    made = [engine.make_request(f"bench-{next(_ids)}", r.prompt, greedy_params(r.output_len))
            for r in requests]
    for request, r in zip(made, requests, strict=True):
        needed = len(request.prompt_token_ids) + r.output_len
        if needed > engine.max_model_len:
            raise ValueError(
                f"a request of {len(request.prompt_token_ids)} prompt tokens and {r.output_len} "
                f"to generate needs {needed} tokens of context, more than max_model_len="
                f"{engine.max_model_len}: lower --input-len or --output-len (or raise "
                f"--max-model-len where the model allows)")
    for request in made:
        engine.enqueue(request)
    request_ids = [request.request_id for request in made]
    total = sum(r.output_len for r in requests)
    task = progress.add_task(description, total=total) if progress is not None else None
    finished: dict[str, RequestOutput] = {}
    produced: dict[str, int] = {}
    for out in engine.stream_outputs():
        if task is not None:
            n = len(out.outputs[0].token_ids)
            progress.advance(task, n - produced.get(out.request_id, 0))
            produced[out.request_id] = n
        if out.finished:
            finished[out.request_id] = out
    if task is not None:
        progress.remove_task(task)
    return [finished[rid] for rid in request_ids]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def request_record(out: RequestOutput, case: int, t0: float) -> dict[str, Any]:
    """The raw timings of one finished request; times in seconds since ``t0``."""
    m = out.metrics
    if m is None:
        raise RuntimeError(f"request {out.request_id} has no metrics")
    num_output = len(out.outputs[0].token_ids)
    lat = request_latencies(m.arrival_time, m.token_times, m.finished_time, num_output)
    return {
        "case": case, "id": out.request_id, "ok": out.outputs[0].finish_reason == "length",
        "prompt_tokens": len(out.prompt_token_ids), "output_tokens": num_output,
        "start_s": round(m.arrival_time - t0, 6),
        "first_scheduled_s": None if m.first_scheduled_time is None
        else round(m.first_scheduled_time - t0, 6),
        "ttft_ms": lat.ttft_ms, "tpot_ms": lat.tpot_ms, "e2e_ms": lat.e2e_ms,
        "itl_ms": [round(x, 4) for x in lat.itl_ms],
        "output_times_s": [round(t - t0, 6) for t in m.token_times],
    }


def _gathered(module: nn.Module) -> bool:
    """Tables a step reads one row of per token (by token id or position), not in full."""
    return isinstance(module, RotaryEmbedding | VocabParallelEmbedding)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter and buffer of the model (quantized
    Linears, the LM head among them, hold their codes, scales and zeros as buffers) except the
    input embedding and rotary tables. A dense tied LM head shares the embedding's tensor and
    counts it once; a quantized one counts its codes, not the embedding table it came from."""
    read = {id(t): t for module in model.modules() if not _gathered(module)
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]}
    return sum(t.numel() * t.element_size() for t in read.values())


def kv_bytes_per_token(llm: LLM) -> int:
    """K and V of one token over all layers, in the KV cache's dtype."""
    engine = llm.engine
    k = engine.kv_cache.k_caches[0]
    per_layer = k[0, 0].numel() * k.element_size()  # [num_kv_heads, head_dim]
    return 2 * per_layer * len(engine.kv_cache.k_caches)

"""Counters and gauges the server's /metrics and the benchmarks read from the engine."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field

# vLLM's buckets for iteration_tokens_total: the engine bins with them, /metrics exports as is
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class BucketCounts:
    """A histogram of one value per engine step, in fixed memory (a list of every step's value
    would grow without bound in offline runs that nobody scrapes)."""

    def __init__(self, bounds: tuple[int, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # counts[i]: bounds[i-1] < value <= bounds[i]
        self.sum = 0

    def observe(self, value: int) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


@dataclass
class EngineStats:
    num_running: int = 0  # requests
    num_waiting: int = 0
    num_swapped: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    num_kv_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_by_reason: Counter = field(default_factory=Counter)
    # per step that sampled: the prompts that got their first token plus the tokens sampled
    iteration_tokens: BucketCounts = field(
        default_factory=lambda: BucketCounts(ITERATION_TOKENS_BUCKETS))

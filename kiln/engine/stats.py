"""Counters and gauges the server's /metrics and the benchmarks read from the engine."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


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

"""Prometheus metrics for ``GET /metrics``, named ``kiln:*`` after vLLM's ``vllm:*``.

Dashboards built for vLLM work after renaming the prefix. Two sources:

* per-request histograms and per-sample finish counts, observed by the server when a request
  ends (from the engine's ``RequestMetrics`` timestamps);
* engine gauges and counters, read from the engine at scrape time by a custom collector, so
  they are never stale and cost nothing between scrapes.

Each app has its own ``CollectorRegistry`` (no process globals), so tests can build many apps.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.outputs import RequestOutput

# vLLM's buckets, so percentiles line up with its dashboards
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector(Collector):
    """Gauges and counters read live from the engine (nothing while it is still loading)."""

    def __init__(self, get_engine: Callable[[], Any], model_name: str) -> None:
        self._get_engine = get_engine
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        async_engine = self._get_engine()
        if async_engine is None:
            return
        engine = async_engine.engine
        stats, scheduler = engine.stats, engine.scheduler
        labels = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        # Queue lengths and KV usage come from the live structures, not EngineStats: the stats
        # are refreshed only by step(), so an abort on an idle engine would leave them stale.
        yield gauge("kiln:num_requests_running", "Requests in the running batch.",
                    len(scheduler.running))
        yield gauge("kiln:num_requests_waiting", "Requests waiting to be scheduled.",
                    len(scheduler.waiting))
        yield gauge("kiln:num_requests_swapped", "Requests swapped out to CPU memory.",
                    len(scheduler.swapped))
        yield gauge("kiln:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
                    engine.kv.usage)
        yield gauge("kiln:num_kv_cache_blocks", "Blocks in the KV-cache pool.",
                    engine.kv_cache.num_blocks)
        yield counter("kiln:prompt_tokens", "Prefilled prompt tokens.", stats.prompt_tokens)
        yield counter("kiln:generation_tokens", "Generated tokens.", stats.generation_tokens)
        yield counter("kiln:num_preemptions", "Preemptions of running requests.",
                      scheduler.num_preemptions)
        yield counter("kiln:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      engine.kv.stats.prefix_cache_queries)
        yield counter("kiln:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      engine.kv.stats.prefix_cache_hits)


class ServerMetrics:
    def __init__(self, model_name: str, get_engine: Callable[[], Any]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(get_engine, model_name))
        reg, name = self.registry, ["model_name"]

        def histogram(metric: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(metric, doc, name, buckets=buckets, registry=reg).labels(model_name)

        # Per sample, as vLLM counts its request_success (one per finished sequence); the
        # histograms below observe each prompt's engine request once, whatever its n.
        self.request_success = Counter(
            "kiln:request_success", "Finished samples by finish reason (stop, length, abort; "
            "a failed engine step aborts): one per choice, so n=3 adds 3 here and 1 to the "
            "per-request histograms.",
            ["model_name", "finished_reason"], registry=reg)
        self.http_requests = Counter(
            "kiln:http_requests", "HTTP responses by endpoint and status code.",
            ["endpoint", "status"], registry=reg)
        self.ttft = histogram("kiln:time_to_first_token_seconds",
                              "Arrival to first generated token.", TTFT_BUCKETS)
        self.itl = histogram("kiln:inter_token_latency_seconds",
                             "Time between consecutive output steps of a request.",
                             TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("kiln:request_time_per_output_token_seconds",
                              "Per request: decode time / (output steps - 1).",
                              TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("kiln:e2e_request_latency_seconds", "Arrival to finish.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("kiln:request_queue_time_seconds",
                               "Arrival to first scheduled.", REQUEST_LATENCY_BUCKETS)
        self.prompt_len = histogram("kiln:request_prompt_tokens", "Prompt tokens per request.",
                                    TOKEN_COUNT_BUCKETS)
        self.generation_len = histogram("kiln:request_generation_tokens",
                                        "Generated tokens per request (all samples).",
                                        TOKEN_COUNT_BUCKETS)

    def observe_finished(self, output: RequestOutput) -> None:
        for choice in output.outputs:
            self.request_success.labels(self.model_name, choice.finish_reason or "abort").inc()
        self.prompt_len.observe(len(output.prompt_token_ids))
        self.generation_len.observe(sum(len(c.token_ids) for c in output.outputs))
        m = output.metrics
        if m is None:
            return
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        for earlier, later in itertools.pairwise(m.token_times):
            self.itl.observe(later - earlier)
        if len(m.token_times) > 1:
            decode_time = m.token_times[-1] - m.token_times[0]
            self.tpot.observe(decode_time / (len(m.token_times) - 1))
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def observe_aborted(self, num_samples: int) -> None:
        self.request_success.labels(self.model_name, "abort").inc(num_samples)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

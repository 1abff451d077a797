"""Prometheus metrics for ``GET /metrics``, named ``kiln:*`` after vLLM's ``vllm:*``.

Dashboards built for vLLM work after renaming the prefix. Two sources:

* per-request histograms and per-sample finish counts, observed by the server when a request
  ends (from the engine's ``RequestMetrics`` timestamps);
* engine gauges, counters and the per-step token histogram, read from the engine at scrape
  time by a custom collector, so they are never stale and cost nothing between scrapes.

Each app has its own ``CollectorRegistry`` (no process globals), so tests can build many apps.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kiln.engine.stats import BucketCounts
from kiln.outputs import RequestMetrics, RequestOutput
from kiln.sampling.params import SamplingParams

# vLLM's buckets, so percentiles line up with its dashboards
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM sizes its token-count buckets 1-2-5 up to max_model_len; these are fixed because the app
# and its histograms exist before a lazily loaded engine says what max_model_len is
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _histogram_family(name: str, doc: str, label_values: list[str],
                      counts: BucketCounts) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    cumulative = list(itertools.accumulate(counts.counts))  # a copy: the engine thread adds
    buckets = [(floatToGoString(b), c) for b, c in zip(counts.bounds, cumulative, strict=False)]
    family.add_metric(label_values, buckets + [("+Inf", cumulative[-1])], counts.sum)
    return family


class _EngineCollector(Collector):
    """Gauges, counters and the per-step histogram read live from the engine (nothing while it
    is still loading)."""

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
        yield _histogram_family(
            "kiln:iteration_tokens_total", "Tokens per engine step that sampled, as vLLM counts "
            "them: whole prompts of the requests that got their first token, plus tokens "
            "sampled.", labels, stats.iteration_tokens)
        cache = engine.config.cache
        # vLLM's cache_config_info: an info gauge, 1, whose labels carry the settings
        info = {"block_size": cache.block_size, "num_gpu_blocks": engine.kv_cache.num_blocks,
                "num_cpu_blocks": engine.kv.cpu_pool.num_blocks,
                "gpu_memory_utilization": cache.gpu_memory_utilization,
                "swap_space": cache.swap_space, "cache_dtype": cache.kv_cache_dtype,
                "enable_prefix_caching": cache.enable_prefix_caching}
        family = GaugeMetricFamily("kiln:cache_config_info", "The engine's KV-cache settings.",
                                   labels=["model_name", *info])
        family.add_metric(labels + [str(v) for v in info.values()], 1)
        yield family


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
        self.max_generation_len = histogram("kiln:request_max_num_generation_tokens",
                                            "Per request: the most tokens any sample generated.",
                                            TOKEN_COUNT_BUCKETS)
        self.params_n = histogram("kiln:request_params_n", "The n request parameter.",
                                  PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("kiln:request_params_max_tokens",
                                           "The max_tokens request parameter, as the engine "
                                           "runs it (a default filled in).", TOKEN_COUNT_BUCKETS)
        self.prefill = histogram("kiln:request_prefill_time_seconds",
                                 "First scheduled to first token (preemptions included).",
                                 REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("kiln:request_decode_time_seconds",
                                "First token to last token.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("kiln:request_inference_time_seconds",
                                   "First scheduled to last token.", REQUEST_LATENCY_BUCKETS)

    def observe_finished(self, output: RequestOutput, params: SamplingParams) -> None:
        for choice in output.outputs:
            self.request_success.labels(self.model_name, choice.finish_reason or "abort").inc()
        self.prompt_len.observe(len(output.prompt_token_ids))
        self.generation_len.observe(sum(len(c.token_ids) for c in output.outputs))
        self.max_generation_len.observe(max(len(c.token_ids) for c in output.outputs))
        self.params_n.observe(params.n)
        if params.max_tokens is not None:
            self.params_max_tokens.observe(params.max_tokens)
        m = output.metrics
        if m is None:
            return
        self._observe_tokens(m)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        if len(m.token_times) > 1:
            decode_time = m.token_times[-1] - m.token_times[0]
            self.tpot.observe(decode_time / (len(m.token_times) - 1))
        if m.first_scheduled_time is not None and m.first_token_time is not None:
            self.prefill.observe(m.first_token_time - m.first_scheduled_time)
            self.decode.observe(m.token_times[-1] - m.first_token_time)
            self.inference.observe(m.token_times[-1] - m.first_scheduled_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def observe_aborted(self, num_samples: int, partial: list[RequestOutput]) -> None:
        """Requests that did not finish (client gone, failed step); ``partial``: the last output
        of each that had produced one.

        As in vLLM v1, which observes time to first token and inter-token latency at each step
        but the per-request histograms only from requests that finish (a client abort never
        reaches them): the tokens an aborted request got count, its other latencies do not.
        """
        self.request_success.labels(self.model_name, "abort").inc(num_samples)
        for output in partial:
            if output.metrics is not None:
                self._observe_tokens(output.metrics)

    def _observe_tokens(self, m: RequestMetrics) -> None:
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        # a copy: an aborted request's list may still gain the token of a step in flight
        for earlier, later in itertools.pairwise(list(m.token_times)):
            self.itl.observe(later - earlier)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

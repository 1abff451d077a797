"""The vLLM v1 metrics beyond the basics (iteration tokens, request phases and parameters, cache
info), their labels and buckets, and which histograms an aborted request reaches."""

from __future__ import annotations

import math

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from .conftest import LONG_CONTEXT, MODEL, assert_idle, wait_until
from .test_metrics import delta, scrape

LATENCY_LE = ("0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0",
              "30.0", "40.0", "50.0", "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0",
              "7680.0", "+Inf")
ITERATION_LE = ("1.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "512.0", "1024.0",
                "2048.0", "4096.0", "8192.0", "16384.0", "+Inf")
PHASES = ("request_prefill_time", "request_decode_time", "request_inference_time")


def families(url: str) -> dict[str, object]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def bucket_bounds(family: object) -> tuple[str, ...]:
    return tuple(s.labels["le"] for s in family.samples if s.name.endswith("_bucket"))


def test_types_labels_and_buckets_are_vllms(server, engine):
    found = families(server.url)
    for name in (*PHASES, "kiln:iteration_tokens_total"):
        name = name if name.startswith("kiln:") else f"kiln:{name}_seconds"
        assert found[name].type == "histogram", name
    for name in ("request_params_n", "request_params_max_tokens",
                 "request_max_num_generation_tokens"):
        assert found[f"kiln:{name}"].type == "histogram", name
    for name in PHASES:
        family = found[f"kiln:{name}_seconds"]
        assert bucket_bounds(family) == LATENCY_LE, name
        assert {s.labels["model_name"] for s in family.samples} == {MODEL}
    assert bucket_bounds(found["kiln:iteration_tokens_total"]) == ITERATION_LE
    assert bucket_bounds(found["kiln:request_params_n"]) == ("1.0", "2.0", "5.0", "10.0",
                                                             "20.0", "+Inf")

    (info,) = found["kiln:cache_config_info"].samples
    assert found["kiln:cache_config_info"].type == "gauge" and info.value == 1
    inner = engine.engine
    assert info.labels == {
        "model_name": MODEL, "block_size": str(inner.config.cache.block_size),
        "num_gpu_blocks": str(inner.kv_cache.num_blocks), "num_cpu_blocks": "0",
        "gpu_memory_utilization": str(inner.config.cache.gpu_memory_utilization),
        "swap_space": str(inner.config.cache.swap_space), "cache_dtype": "auto",
        "enable_prefix_caching": "True"}


def test_new_histograms_agree_with_the_requests_and_each_other(server, engine):
    prompt = "The quick brown fox jumps over the lazy dog."
    num_prompt = len(engine.tokenizer.encode(prompt))
    requests = [(3, 1), (7, 2), (12, 1)]  # (max_tokens, n)
    before = scrape(server.url)
    for max_tokens, n in requests:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "n": n,
                "ignore_eos": True}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
    after = scrape(server.url)

    def d(name: str) -> float:
        return delta(before, after, f"kiln:{name}")

    num_generated = sum(max_tokens * n for max_tokens, n in requests)
    for name in ("request_params_n", "request_params_max_tokens",
                 "request_max_num_generation_tokens", *(f"{p}_seconds" for p in PHASES)):
        assert d(f"{name}_count") == len(requests), name
    assert d("request_params_n_sum") == sum(n for _, n in requests)
    assert d("request_params_max_tokens_sum") == sum(m for m, _ in requests)
    # ignore_eos: every sample runs to max_tokens, so the longest is max_tokens too
    assert d("request_max_num_generation_tokens_sum") == sum(m for m, _ in requests)

    # one prompt each (n samples share it), counted whole when its first token comes
    assert d("prompt_tokens_total") == len(requests) * num_prompt
    assert d("generation_tokens_total") == num_generated
    assert d("iteration_tokens_total_sum") == len(requests) * num_prompt + num_generated
    # the requests ran one after another: a step per output position, none of them empty
    assert d("iteration_tokens_total_count") == sum(m for m, _ in requests)
    assert delta(before, after, "kiln:iteration_tokens_total_bucket", le="+Inf") == \
        d("iteration_tokens_total_count")

    # the phases tile a request: queue + prefill + decode = inference + queue = e2e
    prefill, decode = d("request_prefill_time_seconds_sum"), d("request_decode_time_seconds_sum")
    inference = d("request_inference_time_seconds_sum")
    queue, e2e = d("request_queue_time_seconds_sum"), d("e2e_request_latency_seconds_sum")
    assert prefill > 0 and decode > 0
    assert math.isclose(prefill + decode, inference, rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(queue + inference, e2e, rel_tol=1e-9, abs_tol=1e-9)
    # decode spans the tokens after the first: as many gaps as inter-token latencies
    assert math.isclose(decode, d("inter_token_latency_seconds_sum"), rel_tol=1e-9,
                        abs_tol=1e-9)
    assert_idle(engine)


def test_an_aborted_request_counts_its_tokens_but_no_request_latency(long_server):
    """vLLM v1 observes time to first token and inter-token latency at each step, and the
    per-request histograms only when a request finishes, which a client abort never does."""
    url = long_server.url
    before = scrape(url)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model=MODEL, prompt="hi", stream=True,
                                       max_tokens=LONG_CONTEXT - 100,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(5):
        next(chunks)
    stream.close()
    client.close()
    assert_idle(long_server.state.engine, timeout=1.0)

    def aborted() -> bool:
        now = scrape(url)
        return delta(before, now, "kiln:request_success_total", finished_reason="abort") == 1

    assert wait_until(aborted, timeout=1.0)
    after = scrape(url)
    assert delta(before, after, "kiln:time_to_first_token_seconds_count") == 1
    num_generated = delta(before, after, "kiln:generation_tokens_total")
    # (a step in flight when the abort came may add a token after its latencies were taken)
    assert 4 <= delta(before, after, "kiln:inter_token_latency_seconds_count") \
        <= num_generated - 1
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_params_n", "request_params_max_tokens",
                 "request_max_num_generation_tokens", *(f"{p}_seconds" for p in PHASES)):
        assert delta(before, after, f"kiln:{name}_count") == 0, name

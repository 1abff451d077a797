"""/metrics parses with prometheus_client's parser, and its counters move as requests finish."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kiln.engine.async_engine import AsyncEngine
from kiln.serve.app import create_app

from .conftest import MODEL, ServerThread, assert_idle

Key = tuple[str, tuple[tuple[str, str], ...]]


def scrape(url: str) -> dict[Key, float]:
    """Every sample as {(name, labels other than model_name): value}."""
    response = httpx.get(url + "/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples


def delta(before: dict[Key, float], after: dict[Key, float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metric_names_mirror_vllm(server):
    names = {name for name, _ in scrape(server.url)}
    for name in ("kiln:num_requests_running", "kiln:num_requests_waiting",
                 "kiln:kv_cache_usage_perc", "kiln:prompt_tokens_total",
                 "kiln:generation_tokens_total", "kiln:num_preemptions_total",
                 "kiln:prefix_cache_queries_total", "kiln:prefix_cache_hits_total",
                 "kiln:time_to_first_token_seconds_count",
                 "kiln:inter_token_latency_seconds_count",
                 "kiln:request_time_per_output_token_seconds_count",
                 "kiln:e2e_request_latency_seconds_count", "kiln:request_queue_time_seconds_count"):
        assert name in names, name


def test_counters_move_as_requests_complete(server, engine):
    prompt = "Unicode: café, naïve, 中文, emoji. The quick brown fox jumps over the lazy dog."
    num_prompt = len(engine.tokenizer.encode(prompt))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "ignore_eos": True}
    before = scrape(server.url)
    for _ in range(2):  # the second finds the first's full prompt blocks in the prefix cache
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 200
    assert httpx.post(server.url + "/v1/completions", json={**body, "n": 0}).status_code == 400
    after = scrape(server.url)

    assert delta(before, after, "kiln:request_success_total", finished_reason="length") == 2
    assert delta(before, after, "kiln:prompt_tokens_total") == 2 * num_prompt
    assert delta(before, after, "kiln:generation_tokens_total") == 10
    assert delta(before, after, "kiln:prefix_cache_hits_total") >= 16  # one 16-token block
    assert delta(before, after, "kiln:prefix_cache_queries_total") >= 2 * num_prompt - 2
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time",
                 "request_time_per_output_token"):
        assert delta(before, after, f"kiln:{name}_seconds_count") == 2, name
    assert delta(before, after, "kiln:inter_token_latency_seconds_count") == 2 * 4
    assert delta(before, after, "kiln:request_generation_tokens_sum") == 10
    assert delta(before, after, "kiln:http_requests_total", endpoint="/v1/completions",
                 status="200") == 2
    assert delta(before, after, "kiln:http_requests_total", endpoint="/v1/completions",
                 status="400") == 1
    assert after[("kiln:num_requests_running", ())] == 0
    assert after[("kiln:kv_cache_usage_perc", ())] == 0.0


def test_request_success_counts_choices_and_says_so(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True, "n": 3}
    before = scrape(server.url)
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
    after = scrape(server.url)
    assert delta(before, after, "kiln:request_success_total", finished_reason="length") == 3
    assert delta(before, after, "kiln:e2e_request_latency_seconds_count") == 1
    text = httpx.get(server.url + "/metrics").text
    (family,) = [f for f in text_string_to_metric_families(text)
                 if f.name == "kiln:request_success"]
    assert "one per choice" in family.documentation


async def test_preemptions_are_counted(tiny_llama):
    # 32 blocks hold exactly one 512-token request: eight 200-token requests must preempt
    engine = AsyncEngine.from_kwargs(str(tiny_llama), dtype="float32", device="cpu",
                                     num_kv_blocks=32)
    try:
        with ServerThread(create_app(engine, served_model_name=MODEL)) as srv:
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
                responses = await asyncio.gather(*(
                    http.post("/v1/completions", json={"prompt": f"{i} hi", "max_tokens": 200,
                                                      "ignore_eos": True}) for i in range(8)))
            assert all(r.json()["usage"]["completion_tokens"] == 200 for r in responses)
            metrics = await asyncio.to_thread(scrape, srv.url)
            assert metrics[("kiln:num_preemptions_total", ())] > 0
            assert_idle(engine)
    finally:
        engine.shutdown()


def test_unknown_paths_share_one_label(server):
    for path in ("/nope", "/nope/again", "/v1/nope"):
        assert httpx.get(server.url + path).status_code == 404
    endpoints = {dict(labels)["endpoint"] for name, labels in scrape(server.url)
                 if name == "kiln:http_requests_total"}
    assert "other" in endpoints and not any("nope" in e for e in endpoints)

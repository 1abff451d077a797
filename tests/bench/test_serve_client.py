"""kiln bench serve's client and load generator against an in-process fake OpenAI server."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import numpy as np
import pytest

from kiln.bench.serve import ServeConfig, arrival_offsets, run_serve_async
from kiln.bench.serve_client import completion_payload, stream_completion, wait_for_server
from kiln.bench.workload import WorkloadSpec

TOKENS_PER_CHUNK = 2  # chunks carry two tokens, so counting chunks would undercount tokens


def fake_server(fail_prompt_len: int | None = None, send_usage: bool = True,
                delay_s: float = 0.0, served: str = "fake-model",
                prompts: list | None = None) -> httpx.MockTransport:
    """Streams max_tokens 'tokens' in chunks of two; usage counts the prompt's token ids.
    Lists ``served`` in /v1/models; appends each prompt to ``prompts``."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": served}]})
        body = json.loads(request.content)
        prompt, max_tokens = body["prompt"], body["max_tokens"]
        if prompts is not None:
            prompts.append(prompt)
        if len(prompt) == fail_prompt_len:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        await asyncio.sleep(delay_s)
        events = []
        for start in range(0, max_tokens, TOKENS_PER_CHUNK):
            n = min(TOKENS_PER_CHUNK, max_tokens - start)
            done = start + n == max_tokens
            events.append({"choices": [{"index": 0, "text": " t" * n,
                                        "finish_reason": "length" if done else None}]})
        if send_usage and body.get("stream_options", {}).get("include_usage"):
            events.append({"choices": [], "usage": {
                "prompt_tokens": len(prompt), "completion_tokens": max_tokens,
                "total_tokens": len(prompt) + max_tokens}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


async def test_stream_completion_takes_counts_from_usage():
    async with httpx.AsyncClient(transport=fake_server()) as client:
        res = await stream_completion(client, "http://x/v1/completions",
                                      completion_payload("m", [1, 2, 3], 5, True))
    assert res.ok and res.error is None
    assert (res.prompt_tokens, res.completion_tokens) == (3, 5)
    assert len(res.chunk_times) == 3  # 2 + 2 + 1 tokens; the usage event is not a chunk
    assert res.text == " t" * 5 and res.finish_reason == "length"


async def test_stream_completion_reports_http_errors_and_missing_usage():
    async with httpx.AsyncClient(transport=fake_server(fail_prompt_len=2)) as client:
        res = await stream_completion(client, "http://x/v1/completions",
                                      completion_payload("m", [1, 2], 5, True))
    assert not res.ok and "HTTP 500" in res.error and "boom" in res.error
    async with httpx.AsyncClient(transport=fake_server(send_usage=False)) as client:
        res = await stream_completion(client, "http://x/v1/completions",
                                      completion_payload("m", [1], 4, False))
    assert res.ok and res.completion_tokens is None  # never guessed from the text


async def test_wait_for_server_waits_for_health():
    calls = {"health": 0}

    def loading_then_ready(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            calls["health"] += 1
            return httpx.Response(503 if calls["health"] < 3 else 200)
        return httpx.Response(200, json={"data": [{"id": "m1"}, {"id": "m2"}]})

    ids = await wait_for_server("http://x", 10, httpx.MockTransport(loading_then_ready))
    assert ids == ["m1", "m2"] and calls["health"] == 3

    def no_health(request: httpx.Request) -> httpx.Response:  # a server without /health
        if request.url.path == "/health":
            return httpx.Response(404)
        return httpx.Response(200, json={"data": [{"id": "peer"}]})

    assert await wait_for_server("http://x", 10, httpx.MockTransport(no_health)) == ["peer"]
    with pytest.raises(TimeoutError, match="HTTP 503"):
        await wait_for_server("http://x", 0.2, httpx.MockTransport(
            lambda request: httpx.Response(503)))


def test_arrival_offsets():
    assert np.all(arrival_offsets(5, math.inf, "poisson", 0) == 0)
    assert arrival_offsets(4, 2.0, "constant", 0).tolist() == [0.0, 0.5, 1.0, 1.5]
    poisson = arrival_offsets(4000, 10.0, "poisson", 1)
    gaps = np.diff(poisson)
    assert poisson[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)  # exponential gaps with mean 1/rate
    assert gaps.std() == pytest.approx(0.1, rel=0.1)  # and std equal to the mean
    assert np.array_equal(poisson, arrival_offsets(4000, 10.0, "poisson", 1))  # seeded


def _config(**kw) -> ServeConfig:
    spec = WorkloadSpec("random", num_prompts=6, input_len=6, output_len=5,
                        random_range_ratio=0.5, seed=2)
    return ServeConfig("http://fake", spec, **kw)


async def test_rate_sweep_records_and_metrics():
    cfg = _config(request_rates=[50.0, math.inf], arrival="constant", num_warmups=1,
                  slos={"ttft_ms": 60_000.0})
    r = await run_serve_async(cfg, transport=fake_server(delay_s=0.005))
    assert r["kind"] == "serve" and r["config"]["served_model"] == "fake-model"
    assert len(r["metrics"]) == 2 and len(r["requests"]) == 12
    offsets = arrival_offsets(6, 50.0, "constant", 0)
    first = [q for q in r["requests"] if q["case"] == 0]
    for q, offset in zip(first, offsets, strict=True):
        assert q["start_s"] >= offset - 1e-3  # never sent early
        assert q["output_tokens"] == q["requested_output_tokens"]
        assert q["prompt_tokens"] == q["requested_prompt_tokens"]
        assert q["num_chunks"] == math.ceil(q["output_tokens"] / TOKENS_PER_CHUNK)
    for m in r["metrics"]:
        recs = [q for q in r["requests"] if q["case"] == r["metrics"].index(m)]
        assert m["num_completed"] == 6 and m["num_failed"] == 0
        assert m["total_output_tokens"] == sum(q["output_tokens"] for q in recs)
        assert m["output_tokens_per_s"] == pytest.approx(m["total_output_tokens"]
                                                         / m["duration_s"])
        assert m["goodput_requests_per_s"] == pytest.approx(m["requests_per_s"])
    assert r["metrics"][0]["duration_s"] >= offsets[-1]


async def test_concurrency_cap_and_failures():
    capped = await run_serve_async(_config(max_concurrency=2, num_warmups=0),
                                   transport=fake_server(delay_s=0.02))
    assert capped["metrics"][0]["max_in_flight"] == 2
    free = await run_serve_async(_config(num_warmups=0), transport=fake_server(delay_s=0.02))
    assert free["metrics"][0]["max_in_flight"] == 6
    spec_lens = [q["requested_prompt_tokens"] for q in free["requests"]]
    bad = spec_lens[0]
    r = await run_serve_async(_config(num_warmups=0), transport=fake_server(fail_prompt_len=bad))
    m = r["metrics"][0]
    assert m["num_failed"] == spec_lens.count(bad) and m["num_completed"] == 6 - m["num_failed"]
    assert all(q["error"] for q in r["requests"] if not q["ok"])


async def test_token_ids_fit_a_served_zoo_model_without_model_option():
    """Without --model the random ids still fit the vocabulary of a server whose model name is
    a Kiln zoo model (kiln-tiny: 8192 ids; the workload's range reaches 120000); an unknown
    name leaves the range as the workload gives it."""
    prompts: list = []
    r = await run_serve_async(_config(num_warmups=1),
                              transport=fake_server(served="kiln-tiny", prompts=prompts))
    assert r["config"]["vocab_size"] == 8192 and len(prompts) == 7
    assert max(max(p) for p in prompts) < 8192
    r = await run_serve_async(_config(num_warmups=0), transport=fake_server())
    assert r["config"]["vocab_size"] is None

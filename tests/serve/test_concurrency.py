"""Many concurrent streams, and clients that leave early: every KV block comes back."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from kiln.engine.async_engine import AsyncEngine

from .conftest import LONG_CONTEXT, MODEL, assert_idle, wait_until
from .test_metrics import scrape

NUM_CONCURRENT = 200


async def test_200_concurrent_streams_get_their_token_counts(server, engine):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                timeout=120)

    async def one(i: int) -> tuple[int, int, str | None]:
        max_tokens = 1 + i % 8
        common = dict(model=MODEL, max_tokens=max_tokens, stream=True, temperature=0.9,
                      seed=i, stream_options={"include_usage": True},
                      extra_body={"ignore_eos": True})
        if i % 2:
            stream = await client.completions.create(prompt=f"request {i}: the quick", **common)
        else:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": f"request {i}"}], **common)
        usage, finish = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        return max_tokens, usage.completion_tokens, finish

    start = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(NUM_CONCURRENT)))
    assert [(want, got, finish) for want, got, finish in results] == \
        [(want, want, "length") for want, _, _ in results]
    await client.close()
    assert time.monotonic() - start < 60
    assert_idle(engine)
    metrics = scrape(server.url)
    assert metrics[("kiln:kv_cache_usage_perc", ())] == 0.0
    assert metrics[("kiln:num_requests_running", ())] == 0
    assert metrics[("kiln:num_requests_waiting", ())] == 0


def aborted_count(url: str) -> float:
    return scrape(url).get(("kiln:request_success_total", (("finished_reason", "abort"),)), 0.0)


def wait_for_running(engine: AsyncEngine) -> None:
    deadline = time.monotonic() + 10
    while not engine.engine.scheduler.running:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_closing_a_stream_frees_its_blocks_within_a_second(long_server, endpoint):
    engine = long_server.state.engine
    before = aborted_count(long_server.url)
    client = openai.OpenAI(base_url=long_server.url + "/v1", api_key="unused", max_retries=0)
    common = dict(model=MODEL, max_tokens=LONG_CONTEXT - 100, stream=True,
                  extra_body={"ignore_eos": True})
    if endpoint == "chat":
        stream = client.chat.completions.create(
            messages=[{"role": "user", "content": "hi"}], **common)
    else:
        stream = client.completions.create(prompt="hi", **common)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert engine.engine.kv.num_free_blocks < engine.engine.kv_cache.num_blocks
    stream.close()
    assert_idle(engine, timeout=1.0)
    assert scrape(long_server.url)[("kiln:kv_cache_usage_perc", ())] == 0.0
    # counted just after the abort, once the handler's cleanup has run
    assert wait_until(lambda: aborted_count(long_server.url) == before + 1, timeout=1.0)
    client.close()


def test_dropped_non_streaming_request_is_aborted(long_server):
    engine = long_server.state.engine
    body = {"model": MODEL, "prompt": "hi", "max_tokens": LONG_CONTEXT - 100, "ignore_eos": True}
    with httpx.Client(timeout=httpx.Timeout(30, read=1.0)) as http, \
            pytest.raises(httpx.ReadTimeout):
        http.post(long_server.url + "/v1/completions", json=body)
    # the client gave up after 1 s of silence and closed its connection
    assert_idle(engine, timeout=1.0)


async def test_cancelled_async_stream_is_aborted(long_server):
    engine = long_server.state.engine
    client = openai.AsyncOpenAI(base_url=long_server.url + "/v1", api_key="unused",
                                max_retries=0)

    async def read_forever() -> None:
        stream = await client.completions.create(model=MODEL, prompt="hi", stream=True,
                                                 max_tokens=LONG_CONTEXT - 100,
                                                 extra_body={"ignore_eos": True})
        async for _ in stream:
            pass

    task = asyncio.create_task(read_forever())
    await asyncio.to_thread(wait_for_running, engine)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await client.close()
    await asyncio.to_thread(assert_idle, engine, 1.0)

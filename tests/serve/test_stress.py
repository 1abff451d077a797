"""The server under stress and misuse: bursts against the waiting-queue bound, a failing engine
step, clients that leave while sending, and a shutdown that cuts requests off."""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import kiln
from kiln.engine.async_engine import AsyncEngine
from kiln.serve.app import create_app

from .conftest import (
    LONG_CONTEXT,
    MODEL,
    ServerThread,
    assert_idle,
    assert_openai_error,
    wait_until,
)
from .test_metrics import delta, scrape


class StepHook:
    """Wraps an engine's ``step``: once armed, the next step holds the step thread until
    ``release`` (``hold``), or raises (``fail``)."""

    def __init__(self, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real = engine.engine.step
        self.hold = self.fail = False
        self.held, self.release = threading.Event(), threading.Event()
        monkeypatch.setattr(engine.engine, "step", self.step)

    def step(self) -> Any:
        if self.fail:
            self.fail = False
            raise RuntimeError("injected step failure")
        outputs = self.real()
        if self.hold:
            self.hold = False
            self.held.set()
            self.release.wait(timeout=30)
        return outputs


@pytest.fixture(scope="module")
def stress_server(tiny_llama) -> Iterator[ServerThread]:
    engine = AsyncEngine.from_kwargs(str(tiny_llama), dtype="float32", device="cpu",
                                     num_kv_blocks=256)
    with ServerThread(create_app(engine, served_model_name=MODEL)) as srv:
        yield srv
    engine.shutdown()


async def test_a_burst_cannot_fill_the_waiting_queue_past_its_bound(tiny_llama, monkeypatch):
    # The step thread queues new requests only between steps, and each handler used to check
    # the bound before its requests reached even that hand-over: a burst arriving during one
    # step all saw the queue empty and all got in.
    engine = AsyncEngine.from_kwargs(str(tiny_llama), dtype="float32", device="cpu",
                                     num_kv_blocks=64, max_num_seqs=1, max_waiting_requests=2)
    hook = StepHook(engine, monkeypatch)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
    try:
        with ServerThread(create_app(engine, served_model_name=MODEL)) as srv:
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
                hook.hold = True  # the first step (the request below) holds the step thread
                first = asyncio.create_task(http.post("/v1/completions", json=body))
                assert await asyncio.to_thread(hook.held.wait, 10)
                burst = [asyncio.create_task(http.post("/v1/completions", json=body))
                         for _ in range(6)]

                def decided() -> bool:  # answered 429, or handed to the engine
                    return sum(t.done() for t in burst) + engine.num_in_flight - 1 == 6

                assert await asyncio.to_thread(wait_until, decided, 10)
                hook.release.set()
                responses = await asyncio.gather(first, *burst)
        statuses = collections.Counter(r.status_code for r in responses[1:])
        assert responses[0].status_code == 200
        assert statuses == {200: 2, 429: 4}, statuses  # bound 2: the rest are turned away
        for response in responses[1:]:
            if response.status_code == 429:
                assert assert_openai_error(response, 429)["code"] == "rate_limit_exceeded"
        assert_idle(engine)
    finally:
        hook.release.set()
        engine.shutdown()


def test_a_failed_step_counts_its_samples_as_aborted(stress_server, monkeypatch):
    # Samples ended by an engine failure used to vanish from request_success (the failed
    # prompt was dropped before the aborted ones were counted).
    engine = stress_server.state.engine
    hook = StepHook(engine, monkeypatch)
    url = stress_server.url
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 50, "ignore_eos": True}
    before = scrape(url)

    hook.fail = True  # before the first token: the answer is a 503
    error = assert_openai_error(httpx.post(url + "/v1/completions", json={**body, "n": 3},
                                           timeout=30), 503)
    assert "injected step failure" in error["message"]

    def fail_after_the_first_step() -> None:
        assert hook.held.wait(timeout=10)
        hook.fail = True
        hook.release.set()

    hook.hold = True  # after the first token: the stream ends with an error event
    failer = threading.Thread(target=fail_after_the_first_step, daemon=True)
    failer.start()
    with httpx.stream("POST", url + "/v1/completions", timeout=30,
                      json={**body, "n": 2, "stream": True}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    failer.join(timeout=10)
    assert len(events) >= 3 and "choices" in json.loads(events[0]), events
    assert events[-1] == "[DONE]" and "injected step failure" in events[-2], events

    after = scrape(url)
    assert delta(before, after, "kiln:request_success_total", finished_reason="abort") == 5
    assert_idle(engine)
    ok = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_the_step_thread_survives_a_reader_whose_event_loop_closed(tiny_llama, monkeypatch):
    # An output posted to a closed loop raised in the step thread and killed it: the request
    # kept its blocks and every later request hung.
    engine = AsyncEngine.from_kwargs(str(tiny_llama), dtype="float32", device="cpu",
                                     num_kv_blocks=64)
    hook = StepHook(engine, monkeypatch)
    params = kiln.SamplingParams(max_tokens=200, ignore_eos=True)

    async def leave_with_a_step_in_flight() -> None:
        outputs = engine.generate("hi", params)
        await outputs.__anext__()
        hook.hold = True
        assert await asyncio.to_thread(hook.held.wait, 10)
        # return without closing it: the loop closes while the step thread still holds
        # this step's output for it

    async def short() -> str | None:
        outputs = [o async for o in engine.generate("hi", kiln.SamplingParams(max_tokens=2))]
        return outputs[-1].outputs[0].finish_reason

    try:
        asyncio.run(leave_with_a_step_in_flight())
        hook.release.set()
        assert asyncio.run(asyncio.wait_for(short(), timeout=10)) == "length"
        assert_idle(engine)
    finally:
        hook.release.set()
        engine.shutdown()


def test_a_client_that_leaves_while_sending_its_body_is_a_499_not_a_400(stress_server):
    before = scrape(stress_server.url)
    with socket.create_connection(("127.0.0.1", stress_server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kiln\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                     b'{"prompt": ')

    def counted() -> bool:
        after = scrape(stress_server.url)
        return any(delta(before, after, "kiln:http_requests_total",
                         endpoint="/v1/completions", status=str(status)) for status in (400, 499))

    assert wait_until(counted, timeout=5)
    after = scrape(stress_server.url)
    assert delta(before, after, "kiln:http_requests_total", endpoint="/v1/completions",
                 status="499") == 1
    assert delta(before, after, "kiln:http_requests_total", endpoint="/v1/completions",
                 status="400") == 0


def test_requests_cut_off_by_shutdown_get_a_503_in_openai_shape(long_context_llama):
    # uvicorn cancels what outlives the grace period: a response not yet started used to be
    # uvicorn's bare "500 Internal Server Error" (text), a stream a truncated chunked body.
    engine = AsyncEngine.from_kwargs(str(long_context_llama), dtype="float32", device="cpu",
                                     num_kv_blocks=2 * LONG_CONTEXT // 16)
    srv = ServerThread(create_app(engine, served_model_name=MODEL))
    srv.server.config.timeout_graceful_shutdown = 0.2
    body = {"model": MODEL, "prompt": "hi", "max_tokens": LONG_CONTEXT - 100,
            "ignore_eos": True}
    results: dict[str, Any] = {}
    first_event = threading.Event()

    def plain() -> None:
        results["plain"] = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)

    def stream() -> None:
        events = []
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                              json={**body, "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_event.set()
        except httpx.HTTPError as exc:
            results["stream_error"] = exc
        results["stream"] = events

    try:
        with srv:
            threads = [threading.Thread(target=f, daemon=True) for f in (plain, stream)]
            for thread in threads:
                thread.start()
            assert first_event.wait(timeout=30)
            assert wait_until(lambda: len(engine.engine.scheduler.running) == 2, timeout=30)
            srv.state.draining = True  # what kiln serve's signal handler does, then exits
        for thread in threads:
            thread.join(timeout=15)
        error = assert_openai_error(results["plain"], 503)
        assert "shut down" in error["message"]
        assert "stream_error" not in results, results["stream_error"]
        last = json.loads(results["stream"][-1])
        assert "shut down" in last["error"]["message"], last
        assert_idle(engine, timeout=2)
    finally:
        engine.shutdown()

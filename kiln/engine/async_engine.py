"""AsyncEngine: the engine's step loop on a background thread, async streams per request.

The event loop never runs the model: ``generate`` queues a request and awaits its outputs,
which the step thread posts back with ``call_soon_threadsafe``. Leaving the stream early
(client gone, task cancelled) aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kiln.config import EngineConfig
from kiln.engine.inputs import PromptLike
from kiln.engine.llm_engine import LLMEngine
from kiln.outputs import RequestOutput
from kiln.sampling.params import SamplingParams

log = logging.getLogger("kiln.engine")


class EngineDeadError(RuntimeError):
    """The step loop failed; requests in flight end with finish_reason 'error'."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # the engine is not thread-safe; one caller at a time
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> AsyncEngine:
        return cls(LLMEngine(EngineConfig.from_kwargs(model, **kwargs)))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    async def generate(self, prompt: PromptLike, params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs as tokens arrive; the last one has ``finished=True``.

        Bad input raises ValueError before anything is queued.
        """
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self.engine.add_request(request_id, prompt, params)
            self._streams[request_id] = stream
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (safe from any thread; unknown ids ignored)."""
        with self._lock:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    def _loop(self) -> None:
        while not self._stopping:
            with self._lock:
                busy = self.engine.has_unfinished_requests()
            if not busy:
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                with self._lock:
                    outputs = self.engine.step()
                    deliveries = [(self._streams.get(o.request_id), o) for o in outputs]
                    for o in outputs:
                        if o.finished:
                            self._streams.pop(o.request_id, None)
            except Exception as exc:  # noqa: BLE001 - a failed step must not hang every client
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(exc)
                continue
            for stream, output in deliveries:
                if stream is not None:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            for request_id in list(self.engine.requests):
                self.engine.abort_request(request_id)
        error = EngineDeadError(f"engine step failed: {type(exc).__name__}: {exc}")
        for stream in streams.values():
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)

    async def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for in-flight requests; True if all finished."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self._streams

    def shutdown(self) -> None:
        """Abort whatever is left and stop the step thread."""
        with self._lock:
            for request_id in list(self._streams):
                self.engine.abort_request(request_id)
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.loop.call_soon_threadsafe(
                stream.queue.put_nowait, EngineDeadError("the engine shut down"))
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=10)

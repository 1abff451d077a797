"""AsyncEngine: the engine's step loop on a background thread, async streams per request.

The event loop never waits on the model: ``generate`` validates the request on the caller's
thread (tokenization, limits), hands it to the step thread through a command queue, and awaits
its outputs, which the step thread posts back with ``call_soon_threadsafe``. Aborts travel the
same queue. Leaving a stream early (client gone, task cancelled) aborts the request and frees
its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from kiln.config import EngineConfig
from kiln.engine.gc_heap import frozen_heap
from kiln.engine.inputs import PromptLike
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.request import Request
from kiln.outputs import RequestOutput
from kiln.sampling.params import SamplingParams, StructuredOutputsParams

log = logging.getLogger("kiln.engine")
IDLE_WAIT_S = 0.5
BLOCKED_WAIT_S = 0.005  # requests exist but none fits right now: do not spin


class EngineDeadError(RuntimeError):
    """The step loop failed or shut down; requests in flight end with this error."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand ``item`` to the reader's event loop; False if that loop is closed."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # "Event loop is closed": the reader is gone for good
            return False
        return True


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._num_unqueued = 0  # handed to the step thread, not yet in the scheduler's queue
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
        """Requests not yet scheduled: the scheduler's queue and those still on their way to it.

        The step thread queues new requests only between steps, so a burst that arrives during
        a step would otherwise all see the queue it left behind (and pass any bound on it).
        """
        with self._streams_lock:
            return len(self.engine.scheduler.waiting) + self._num_unqueued

    async def generate(self, prompt: PromptLike, params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs as tokens arrive; the last one has ``finished=True``.

        Bad input raises ValueError before anything is queued.
        """
        outputs = self.submit(prompt, params, request_id)
        try:
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()  # leaving early aborts the request

    async def compile_grammar(self, structured: StructuredOutputsParams) -> None:
        """Compile ``structured``'s grammar into the engine's cache on a worker thread, where
        ``submit`` then finds it: compiling a large JSON schema on the event loop would hold up
        every other request. ValueError, as ``submit`` raises it, when it does not compile."""
        await asyncio.to_thread(self.engine.compile_grammar, structured)

    def submit(self, prompt: PromptLike, params: SamplingParams,
               request_id: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """``generate``, but the request is handed over (and counts in ``num_waiting``) before
        this returns. The caller must iterate or close the result, or ``abort`` the request:
        an iterator never started cannot abort on its own.
        """
        request_id = request_id or f"req-{next(self._ids)}"
        request = self.engine.make_request(request_id, prompt, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:  # shutdown sets _stopping under it: no stream outlives it
            if self._stopping:
                raise EngineDeadError("the engine is shutting down")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._num_unqueued += 1
        self._send(("add", request))
        return self._outputs(request_id, stream)

    async def _outputs(self, request_id: str, stream: _Stream
                       ) -> AsyncGenerator[RequestOutput, None]:
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
        """Stop a request and free its blocks (any thread; unknown ids are ignored).

        Its stream, if someone still reads it, receives the final aborted output.
        """
        self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _take_stream(self, request_id: str) -> _Stream | None:
        with self._streams_lock:
            return self._streams.pop(request_id, None)

    def _run_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(arg)
            else:
                output = self.engine.abort_request(arg)
                stream = self._take_stream(arg)
                if stream is not None and output is not None:
                    stream.put(output)

    def _add(self, request: Request) -> None:
        error = None
        with self._streams_lock:  # num_waiting counts it in exactly one place at any time
            self._num_unqueued -= 1
            if request.request_id not in self._streams:  # aborted before it was queued
                return
            try:
                self.engine.enqueue(request)
            except ValueError as exc:
                error = exc
        if error is not None:
            stream = self._take_stream(request.request_id)
            if stream is not None:
                stream.put(error)

    def _loop(self) -> None:
        with frozen_heap():  # the server's start-up heap, for the thread's lifetime
            self._steps()

    def _steps(self) -> None:
        while not self._stopping:
            self._run_commands()
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(timeout=IDLE_WAIT_S)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - a failed step must not hang every client
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(EngineDeadError(f"engine step failed: {type(exc).__name__}: "
                                               f"{exc}"))
                continue
            for output in outputs:
                stream = (self._take_stream(output.request_id) if output.finished
                          else self._streams.get(output.request_id))
                if stream is not None and not stream.put(output) and not output.finished:
                    # its loop closed before it could abort: nobody will ever read it
                    self._take_stream(output.request_id)
                    self.engine.abort_request(output.request_id)
            if self.engine.num_scheduled_last_step == 0:
                self._wakeup.wait(timeout=BLOCKED_WAIT_S)
                self._wakeup.clear()

    def _fail_all(self, error: EngineDeadError) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        with self._streams_lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)

    def shutdown(self) -> None:
        """Stop the step thread, then abort whatever is left."""
        with self._streams_lock:
            self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=30)
        self._run_commands()
        self._fail_all(EngineDeadError("the engine shut down"))

"""Server-sent events: ``data: {json}\\n\\n`` chunks ending in ``data: [DONE]``.

``SSEResponse`` closes its chunk generator however the response ends, so a client that drops
the connection aborts its engine requests at once instead of whenever the generator is
garbage-collected.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kiln.engine.async_engine import EngineDeadError
from kiln.outputs import RequestOutput
from kiln.serve.errors import error_body

log = logging.getLogger("kiln.serve")

DONE = "data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[str]) -> None:
        super().__init__(chunks, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._chunks.aclose()  # type: ignore[attr-defined]


async def event_stream(first: tuple[int, RequestOutput],
                       rest: AsyncIterator[tuple[int, RequestOutput]],
                       to_chunks: Callable[[int, RequestOutput], Iterable[dict[str, Any]]],
                       preamble: Iterable[dict[str, Any]] = (),
                       final: Callable[[], Iterable[dict[str, Any]]] = tuple,
                       ) -> AsyncIterator[str]:
    """Chunks for every output (``first`` was awaited before the response started), then
    ``final()`` (the usage chunk), then ``[DONE]``. An engine failure mid-stream becomes an
    error event in OpenAI's shape, which the official client raises as an APIError."""
    try:
        for chunk in preamble:
            yield sse(chunk)
        for chunk in to_chunks(*first):
            yield sse(chunk)
        async for index, output in rest:
            for chunk in to_chunks(index, output):
                yield sse(chunk)
        for chunk in final():
            yield sse(chunk)
    except EngineDeadError as exc:
        yield sse(error_body(503, str(exc)))
    except Exception as exc:  # noqa: BLE001 - headers are sent; the error must go in the stream
        log.exception("stream failed")
        yield sse(error_body(500, f"internal error: {type(exc).__name__}"))
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
    yield DONE

"""A minimal async client for any OpenAI-compatible server's streaming ``/v1/completions``.

Timing follows vLLM's benchmark client: a chunk is any SSE event that carries ``choices``
(even with empty text); TTFT is the first such chunk. Token counts come only from the
server's ``usage`` (requested with ``stream_options.include_usage``), never from the text.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class StreamResult:
    ok: bool
    start: float  # time.monotonic when the request was sent
    chunk_times: list[float] = field(default_factory=list)
    end: float | None = None
    prompt_tokens: int | None = None  # from usage; None if the server sent none
    completion_tokens: int | None = None
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


def completion_payload(model: str, prompt: list[int] | str, max_tokens: int,
                       ignore_eos: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                               "temperature": 0.0, "stream": True,
                               "stream_options": {"include_usage": True}}
    if ignore_eos:
        payload["ignore_eos"] = True  # vLLM's extension; every request runs to max_tokens
    return payload


async def stream_completion(client: httpx.AsyncClient, url: str,
                            payload: dict[str, Any]) -> StreamResult:
    result = StreamResult(ok=False, start=time.monotonic())
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:500]}"
                result.end = time.monotonic()
                return result
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.monotonic()
                event = json.loads(data)
                if "error" in event:
                    result.error = json.dumps(event["error"])[:500]
                    break
                if choices := event.get("choices"):
                    result.chunk_times.append(now)
                    result.text += choices[0].get("text") or ""
                    result.finish_reason = choices[0].get("finish_reason") or \
                        result.finish_reason
                if usage := event.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.completion_tokens = usage.get("completion_tokens")
        result.end = time.monotonic()
        result.ok = result.error is None and bool(result.chunk_times)
        if result.ok is False and result.error is None:
            result.error = "the stream ended without any output"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.end = time.monotonic()
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def wait_for_server(base_url: str, timeout_s: float,
                          transport: httpx.AsyncBaseTransport | None = None) -> list[str]:
    """Wait until the server is ready; returns the model ids ``/v1/models`` lists.

    Ready means ``/health`` answers 200 (Kiln and vLLM answer 503 while the model loads,
    although ``/v1/models`` already works); a server without ``/health`` (404) is ready once
    ``/v1/models`` answers.
    """
    base = base_url.rstrip("/")
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with httpx.AsyncClient(timeout=5.0, transport=transport) as client:
        while True:
            try:
                health = await client.get(base + "/health")
                if health.status_code in (200, 404):
                    resp = await client.get(base + "/v1/models")
                    if resp.status_code == 200:
                        return [m["id"] for m in resp.json().get("data", [])]
                    last = f"/v1/models: HTTP {resp.status_code}"
                else:
                    last = f"/health: HTTP {health.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}"
            if time.monotonic() > deadline:
                raise TimeoutError(f"{base_url} was not ready within {timeout_s:g} s ({last})")
            await asyncio.sleep(0.5)

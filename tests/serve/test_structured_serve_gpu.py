"""kiln serve on CUDA: structured requests arriving while plain streams decode in graph-replayed
steps. The first use of each grammar compiles on a worker thread and launches xgrammar's mask
kernel from the engine thread; neither may stall or corrupt the plain streams beside it."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from .conftest import MODEL, assert_idle, kiln_tiny_server, openai_client
from .test_structured_outputs_server import JSON_SCHEMA, MESSAGES, PROMPT, REGEX, follows_schema
from .test_tool_calls import NAMED, TEMPLATE, TOOLS, UNITS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU")]

PLAIN_STREAMS = 8
PLAIN_TOKENS = 256


def test_structured_requests_beside_plain_streams_on_cuda():
    with kiln_tiny_server(device="cuda", chat_template=TEMPLATE) as (srv, engine):
        client = openai_client(srv)
        streaming = threading.Barrier(PLAIN_STREAMS + 1)

        def plain(i: int) -> tuple[int, str | None]:
            stream = client.completions.create(
                model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=PLAIN_TOKENS, temperature=0.0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            tokens, reason, waited = 0, None, False
            for chunk in stream:
                if not waited:  # every stream is decoding before the structured ones come
                    streaming.wait(timeout=60)
                    waited = True
                if chunk.choices and chunk.choices[0].finish_reason:
                    reason = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return tokens, reason

        with ThreadPoolExecutor(PLAIN_STREAMS) as pool:
            plains = [pool.submit(plain, i) for i in range(PLAIN_STREAMS)]
            streaming.wait(timeout=60)
            person = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0.0,
                response_format=JSON_SCHEMA)
            coded = client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0.7, seed=5, n=2,
                extra_body={"guided_regex": REGEX})
            called = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0.0, tools=TOOLS,
                tool_choice=NAMED)
            results = [f.result(timeout=120) for f in plains]

        follows_schema(person.choices[0].message.content)
        assert all(re.fullmatch(REGEX, c.text) for c in coded.choices), coded.choices
        call = called.choices[0].message.tool_calls[0]
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and args["unit"] in UNITS, args
        assert results == [(PLAIN_TOKENS, "length")] * PLAIN_STREAMS
        assert_idle(engine, timeout=5)

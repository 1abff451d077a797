"""Property-based fuzzing of both POST endpoints: never a 5xx, every error in OpenAI's shape.

Bodies mix plausible values (near every boundary), wrong types, NaN and infinities (Python's
JSON accepts them), huge integers, lone surrogates and arbitrary JSON, against a real engine
with a short context so that every accepted request also runs to the end.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kiln.engine.async_engine import AsyncEngine
from kiln.serve.app import create_app

from .conftest import MODEL, ServerThread, assert_idle, assert_openai_error

NUM_EXAMPLES = int(os.environ.get("KILN_FUZZ_EXAMPLES", "120"))
VOCAB = 320

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
           | st.text(max_size=12))
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
clean_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=30)
any_text = st.text(max_size=30)  # may hold lone surrogates, which JSON carries as escapes
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30)


def edge(valid: st.SearchStrategy, *near: object) -> st.SearchStrategy:
    """Usually in range; one time in five a value on or just past the boundary."""
    return st.one_of(valid, valid, valid, valid, st.sampled_from(near))


INF, NAN = float("inf"), float("nan")
# Mostly in range, so that many requests really run, with the boundaries probed.
VALID_COMMON = {
    "model": st.just(MODEL),
    "n": edge(st.integers(1, 3), 0, 8, 9),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": edge(clean_text | st.lists(clean_text, max_size=3), "", [""], "\ud800"),
    "temperature": edge(st.floats(0, 2), -1e-9, 1e-300, 1e300, INF, NAN),
    "top_p": edge(st.floats(1e-6, 1), 0.0, 1e-300, 1.0000001, NAN),
    "top_k": edge(st.integers(-1, VOCAB + 5), -2, 2**63 - 1, 2**63),
    "min_p": edge(st.floats(0, 1), -1e-9, 1.0000001, NAN),
    "seed": edge(st.integers(-(2**63), 2**63 - 1), 2**63, -(2**63) - 1),
    "presence_penalty": edge(st.floats(-2, 2), 2.0000001, -INF, NAN),
    "frequency_penalty": edge(st.floats(-2, 2), -2.0000001, INF, NAN),
    "repetition_penalty": edge(st.floats(1e-3, 3), 0.0, -1.0, 1e-300, 1e300, INF),
    "min_tokens": edge(st.integers(0, 4), -1, 13, 2**40),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(edge(st.integers(0, VOCAB - 1), -1, VOCAB, 2**31, 2**63 - 1),
                               max_size=3),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "user": any_text,
}
VALID_COMPLETION = {
    **VALID_COMMON,
    "max_tokens": edge(st.integers(4, 12), None, 0, 47, 48, 2**63 - 1),
    "logprobs": edge(st.integers(0, 20), -1, 21),
}
PROMPTS = (clean_text | st.lists(clean_text, min_size=1, max_size=3) | token_ids
           | st.lists(token_ids, min_size=1, max_size=3))
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                 "content": clean_text})
VALID_CHAT = {
    **VALID_COMMON,
    "max_completion_tokens": edge(st.integers(4, 12), None, 0, 47, 48),
    "logprobs": st.booleans(),
    "top_logprobs": edge(st.integers(0, 20), -1, 21),
}
# Out of range, wrong or unsupported, for one field at a time.
WILD = {
    "n": st.integers(-1, 0) | st.integers(9, 2**64), "temperature": st.floats(),
    "top_p": st.floats(), "min_p": st.floats(), "repetition_penalty": st.floats(),
    "max_tokens": st.integers(-(2**64), 60) | st.none(), "seed": st.integers(-(2**70), 2**70),
    "stop_token_ids": st.lists(st.integers(-(2**64), 2**64), max_size=3),
    "stop": any_text | st.lists(any_text, max_size=3), "logprobs": st.integers(-3, 30),
    "top_logprobs": st.integers(-3, 30), "logit_bias": st.dictionaries(any_text, st.floats()),
    "echo": st.booleans(), "best_of": st.integers(0, 4), "min_tokens": st.integers(-3, 99),
    "allowed_token_ids": st.lists(st.integers(-5, 2 * VOCAB), max_size=3),
    "bad_words": st.lists(any_text, max_size=3), "prompt_logprobs": st.integers(-3, 30),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function")}), max_size=1),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    "prompt": any_text | st.lists(st.integers(-5, 2 * VOCAB)) | st.lists(any_text),
    "messages": st.lists(st.fixed_dictionaries(
        {"role": any_text}, optional={"content": any_text | st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"]), "text": any_text}), max_size=2),
            "name": any_text}), max_size=3),
    "model": any_text | st.none(),
}


def bodies(valid: dict, required: dict) -> st.SearchStrategy:
    """Valid bodies, valid bodies with one field gone wild, and arbitrary JSON."""
    ok = st.fixed_dictionaries(required, optional=valid)
    names = sorted(set(valid) | set(required))
    wild = st.one_of(st.tuples(st.sampled_from(names), anything),
                     *(st.tuples(st.just(name), values) for name, values in WILD.items()))
    mutated = st.builds(lambda body, item: {**body, item[0]: item[1]}, ok, wild)
    return st.one_of(ok, ok, mutated, mutated, anything)


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama):
    # a 48-token context keeps every accepted request short, whatever max_tokens says
    engine = AsyncEngine.from_kwargs(str(tiny_llama), dtype="float32", device="cpu",
                                     max_model_len=48, num_kv_blocks=24, max_num_seqs=8)
    with ServerThread(create_app(engine, served_model_name=MODEL)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        yield http, engine
    engine.shutdown()


def check(http: httpx.Client, path: str, body: object) -> None:
    content = json.dumps(body)  # ensure_ascii: surrogates and NaN go over the wire as Python's
    response = http.post(path, content=content, headers={"content-type": "application/json"})
    raw = response.text
    assert response.status_code < 500, (body, response.status_code, raw)
    event(f"status {response.status_code}")  # --hypothesis-show-statistics shows the mix
    if response.status_code != 200:
        assert_openai_error(response, response.status_code)
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]", raw[-300:]
        for data in events[:-1]:
            assert "error" not in json.loads(data), data
    else:
        result = json.loads(raw)
        assert result["choices"] and result["usage"]["total_tokens"] > 0, result


@settings(max_examples=NUM_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=bodies(VALID_COMPLETION, {"prompt": PROMPTS}))
def test_fuzz_completions(fuzz_server, body):
    check(fuzz_server[0], "/v1/completions", body)


@settings(max_examples=NUM_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=bodies(VALID_CHAT, {"messages": st.lists(message, min_size=1, max_size=3)}))
def test_fuzz_chat_completions(fuzz_server, body):
    check(fuzz_server[0], "/v1/chat/completions", body)


def test_fuzzed_engine_is_left_idle(fuzz_server):
    http, engine = fuzz_server
    assert_idle(engine)
    assert http.get("/health").status_code == 200

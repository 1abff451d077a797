"""Status codes and OpenAI's error shape: 400, 401, 404, 405, 429, 503."""

from __future__ import annotations

import contextlib
import json
import threading

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


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def completion(http, **body):
    return http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                              **body})


@pytest.mark.parametrize("field, value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("n", 0), ("max_tokens", 0),
    ("logprobs", 21), ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("min_p", 2.0),
    ("top_k", -2), ("min_tokens", 5), ("stop", [""]), ("stop_token_ids", [10**6]),
    ("max_tokens", "many"), ("n", 10**30), ("seed", 1.5), ("max_tokens", True),
    ("n", False), ("allowed_token_ids", []), ("allowed_token_ids", [-1]),
    ("allowed_token_ids", [5, 10**6]), ("bad_words", [""]), ("bad_words", [" "]),
    ("bad_words", "fox"), ("prompt_logprobs", 21), ("prompt_logprobs", -1)])
def test_invalid_parameter_is_400_naming_it(http, engine, field, value):
    error = assert_openai_error(completion(http, **{field: value}), 400)
    assert error["type"] == "invalid_request_error"
    assert field in error["message"] and error["param"] == field, error
    assert_idle(engine)


def test_out_of_vocab_stop_token_id_is_a_400_not_a_failed_step(http, engine):
    # With min_tokens the sampler masks stop ids in the logits: an id past the vocabulary
    # would raise in the engine step and fail every request in flight.
    vocab_size = engine.engine.loaded.arch.vocab_size
    body = {"min_tokens": 2, "max_tokens": 4, "stop_token_ids": [5, vocab_size]}
    error = assert_openai_error(completion(http, **body), 400)
    assert error["param"] == "stop_token_ids"
    assert http.get("/health").status_code == 200


def test_prompt_over_context_length_says_both_numbers(http, engine):
    max_len = engine.max_model_len
    error = assert_openai_error(completion(http, prompt=[5] * (max_len + 10)), 400)
    assert str(max_len) in error["message"] and str(max_len + 10) in error["message"]
    assert error["code"] == "context_length_exceeded"
    error = assert_openai_error(completion(http, prompt=[5] * 10, max_tokens=max_len), 400)
    assert f"{max_len} tokens" in error["message"] and str(max_len + 10) in error["message"]


@pytest.mark.parametrize("body", [
    {"model": MODEL}, {"prompt": []}, {"prompt": [[]]}, {"prompt": [10**6]}, {"prompt": ""},
    {"prompt": 5}, {"suffix": "!"}, {"logit_bias": {"x": 1.0}},
    {"logit_bias": {"5": 101}}, {"logit_bias": {str(10**6): 1.0}}, {"prompt": "a\ud800"}])
def test_bad_prompts_and_unsupported_options_are_400(http, body):
    request = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **body}
    if "prompt" not in body:
        del request["prompt"]
    # json.dumps escapes the lone surrogate as JSON allows (httpx's encoder would refuse it)
    response = http.post("/v1/completions", content=json.dumps(request),
                         headers={"content-type": "application/json"})
    assert_openai_error(response, 400)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("body, content_type, says", [
    (b'{"prompt": "hi",\n "max_tokens": ', "application/json",
     "request body is not valid JSON: Expecting value (line 2 column 16)"),
    (b"", "application/json", "request body is empty: send a JSON object"),
    (b"", None, "request body is empty: send a JSON object"),
    (b'{"prompt": "hi"}', "text/plain",
     "request body must be a JSON object, sent with 'Content-Type: application/json'"),
    (b'["hi"]', "application/json", "request body must be a JSON object, not an array"),
    (b"null", "application/json", "request body must be a JSON object, not null")])
def test_malformed_bodies_say_what_to_send(http, path, body, content_type, says):
    headers = {"content-type": content_type} if content_type else {}
    error = assert_openai_error(http.post(path, content=body, headers=headers), 400)
    assert error["message"] == says and error["param"] is None, error


def test_wrong_methods_and_paths(http):
    assert_openai_error(http.get("/v1/completions"), 405)
    assert_openai_error(http.get("/v1/nothing-here"), 404)


def test_unknown_model_is_404(http):
    error = assert_openai_error(completion(http, model="gpt-4"), 404)
    assert error["code"] == "model_not_found" and "gpt-4" in error["message"]
    chat = http.post("/v1/chat/completions",
                     json={"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]})
    assert_openai_error(chat, 404)


def test_chat_without_template_is_a_clear_400(http, engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", None)
    response = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    error = assert_openai_error(response, 400)
    assert "chat template" in error["message"]


def test_chat_rejects_empty_messages_and_image_parts(http):
    for messages in ([], [{"role": "user", "content": [{"type": "image_url"}]}]):
        response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert_openai_error(response, 400)


def test_chat_needs_content_but_in_an_assistant_turn(http):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user"}]
    error = assert_openai_error(http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": 2}), 400)
    assert error["param"] == "messages.1.content" and "user message" in error["message"], error
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant"},
                {"role": "user", "content": "again"}]
    assert http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": 2}).status_code == 200


def test_api_keys_401_without_or_with_a_wrong_key(engine):
    app = create_app(engine, served_model_name=MODEL, api_keys=["key-one", "key-two"])
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        error = assert_openai_error(http.post("/v1/completions", json=body), 401)
        assert error["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer key-three"}
        assert_openai_error(http.post("/v1/completions", json=body, headers=wrong), 401)
        # malformed bodies still get 401 first: nothing is parsed for an unknown caller
        assert_openai_error(http.post("/v1/completions", content=b"{", headers=wrong), 401)
        assert_openai_error(http.post("/tokenize", json={"prompt": "x"}), 401)
        for key in ("key-one", "key-two"):
            ok = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200, ok.text
        assert http.get("/health").status_code == 200  # probes need no key
        assert http.get("/metrics").status_code == 200


def post_and_give_up(url: str, body: dict) -> None:
    """A non-streaming request whose client times out (so the server must abort it)."""
    with contextlib.suppress(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=1.5)


def test_429_when_the_waiting_queue_is_full(long_context_llama):
    engine = AsyncEngine.from_kwargs(str(long_context_llama), dtype="float32", device="cpu",
                                     num_kv_blocks=LONG_CONTEXT // 16, max_num_seqs=1,
                                     max_waiting_requests=1)
    long_body = {"model": MODEL, "prompt": "hi", "max_tokens": LONG_CONTEXT - 10,
                 "ignore_eos": True, "stream": True}
    try:
        with ServerThread(create_app(engine, served_model_name=MODEL)) as srv, \
                httpx.Client(base_url=srv.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=long_body) as running:
                # Keep the iterator: dropping it closes the connection, aborting the request.
                lines = running.iter_lines()
                next(lines)  # the first token: this request holds the only seat
                waiting = threading.Thread(target=post_and_give_up, args=(srv.url, long_body))
                waiting.start()
                assert wait_until(lambda: engine.num_waiting() == 1, timeout=10)
                error = assert_openai_error(http.post("/v1/completions", json=long_body), 429)
                assert error["code"] == "rate_limit_exceeded"
            waiting.join(timeout=10)
            assert_idle(engine, timeout=2)  # both left early: aborted, blocks back
    finally:
        engine.shutdown()


def test_503_until_the_engine_is_loaded_then_200(tiny_llama):
    release = threading.Event()

    def slow_factory() -> AsyncEngine:
        release.wait(timeout=30)
        return AsyncEngine.from_kwargs(str(tiny_llama), dtype="float32", device="cpu",
                                       num_kv_blocks=32)

    app = create_app(engine_factory=slow_factory, served_model_name=MODEL)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        assert_openai_error(http.get("/health"), 503)
        assert_openai_error(http.post("/v1/completions", json={"prompt": "hi"}), 503)
        assert http.get("/metrics").status_code == 200
        release.set()
        assert wait_until(lambda: http.get("/health").status_code == 200, timeout=30)
        ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert app.state.kiln.engine._stopping  # the app built it, so the app shut it down


def test_failed_load_keeps_503_with_the_reason():
    errors = []

    def broken() -> AsyncEngine:
        raise FileNotFoundError("no checkpoint at /nowhere")

    app = create_app(engine_factory=broken, on_startup_error=errors.append)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        assert wait_until(lambda: errors, timeout=5)
        error = assert_openai_error(http.get("/health"), 503)
        assert "/nowhere" in error["message"]


def test_tokenize_detokenize_version(http, engine):
    tokens = http.post("/tokenize", json={"model": MODEL, "prompt": "The quick brown fox"}).json()
    assert tokens["tokens"] == engine.tokenizer.encode("The quick brown fox")
    assert tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == engine.max_model_len
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "The quick brown fox"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 0
    assert_openai_error(http.post("/detokenize", json={"tokens": [-1]}), 400)
    assert_openai_error(http.post("/tokenize", json={}), 400)
    assert http.get("/version").json() == {"version": kiln.__version__}

"""OpenAI/vLLM conventions that clients rely on beyond the happy path."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import MODEL, assert_idle, assert_openai_error

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "n": None, "stream": None, "echo": None,
                         "best_of": None, "ignore_eos": None, "min_tokens": None,
                         "skip_special_tokens": None, "stream_options": {"include_usage": None}}),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": None, "stream": None,
                              "logprobs": None, "top_logprobs": None,
                              "add_generation_prompt": None,
                              "include_stop_str_in_output": None})])
def test_null_means_the_default_as_openai_documents(http, engine, path, body):
    # OpenAI's spec marks these nullable; clients send null for "not set"
    response = http.post(path, json={"model": MODEL, "max_tokens": 2, **body})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["logprobs"] is None
    assert_idle(engine)


def test_failed_engine_step_is_a_503_saying_so_not_an_opaque_500(http, engine, monkeypatch):
    def broken_step() -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.engine, "step", broken_step)
    error = assert_openai_error(completion := http.post("/v1/completions", json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2}), 503)
    assert "device lost" in error["message"], completion.text
    streamed = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                  "max_tokens": 2, "stream": True})
    error = assert_openai_error(streamed, 503)
    assert "device lost" in error["message"]
    monkeypatch.undo()
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                              "max_tokens": 2}).status_code == 200


def test_streamed_text_offsets_match_the_non_streaming_ones_across_a_stop_string(http):
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 12, "temperature": 0.0,
            "logprobs": 0, "ignore_eos": True}
    free = http.post("/v1/completions", json=body).json()["choices"][0]
    text, tokens, offsets = free["text"], free["logprobs"]["tokens"], \
        free["logprobs"]["text_offset"]
    # a stop string from the last character of token 2 to the first of token 4: tokens 3 and
    # 4 arrive while the text that may start it is held back
    assert all(tokens[2:5]), tokens
    stop = text[offsets[3] - 1:offsets[4] + 1]
    assert text.index(stop) == offsets[3] - 1, (text, stop)
    want = http.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert want["finish_reason"] == "stop"
    with http.stream("POST", "/v1/completions",
                     json={**body, "stop": [stop], "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    streamed = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in streamed) == want["text"]
    for key in ("tokens", "text_offset"):
        assert [x for c in streamed for x in c["logprobs"][key]] == want["logprobs"][key], key


@pytest.mark.parametrize("value, says", [(0, "max_completion_tokens must be"),
                                         (10**6, "lower max_completion_tokens to at most")])
def test_chat_errors_name_max_completion_tokens_when_that_was_sent(http, value, says):
    error = assert_openai_error(http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_completion_tokens": value}), 400)
    assert error["param"] == "max_completion_tokens" and says in error["message"], error


def test_max_tokens_null_gives_each_prompt_of_a_batch_its_own_room(http, engine):
    max_len = engine.max_model_len
    prompts = [[5] * (max_len - 4), [6] * (max_len - 8)]
    result = http.post("/v1/completions", json={"model": MODEL, "prompt": prompts,
                                                "max_tokens": None, "ignore_eos": True,
                                                "logprobs": 0}).json()
    assert [len(c["logprobs"]["tokens"]) for c in result["choices"]] == [4, 8], result
    assert result["usage"]["completion_tokens"] == 12
    assert_idle(engine)

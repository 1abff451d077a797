"""The official openai client, sync and async, streaming and not: answers equal kiln.LLM's."""

from __future__ import annotations

import openai
import pytest

from kiln import SamplingParams
from kiln.serve.app import create_app

from .conftest import MODEL, ServerThread, assert_idle

SEED, TEMPERATURE, MAX_TOKENS = 1234, 0.8, 6
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "def fibonacci(n):"}]


def expected(llm, prompt, **overrides):
    params = dict(seed=SEED, temperature=TEMPERATURE, max_tokens=MAX_TOKENS)
    return llm.generate(prompt, SamplingParams(**{**params, **overrides}))


def chat_prompt_ids(llm) -> list[int]:
    text = llm.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_name(client, engine):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.model_extra["max_model_len"] == engine.max_model_len


def test_models_retrieve_is_the_listed_card(client):
    (listed,) = client.models.list().data
    assert client.models.retrieve(MODEL) == listed
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("org/gpt-4")  # the client sends the slash as %2F
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'org/gpt-4'" in error["message"]
    assert f"this server serves '{MODEL}'" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_sync_completion_matches_llm(client, reference_llm, engine, stream):
    (want,) = expected(reference_llm, "The quick brown fox")
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=MAX_TOKENS, seed=SEED,
                  temperature=TEMPERATURE)
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
        assert chunks[-1].choices == []
    else:
        result = client.completions.create(**kwargs)
        text, finish, usage = result.choices[0].text, result.choices[0].finish_reason, result.usage
    assert text == want.outputs[0].text
    assert finish == want.outputs[0].finish_reason == "length"
    assert usage.prompt_tokens == len(want.prompt_token_ids)
    assert usage.completion_tokens == len(want.outputs[0].token_ids) == MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert_idle(engine)


@pytest.mark.parametrize("stream", [False, True])
def test_sync_chat_matches_llm(client, reference_llm, stream):
    (want,) = expected(reference_llm, chat_prompt_ids(reference_llm))
    kwargs = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=MAX_TOKENS, seed=SEED,
                  temperature=TEMPERATURE)
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        result = client.chat.completions.create(**kwargs)
        assert result.choices[0].message.role == "assistant"
        text, usage = result.choices[0].message.content, result.usage
    assert text == want.outputs[0].text
    assert usage.prompt_tokens == len(want.prompt_token_ids)
    assert usage.completion_tokens == MAX_TOKENS


@pytest.mark.parametrize("stream", [False, True])
async def test_async_completion_many_prompts_and_samples(async_client, reference_llm, engine,
                                                         stream):
    prompts = ["Unicode: café", "def fib"]
    want = expected(reference_llm, prompts, n=2)
    kwargs = dict(model=MODEL, prompt=prompts, n=2, max_tokens=MAX_TOKENS, seed=SEED,
                  temperature=TEMPERATURE)
    texts: dict[int, str] = {}
    if stream:
        stream_ = await async_client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True})
        async for chunk in stream_:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
            usage = chunk.usage
    else:
        result = await async_client.completions.create(**kwargs)
        texts = {c.index: c.text for c in result.choices}
        usage = result.usage
    # choice index = prompt index * n + sample index, as OpenAI numbers them
    assert texts == {2 * p + s: want[p].outputs[s].text for p in range(2) for s in range(2)}
    assert usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert usage.completion_tokens == 4 * MAX_TOKENS
    assert_idle(engine)


@pytest.mark.parametrize("stream", [False, True])
async def test_async_chat_matches_llm(async_client, reference_llm, stream):
    (want,) = expected(reference_llm, chat_prompt_ids(reference_llm), temperature=0.0)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0)
    if stream:
        parts = [c.choices[0].delta.content or "" async for c in
                 await async_client.chat.completions.create(**kwargs, stream=True) if c.choices]
        text = "".join(parts)
    else:
        text = (await async_client.chat.completions.create(**kwargs)).choices[0].message.content
    assert text == want.outputs[0].text


def test_token_id_prompt_and_logprobs(client, reference_llm):
    ids = reference_llm.tokenizer.encode("The lazy dog")
    (want,) = expected(reference_llm, ids, temperature=0.0, logprobs=2)
    result = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS,
                                       temperature=0.0, logprobs=2)
    choice = result.choices[0]
    assert choice.text == want.outputs[0].text
    assert len(choice.logprobs.tokens) == MAX_TOKENS
    for token_id, entry, logprob in zip(want.outputs[0].token_ids, want.outputs[0].logprobs,
                                        choice.logprobs.token_logprobs, strict=True):
        assert logprob == pytest.approx(entry[token_id], abs=1e-5)
    assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)


def test_chat_top_logprobs(client, reference_llm):
    (want,) = expected(reference_llm, chat_prompt_ids(reference_llm), temperature=0.0,
                       logprobs=3)
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.0,
                                            max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=3)
    content = result.choices[0].logprobs.content
    assert len(content) == MAX_TOKENS
    for item, token_id, entry in zip(content, want.outputs[0].token_ids, want.outputs[0].logprobs,
                                     strict=True):
        assert item.logprob == pytest.approx(entry[token_id], abs=1e-5)
        assert len(item.top_logprobs) == 3
        best = sorted(entry.values(), reverse=True)[:3]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(best, abs=1e-5)


def test_stop_string_ends_the_text_before_it(client, reference_llm):
    (free,) = expected(reference_llm, "The quick", temperature=0.0, max_tokens=12)
    text = free.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), "the greedy text is too short to pick a stop string from"
    result = client.completions.create(model=MODEL, prompt="The quick", max_tokens=12,
                                       temperature=0.0, stop=[stop])
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[:text.index(stop)]
    assert choice.model_extra["stop_reason"] == stop


def test_vllm_benchmark_extensions_are_honoured(client):
    result = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=7, temperature=0.7,
        extra_body={"ignore_eos": True, "min_tokens": 7, "top_k": 5, "min_p": 0.01,
                    "repetition_penalty": 1.1}, presence_penalty=0.5, frequency_penalty=0.5,
        top_p=0.9, user="someone")
    assert result.usage.completion_tokens == 7
    assert result.choices[0].finish_reason == "length"


@pytest.mark.parametrize("options, says", [
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs must be None or an integer in [0, 20]"),
    ({"top_logprobs": 3}, "top_logprobs requires logprobs=true")])
def test_bad_top_logprobs_is_a_400_naming_it(client, engine, options, says):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **options)
    error = caught.value.body
    assert error["param"] == "top_logprobs" and says in error["message"], error
    assert_idle(engine)


FUNCTION = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize("chat, options, param", [
    (False, {"extra_body": {"logits_processors": ["my.module:Processor"]}}, "logits_processors"),
    (True, {"extra_body": {"guided_json": {"type": "object"}, "guided_whitespace_pattern": " "}},
     "guided_whitespace_pattern"),
    # tools without tool_choice ask for "auto", which needs a server started with a parser
    (True, {"tools": [{"type": "function", "function": FUNCTION}]}, "tool_choice"),
    (True, {"functions": [FUNCTION]}, "functions"),
    (True, {"tool_choice": "required"}, "tool_choice"),
    (True, {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice"),
    (True, {"function_call": {"name": "get_weather"}}, "function_call")])
def test_options_that_would_change_the_output_are_refused_not_ignored(client, engine, chat,
                                                                       options, param):
    # vLLM honours these (or refuses a tool choice without tools): answering as if they were
    # not sent would hand the client unconstrained text where it asked for something else
    with pytest.raises(openai.BadRequestError) as caught:
        if chat:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                           **options)
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **options)
    error = caught.value.body
    assert error["param"] == param and param in error["message"], error
    assert_idle(engine)


def test_tool_choice_a_plain_answer_meets_is_accepted(client):
    for choice in ("none", "auto"):
        result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                                tool_choice=choice)
        assert result.usage.completion_tokens == 2


THINKING_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if enable_thinking | default(true) %}<think>{% endif %}")


@pytest.fixture(scope="module")
def thinking_client(engine):
    app = create_app(engine, served_model_name=MODEL, chat_template=THINKING_TEMPLATE)
    with ServerThread(app) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_chat_template_kwargs_reach_the_template(thinking_client, reference_llm, kwargs):
    # vLLM's way to switch e.g. Qwen3's thinking off; ignored, the prompt kept "<think>"
    text = reference_llm.tokenizer.apply_chat_template(
        MESSAGES, chat_template=THINKING_TEMPLATE, tokenize=False, add_generation_prompt=True,
        **kwargs)
    result = thinking_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2,
        extra_body={"chat_template_kwargs": kwargs})
    assert text.endswith(":\n" if kwargs.get("enable_thinking") is False else "<think>")
    assert result.usage.prompt_tokens == len(
        reference_llm.tokenizer.encode(text, add_special_tokens=False))


ECHO_PROMPT = "The quick brown fox"


def echo_prompt(reference_llm, token_ids: bool) -> str | list[int]:
    return reference_llm.tokenizer.encode(ECHO_PROMPT) if token_ids else ECHO_PROMPT


def streamed_choices(chunks) -> dict[int, list]:
    """Each choice's chunk choices, in the order they came."""
    choices: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            choices.setdefault(choice.index, []).append(choice)
    return choices


@pytest.mark.parametrize("token_ids", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_puts_the_prompt_before_the_completion(client, reference_llm, engine, token_ids,
                                                    stream):
    # vLLM's echo: a token-id prompt comes back decoded
    prompt = echo_prompt(reference_llm, token_ids)
    (want,) = expected(reference_llm, prompt)
    kwargs = dict(model=MODEL, prompt=prompt, echo=True, max_tokens=MAX_TOKENS, seed=SEED,
                  temperature=TEMPERATURE)
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True,
                                                stream_options={"include_usage": True}))
        (parts,) = streamed_choices(chunks).values()
        assert parts[0].text.startswith(ECHO_PROMPT)  # the prompt comes whole, first
        text, usage = "".join(p.text for p in parts), chunks[-1].usage
    else:
        result = client.completions.create(**kwargs)
        text, usage = result.choices[0].text, result.usage
    assert text == ECHO_PROMPT + want.outputs[0].text
    assert usage.prompt_tokens == len(want.prompt_token_ids)
    assert usage.completion_tokens == MAX_TOKENS
    assert_idle(engine)


def assert_echo_logprobs(logprobs, text: str, want, num_completion_tokens: int) -> None:
    """The prompt's logprobs, then the completion's, as kiln.LLM computes them."""
    num_tokens = len(want.prompt_token_ids) + num_completion_tokens
    assert len(logprobs.tokens) == num_tokens
    assert "".join(logprobs.tokens) == text
    # nothing before the first prompt token predicts it: null, as OpenAI and vLLM send it
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    token_ids = [*want.prompt_token_ids, *want.outputs[0].token_ids][:num_tokens]
    entries = [*want.prompt_logprobs, *want.outputs[0].logprobs][:num_tokens]
    for token_id, entry, logprob, top in zip(token_ids[1:], entries[1:],
                                             logprobs.token_logprobs[1:],
                                             logprobs.top_logprobs[1:], strict=True):
        assert logprob == pytest.approx(entry[token_id], abs=1e-5)
        assert 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(max(entry.values()), abs=1e-5)
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets


@pytest.mark.parametrize("token_ids", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_hold_the_prompts_then_the_completions(client, reference_llm, token_ids,
                                                             stream):
    prompt = echo_prompt(reference_llm, token_ids)
    (want,) = expected(reference_llm, prompt, temperature=0.0, logprobs=1, prompt_logprobs=1)
    kwargs = dict(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=MAX_TOKENS,
                  temperature=0.0)
    if stream:
        (parts,) = streamed_choices(client.completions.create(**kwargs, stream=True)).values()
        # the first chunk holds the prompt's logprobs, whole
        assert len(parts[0].logprobs.tokens) > len(want.prompt_token_ids)
        text = "".join(p.text for p in parts)
        logprobs = parts[0].logprobs
        for part in parts[1:]:
            for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(logprobs, field).extend(getattr(part.logprobs, field))
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, logprobs = choice.text, choice.logprobs
    assert text == ECHO_PROMPT + want.outputs[0].text
    assert_echo_logprobs(logprobs, text, want, MAX_TOKENS)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, reference_llm, engine, stream):
    # lm-evaluation-harness's loglikelihood: token-id prompts, echo, logprobs 1, max_tokens 0
    prompts = [reference_llm.tokenizer.encode(p) for p in ("The quick brown fox", "def fib")]
    want = expected(reference_llm, prompts, temperature=0.0, logprobs=1, prompt_logprobs=1)
    kwargs = dict(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=0,
                  temperature=0.0)
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True,
                                                stream_options={"include_usage": True}))
        # one chunk per choice: the prompt, with its logprobs and the finish reason
        streamed = streamed_choices(chunks)
        assert all(len(parts) == 1 for parts in streamed.values()), streamed
        choices = {i: parts[0] for i, parts in streamed.items()}
        usage = chunks[-1].usage
    else:
        result = client.completions.create(**kwargs)
        choices, usage = {c.index: c for c in result.choices}, result.usage
    assert sorted(choices) == [0, 1]
    for i, choice in choices.items():
        assert choice.text == reference_llm.tokenizer.decode(prompts[i])
        assert choice.finish_reason == "length"
        assert_echo_logprobs(choice.logprobs, choice.text, want[i], 0)
    assert usage.prompt_tokens == sum(len(p) for p in prompts)
    assert usage.completion_tokens == 0  # the engine's one sampled token is not the client's
    assert_idle(engine)


@pytest.mark.parametrize("max_tokens", [0, MAX_TOKENS])
@pytest.mark.parametrize("stream", [False, True])
async def test_echo_many_prompts_and_samples(async_client, reference_llm, engine, max_tokens,
                                             stream):
    prompts = ["Unicode: café", "def fib"]
    want = expected(reference_llm, prompts, n=2)
    kwargs = dict(model=MODEL, prompt=prompts, n=2, echo=True, max_tokens=max_tokens,
                  seed=SEED, temperature=TEMPERATURE)
    texts: dict[int, str] = {}
    if stream:
        async for chunk in await async_client.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                if choice.index not in texts:  # every choice's first chunk opens with its prompt
                    assert choice.text.startswith(prompts[choice.index // 2])
                texts[choice.index] = texts.get(choice.index, "") + choice.text
    else:
        result = await async_client.completions.create(**kwargs)
        texts = {c.index: c.text for c in result.choices}
        assert result.usage.completion_tokens == 4 * max_tokens
    completions = {2 * p + s: want[p].outputs[s].text if max_tokens else ""
                   for p in range(2) for s in range(2)}
    assert texts == {i: prompts[i // 2] + text for i, text in completions.items()}
    assert_idle(engine)


@pytest.mark.parametrize("chat", [False, True])
def test_stream_options_without_stream_is_a_400_naming_it(client, engine, chat):
    # as vLLM: include_usage would otherwise be dropped without a word
    with pytest.raises(openai.BadRequestError) as caught:
        if chat:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                           stream_options={"include_usage": True})
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                      stream_options={"include_usage": True})
    error = caught.value.body
    assert error["param"] == "stream_options" and "stream_options" in error["message"], error
    assert_idle(engine)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_logit_bias_reaches_the_sampler(client, reference_llm, endpoint):
    """OpenAI's logit_bias (token id strings -> bias): the answer equals kiln.LLM's with the
    same bias; +100 on one token makes every greedy token that one."""
    bias = {"7": 100, "11": -100}
    if endpoint == "completions":
        got = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=4,
                                        temperature=0.0, logit_bias=bias)
        (want,) = expected(reference_llm, "The quick brown fox", max_tokens=4, temperature=0.0,
                           logit_bias={7: 100, 11: -100})
        assert got.choices[0].text == want.outputs[0].text
    else:
        got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                             temperature=0.0, logit_bias=bias, logprobs=True)
        assert {t.token for t in got.choices[0].logprobs.content} == {
            reference_llm.tokenizer.convert_ids_to_tokens(7)}


ALLOWED = [5, 19, 230, 267, 302]


def served_text(client, endpoint: str, prompt: str, **options) -> str:
    """The first choice's text from /v1/completions (``prompt``) or /v1/chat/completions
    (MESSAGES, which ``prompt`` holds rendered for the reference)."""
    if endpoint == "completions":
        return client.completions.create(prompt=prompt, **options).choices[0].text
    answer = client.chat.completions.create(messages=MESSAGES, **options)
    return answer.choices[0].message.content


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_allowed_token_ids_reach_the_sampler(client, reference_llm, endpoint):
    """vLLM's allowed_token_ids: the answer equals kiln.LLM's with the same set, and every
    token is one of it."""
    prompt = "The quick brown fox" if endpoint == "completions" else chat_prompt_ids(
        reference_llm)
    (want,) = expected(reference_llm, prompt, allowed_token_ids=ALLOWED)
    assert set(want.outputs[0].token_ids) <= set(ALLOWED)
    options = dict(model=MODEL, max_tokens=MAX_TOKENS, seed=SEED, temperature=TEMPERATURE,
                   extra_body={"allowed_token_ids": ALLOWED})
    assert served_text(client, endpoint, prompt, **options) == want.outputs[0].text


def a_word_of(llm, prompt) -> str:
    """The text of a greedy answer's token after the first that the tokenizer writes alone."""
    tok = llm.tokenizer
    (free,) = expected(llm, prompt, temperature=0.0)
    return next(w for t in free.outputs[0].token_ids[1:] if (w := tok.decode([t])).strip()
                and tok.encode(w.lstrip(), add_special_tokens=False) == [t])


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bad_words_reach_the_sampler(client, reference_llm, endpoint):
    """vLLM's bad_words, tokenized by the engine: the answer equals kiln.LLM's with the same
    words, which is not the answer without them."""
    prompt = "The quick brown fox" if endpoint == "completions" else chat_prompt_ids(
        reference_llm)
    words = [a_word_of(reference_llm, prompt)]
    (free,) = expected(reference_llm, prompt, temperature=0.0)
    (want,) = expected(reference_llm, prompt, temperature=0.0, bad_words=words)
    assert want.outputs[0].text != free.outputs[0].text
    options = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0.0,
                   extra_body={"bad_words": words})
    assert served_text(client, endpoint, prompt, **options) == want.outputs[0].text


def assert_prompt_logprobs(served, want, tokenizer, k: int) -> None:
    """vLLM's shape: per prompt token null first, then token id (a JSON key) -> {logprob,
    rank, decoded_token} for the token, first, and its top k alternatives."""
    assert len(served) == len(want.prompt_token_ids) and served[0] is None
    for token, entry, got, rank in zip(want.prompt_token_ids[1:], want.prompt_logprobs[1:],
                                       served[1:], want.prompt_logprob_ranks[1:], strict=True):
        assert list(got)[0] == str(token) and set(got) == {str(t) for t in entry}
        assert got[str(token)]["rank"] == rank
        for t, lp in entry.items():
            assert got[str(t)]["logprob"] == pytest.approx(lp, abs=1e-5)
            assert got[str(t)]["decoded_token"] == tokenizer.decode([t])
        top = sorted(entry, key=entry.get, reverse=True)[:k]
        assert sorted(got[str(t)]["rank"] for t in top) == list(range(1, k + 1))


def test_prompt_logprobs_on_each_completion_choice(client, reference_llm):
    prompts = ["The quick brown fox", "def fib"]
    want = expected(reference_llm, prompts, temperature=0.0, prompt_logprobs=2)
    result = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=2,
                                       temperature=0.0, extra_body={"prompt_logprobs": 2})
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    for choice in result.choices:  # each choice of a prompt carries that prompt's
        assert_prompt_logprobs(choice.model_extra["prompt_logprobs"], want[choice.index // 2],
                               reference_llm.tokenizer, 2)
    plain = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=2)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None


def test_prompt_logprobs_on_the_chat_response(client, reference_llm):
    (want,) = expected(reference_llm, chat_prompt_ids(reference_llm), temperature=0.0,
                       prompt_logprobs=0)
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                            temperature=0.0, extra_body={"prompt_logprobs": 0})
    assert_prompt_logprobs(result.model_extra["prompt_logprobs"], want,
                           reference_llm.tokenizer, 0)
    assert "prompt_logprobs" not in result.choices[0].model_extra


def test_prompt_logprobs_set_the_count_of_an_echoed_prompts_alternatives(client, reference_llm):
    # as vLLM: echo's prompt logprobs default to logprobs' count; prompt_logprobs overrides it
    # in the engine, while the echoed logprobs still show logprobs' count
    (want,) = expected(reference_llm, ECHO_PROMPT, temperature=0.0, logprobs=1,
                       prompt_logprobs=3)
    choice = client.completions.create(model=MODEL, prompt=ECHO_PROMPT, echo=True, logprobs=1,
                                       max_tokens=MAX_TOKENS, temperature=0.0,
                                       extra_body={"prompt_logprobs": 3}).choices[0]
    assert_echo_logprobs(choice.logprobs, choice.text, want, MAX_TOKENS)
    assert_prompt_logprobs(choice.model_extra["prompt_logprobs"], want,
                           reference_llm.tokenizer, 3)


@pytest.mark.parametrize("chat", [False, True])
def test_prompt_logprobs_with_stream_is_a_400_unless_0(client, engine, chat):
    # vLLM's: a stream's chunks have no place for them
    def create(prompt_logprobs: int):
        options = dict(model=MODEL, max_tokens=2, stream=True,
                       extra_body={"prompt_logprobs": prompt_logprobs})
        if chat:
            return list(client.chat.completions.create(messages=MESSAGES, **options))
        return list(client.completions.create(prompt="hi", **options))

    with pytest.raises(openai.BadRequestError) as caught:
        create(1)
    error = caught.value.body
    assert error["param"] == "prompt_logprobs" and "stream" in error["message"], error
    assert create(0)[-1].choices[0].finish_reason == "length"
    assert_idle(engine)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("continuous", [False, True])
def test_continuous_usage_stats_put_each_choices_usage_so_far_on_every_chunk(
        client, reference_llm, engine, chat, continuous):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries
    its prompt's tokens and its choice's tokens so far; without it only the last chunk has
    usage."""
    options = {"include_usage": True, "continuous_usage_stats": continuous}
    kwargs = dict(model=MODEL, max_tokens=MAX_TOKENS, seed=SEED, temperature=TEMPERATURE, n=2,
                  stream=True, stream_options=options)
    if chat:
        chunks = list(client.chat.completions.create(messages=MESSAGES, **kwargs))
        num_prompt = len(chat_prompt_ids(reference_llm))
    else:
        chunks = list(client.completions.create(prompt="The quick brown fox", **kwargs))
        (want,) = expected(reference_llm, "The quick brown fox", n=2)
        num_prompt = len(want.prompt_token_ids)
    *choice_chunks, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 2 * MAX_TOKENS
    if not continuous:
        assert all(c.usage is None for c in choice_chunks)
        return
    so_far: dict[int, list[int]] = {0: [], 1: []}
    for c in choice_chunks:
        (choice,) = c.choices
        assert c.usage.prompt_tokens == num_prompt
        assert c.usage.total_tokens == num_prompt + c.usage.completion_tokens
        so_far[choice.index].append(c.usage.completion_tokens)
    for counts in so_far.values():
        assert counts == sorted(counts) and counts[-1] == MAX_TOKENS
    if chat:  # the role chunk that opens each choice comes before any token
        assert so_far[0][0] == so_far[1][0] == 0
    assert_idle(engine)

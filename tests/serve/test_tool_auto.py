"""tool_choice "auto" end to end, through the official openai client: kiln-tiny answers freely
(here under a guided_regex that makes it write a call in a parser's syntax, with some freedom),
and the server's --tool-call-parser finds the calls, streaming or not; without the flags "auto"
stays a 400 that names them."""

from __future__ import annotations

import contextlib
import json

import openai
import pytest

from kiln.serve.app import create_app

from .conftest import MODEL, ServerThread, assert_idle, kiln_tiny_server, openai_client
from .test_tool_calls import MESSAGES, TEMPLATE, TOOLS, follows_weather

WEATHER_ARGUMENTS = r'\{"days": [1-7], "unit": "(celsius|fahrenheit)"\}'
# content, then two calls in Hermes' syntax
HERMES = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
          + WEATHER_ARGUMENTS + r'\}\n</tool_call>\n<tool_call>\n\{"name": "get_time", '
          r'"arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>')
# one call, and nothing else, in the other parsers' syntax
ONE_CALL = {
    "llama3_json": r'<\|python_tag\|>\{"name": "get_weather", "parameters": '
                   + WEATHER_ARGUMENTS + r'\}',
    "mistral": r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": '
               + WEATHER_ARGUMENTS + r'\}\]',
    "pythonic": r'\[get_weather\(days=[1-7], unit="(celsius|fahrenheit)"\)\]'}


@pytest.fixture(scope="module")
def tiny_server():
    with kiln_tiny_server(chat_template=TEMPLATE, tool_call_parser="hermes") as served:
        yield served


@pytest.fixture(scope="module")
def clients(tiny_server):
    """A client of a server per parser, and of one without (None), all around one engine."""
    clients = {"hermes": openai_client(tiny_server[0])}
    with contextlib.ExitStack() as servers:
        for name in (*ONE_CALL, None):
            app = create_app(tiny_server[1], served_model_name=MODEL, chat_template=TEMPLATE,
                             tool_call_parser=name)
            clients[name] = openai_client(servers.enter_context(ServerThread(app)))
        yield clients


def create(client, regex: str, **kwargs):
    return client.chat.completions.create(**{
        "model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 160,
        "temperature": 1.0, **kwargs}, extra_body={"guided_regex": regex})


def streamed(client, regex: str, **kwargs) -> dict[int, dict]:
    """Each choice's content, calls and finish reason, put together from the chunks."""
    choices: dict[int, dict] = {}
    for chunk in create(client, regex, stream=True, **kwargs):
        for c in chunk.choices:
            choice = choices.setdefault(c.index, {"content": "", "calls": [], "finish": None})
            choice["content"] += c.delta.content or ""
            for call in c.delta.tool_calls or []:  # each one whole, in one delta (vLLM's shape)
                assert call.index == len(choice["calls"]) and call.type == "function", call
                assert call.id, call
                choice["calls"].append((call.function.name, call.function.arguments))
            choice["finish"] = c.finish_reason or choice["finish"]
    return choices


def test_auto_finds_hermes_calls_and_the_content_before_them(clients, tiny_engine):
    result = create(clients["hermes"], HERMES, n=2, seed=5)
    assert len(result.choices) == 2
    for choice in result.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check.\n"
        weather, time = choice.message.tool_calls
        assert weather.function.name == "get_weather" and time.function.name == "get_time"
        follows_weather(weather.function.arguments)
        assert json.loads(time.function.arguments)["zone"] in ("UTC", "CET")
        assert weather.id != time.id and weather.id.startswith("chatcmpl-tool-")
    # streamed: the content without any of the marker, each call whole once complete
    chunks = streamed(clients["hermes"], HERMES, n=2, seed=5)
    for choice in result.choices:  # the same seed samples the same answers
        assert chunks[choice.index] == {
            "content": "Let me check.\n", "finish": "tool_calls",
            "calls": [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]}
    assert_idle(tiny_engine)


@pytest.mark.parametrize("parser", list(ONE_CALL))
def test_auto_finds_the_calls_of_each_parser(clients, parser):
    regex = ONE_CALL[parser]
    result = create(clients[parser], regex, seed=3)
    [choice] = result.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None  # (vLLM's)
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    follows_weather(call.function.arguments)
    assert streamed(clients[parser], regex, seed=3) == {0: {
        "content": "", "finish": "tool_calls",
        "calls": [("get_weather", call.function.arguments)]}}


@pytest.mark.parametrize("max_tokens, cut", [(12, "<to"), (30, '<tool_call>\n{"name": ')])
def test_a_call_cut_off_by_max_tokens_comes_back_as_content(clients, tiny_engine, max_tokens,
                                                            cut):
    result = create(clients["hermes"], HERMES, max_tokens=max_tokens, seed=5)
    [choice] = result.choices
    assert choice.finish_reason == "length" and choice.message.tool_calls in (None, [])
    assert choice.message.content.startswith("Let me check.\n" + cut), choice
    # streamed, what was held back as a maybe-call is flushed as content at the end
    assert streamed(clients["hermes"], HERMES, max_tokens=max_tokens, seed=5) == {0: {
        "content": choice.message.content, "finish": "length", "calls": []}}
    assert_idle(tiny_engine)


def test_an_answer_without_a_call_is_content(clients):
    regex = r"The weather is (sunny|rainy)\."
    [choice] = create(clients["hermes"], regex).choices
    assert choice.finish_reason == "stop" and choice.message.tool_calls in (None, [])
    assert choice.message.content in ("The weather is sunny.", "The weather is rainy.")
    [chunks] = streamed(clients["hermes"], regex).values()
    assert chunks["finish"] == "stop" and chunks["calls"] == []
    assert chunks["content"] in ("The weather is sunny.", "The weather is rainy.")


@pytest.mark.parametrize("tool_choice", ["auto", None])  # (None: OpenAI's default with tools)
def test_auto_without_the_server_flags_is_a_400_naming_them(clients, tool_choice):
    with pytest.raises(openai.BadRequestError) as caught:
        clients[None].chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=2,
            **({"tool_choice": tool_choice} if tool_choice else {}))
    error = caught.value.body
    assert error["param"] == "tool_choice", error
    assert "restart it with --enable-auto-tool-choice --tool-call-parser NAME" in error["message"]

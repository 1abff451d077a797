"""Function calling through the official openai client, as vLLM does it without a tool-call
parser: a named tool_choice or "required" forces calls whose JSON follows the tools' schemas,
streaming or not; the tools and a history of calls reach the chat template; "auto" on a server
without a tool-call parser (test_tool_auto.py has the parsers), the legacy functions and bad tools
are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kiln.serve.tools import complete_calls

from .conftest import MODEL, assert_idle, kiln_tiny_server

UNITS = ["celsius", "fahrenheit"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object",
                   "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7},
                                  "unit": {"type": "string", "enum": UNITS}},
                   "required": ["days", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                             "enum": ["UTC", "CET"]}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# kiln-tiny's own template knows no tools and refuses the tool role; this one writes both
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>\n{% for tool in tools %}"
    "{{ tool.function.name }}: {{ tool.function.description }}\n{% endfor %}{% endif %}"
    "{% for message in messages %}{{ '<|' + message.role + '|>\n' + message.content }}"
    "{% for call in message.tool_calls or [] %}{{ call.function.name }}"
    "({{ call.function.arguments.city }}){% endfor %}"
    "{% if message.tool_call_id %}[{{ message.tool_call_id }}]{% endif %}"
    "{{ eos_token + '\n' }}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def follows_weather(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"days", "unit"} and value["unit"] in UNITS, arguments
    assert isinstance(value["days"], int) and 1 <= value["days"] <= 7, arguments


def follows_its_tool(call) -> None:
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-"), call
    if call.function.name == "get_weather":
        follows_weather(call.function.arguments)
    else:
        assert call.function.name == "get_time", call
        assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET"), call


@pytest.fixture(scope="module")
def tiny_server():
    with kiln_tiny_server(chat_template=TEMPLATE) as served:
        yield served


def create(tiny_client, **kwargs):
    return tiny_client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES,
                                                  "tools": TOOLS, "max_tokens": 64, **kwargs})


def test_named_tool_choice_answers_that_call(tiny_client, tiny_engine):
    # (hotter, kiln-tiny may spend its tokens on the whitespace JSON allows between tokens)
    result = create(tiny_client, tool_choice=NAMED, n=2, temperature=0.3, seed=2)
    assert len(result.choices) == 2
    ids = set()
    for choice in result.choices:
        assert choice.finish_reason == "stop"  # vLLM's for a forced call, unstreamed
        assert choice.message.content == "" and choice.message.role == "assistant"
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        follows_its_tool(call)
        assert len(call.id) == len("chatcmpl-tool-") + 32
        ids.add(call.id)
    assert len(ids) == 2
    assert_idle(tiny_engine)


def stream_calls(tiny_client, **kwargs) -> tuple[dict[int, list[dict]], dict[int, str]]:
    """Each choice's calls reassembled from the deltas, and its finish reason."""
    calls: dict[int, list[dict]] = {}
    reasons: dict[int, str] = {}
    for chunk in create(tiny_client, stream=True, **kwargs):
        for c in chunk.choices:
            assert not c.delta.content, c  # (only the role chunk's "")
            for delta in c.delta.tool_calls or []:
                mine = calls.setdefault(c.index, [])
                if delta.id is not None:  # a call opens: its id, type and name, once
                    assert delta.index == len(mine) and delta.type == "function", delta
                    mine.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
                else:
                    assert delta.function.name is None and delta.index == len(mine) - 1, delta
                mine[delta.index]["arguments"] += delta.function.arguments or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return calls, reasons


def test_named_tool_choice_streamed_as_vllm_streams_it(tiny_client, tiny_engine):
    calls, reasons = stream_calls(tiny_client, tool_choice=NAMED, temperature=0.0)
    want = create(tiny_client, tool_choice=NAMED, temperature=0.0).choices[0].message.tool_calls[0]
    [call] = calls[0]
    assert reasons == {0: "tool_calls"}  # vLLM's once a stream has sent a call
    assert call["name"] == "get_weather" and call["id"].startswith("chatcmpl-tool-")
    assert call["arguments"] == want.function.arguments
    follows_weather(call["arguments"])
    calls, reasons = stream_calls(tiny_client, tool_choice=NAMED, n=2, temperature=0.3, seed=2)
    assert set(calls) == {0, 1} and reasons == {0: "tool_calls", 1: "tool_calls"}
    for choice_calls in calls.values():
        [call] = choice_calls
        follows_weather(call["arguments"])
    assert_idle(tiny_engine)


def test_required_answers_one_or_more_calls_of_the_tools(tiny_client, tiny_engine):
    result = create(tiny_client, tool_choice="required", n=2, temperature=0.5, seed=1,
                    max_tokens=128)
    for choice in result.choices:
        assert choice.finish_reason == "stop" and choice.message.content == ""
        assert len(choice.message.tool_calls) >= 1
        for call in choice.message.tool_calls:
            follows_its_tool(call)
    streamed, reasons = stream_calls(tiny_client, tool_choice="required", n=2, temperature=0.5,
                                     seed=1, max_tokens=128)
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    for index, choice in enumerate(result.choices):  # the same seed samples the same calls
        assert [(c["name"], c["arguments"]) for c in streamed[index]] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert_idle(tiny_engine)


def test_tool_choice_none_answers_content_and_still_shows_the_tools(tiny_client, tiny_server):
    result = create(tiny_client, tool_choice="none", max_tokens=8)
    assert result.choices[0].message.tool_calls in (None, [])  # (vLLM sends [])
    assert isinstance(result.choices[0].message.content, str)
    url = tiny_server[0].url
    tokens = httpx.post(url + "/tokenize", json={"messages": MESSAGES, "tools": TOOLS}).json()
    prompt = httpx.post(url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert "get_weather: The weather in a city" in prompt and "get_time" in prompt
    assert result.usage.prompt_tokens == tokens["count"]


def test_a_history_of_calls_and_their_answers_reaches_the_template(tiny_client, tiny_server):
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    result = create(tiny_client, messages=history, tool_choice="none", max_tokens=4)
    assert result.choices[0].finish_reason in ("stop", "length")
    url = tiny_server[0].url
    tokens = httpx.post(url + "/tokenize", json={"messages": history}).json()["tokens"]
    prompt = httpx.post(url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert "get_weather(Paris)" in prompt and "sunny, 21 C[call_1]" in prompt, prompt


BAD_PARAMETERS = {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}


@pytest.mark.parametrize("body, param, says", [
    ({"tool_choice": "auto"}, "tool_choice", 'tool_choice "auto" (the default when tools are '
                                             'given) needs a parser'),
    ({}, "tool_choice", 'set tool_choice to "required"'),
    ({"tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice",
     "tool_choice names function 'get_news', which is not among tools (they hold "
     "'get_weather', 'get_time')"),
    ({"tool_choice": {"function": "get_weather"}}, "tool_choice",
     'tool_choice must be "none", "auto", "required" or {"type": "function"'),
    ({"tool_choice": "always"}, "tool_choice", "got 'always'"),
    ({"tool_choice": "required", "tools": None}, "tool_choice", "the request has no tools"),
    ({"tool_choice": "none", "tools": [WEATHER, TIME, WEATHER]}, "tools.2.function.name",
     "tools.2.function.name 'get_weather' is also tools.0's; tool names must be unique"),
    ({"tool_choice": "none", "tools": [{"type": "function", "function": {"name": ""}}]},
     "tools.0.function.name", "tools.0.function.name is empty"),
    ({"tool_choice": "none", "tools": [{"type": "function", "function": {}}]},
     "tools.0.function.name", "Field required"),
    ({"tool_choice": "none", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": ["x"]}}]}, "tools.0.function.parameters",
     "Input should be a valid dictionary"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}, "tools": [BAD_PARAMETERS]},
     "tools.0.function.parameters",
     'tools.0.function.parameters: the JSON schema does not compile: Unsupported type "foo"'),
    ({"tool_choice": NAMED, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "response_format.json_schema.schema",
     "tool_choice forces a tool call, whose arguments follow the tool's schema, and "
     "response_format.json_schema.schema asks for structured outputs as well"),
    ({"tool_choice": "required", "guided_regex": "a+"}, "guided_regex", "send one of them"),
    ({"tool_choice": "none", "functions": [WEATHER["function"]]}, "functions",
     "functions (deprecated by OpenAI) is not supported"),
    ({"tools": None, "function_call": {"name": "get_weather"}}, "function_call",
     "function_call (deprecated by OpenAI) is not supported"),
    ({"tool_choice": "none", "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
     "messages.0.tool_calls.0.function.arguments",
     "messages.0.tool_calls.0.function.arguments is not JSON text"),
])
def test_what_kiln_cannot_do_and_bad_tools_are_400s_naming_the_field(tiny_client, tiny_engine, body,
                                                                     param, says):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 2, **body}
    with pytest.raises(openai.BadRequestError) as caught:
        sent = ("model", "messages", "max_tokens")  # as arguments; the rest as extra_body
        tiny_client.chat.completions.create(
            **{k: v for k, v in body.items() if k in sent},
            extra_body={k: v for k, v in body.items() if k not in sent})
    error = caught.value.body
    assert error["param"] == param and says in error["message"], error
    assert_idle(tiny_engine)


def test_auto_without_tools_still_answers(tiny_client):
    # clients send tool_choice "auto" on requests without tools; a plain answer meets it
    result = tiny_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                                 tool_choice="auto")
    assert isinstance(result.choices[0].message.content, str)


def test_required_calls_are_read_as_each_one_completes():
    text = '[ {"name": "a", "parameters": {"x": "}"}},\n{"name": "b",\n "parameters": {}} , {"na'
    calls, start = complete_calls(text)
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("a", '{"x": "}"}'), ("b", "{}")]
    assert text[start:] == '{"na'  # the third, cut off, waits for the rest of its text
    more, _ = complete_calls(text + 'me": "c", "parameters": {"y": [1]}}]', start)
    assert [(c.function.name, c.function.arguments) for c in more] == [("c", '{"y": [1]}')]
    assert len({c.id for c in [*calls, *more]}) == 3

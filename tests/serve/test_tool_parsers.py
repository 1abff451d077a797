"""The tool-call parsers of tool_choice "auto" on texts: the calls and content of a finished
answer, and the same ones found by feeding it in chunks of any size, as streaming does."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.serve.tool_parsers import TOOL_PARSERS, ParsedAnswer, tool_parser_named

WEATHER = {"days": 3, "unit": "celsius"}
ZURICH = {"city": "Zürich", "note": "ünïcödé ☀ \"quoted\" {braces}"}


def hermes_block(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def llama_call(name: str, parameters: dict, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: parameters}, ensure_ascii=False)


def mistral_calls(*calls: tuple[str, dict]) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


W, T = hermes_block("get_weather", WEATHER), hermes_block("get_time", {"zone": "UTC"})
P = '[get_weather(days=3, unit="celsius")]'
L = llama_call("get_weather", WEATHER)
M = mistral_calls(("get_weather", WEATHER), ("get_time", {"zone": "UTC"}))

# (parser, answer, content, calls as (name, arguments)); a text that does not parse is content
CASES = [
    ("hermes", W, None, [("get_weather", WEATHER)]),
    ("hermes", f"Let me check.\n{W}\n{T}\n", "Let me check.\n",
     [("get_weather", WEATHER), ("get_time", {"zone": "UTC"})]),
    ("hermes", "It is sunny <tool> today.", "It is sunny <tool> today.", []),
    ("hermes", hermes_block("find", ZURICH), None, [("find", ZURICH)]),
    ("hermes", f"{W}\nDone.", "\nDone.", [("get_weather", WEATHER)]),  # text after the calls
    ("hermes", W[:-len("</tool_call>")], None, [("get_weather", WEATHER)]),  # unclosed (vLLM)
    ("hermes", "Hm. " + W[:30], "Hm. " + W[:30], []),  # cut off by max_tokens
    ("hermes", "<tool_call>\n{'name': 'f'}\n</tool_call>", "<tool_call>\n{'name': 'f'}\n"
     "</tool_call>", []),  # not JSON
    ("hermes", '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', []),  # arguments not an object
    ("hermes", f"{W}\n{T[:-5]}", "\n" + T[:-5], [("get_weather", WEATHER)]),  # second cut off
    ("hermes", "", "", []),
    ("llama3_json", L, None, [("get_weather", WEATHER)]),
    ("llama3_json", f"<|python_tag|>{L}; {llama_call('find', ZURICH, 'arguments')}", None,
     [("get_weather", WEATHER), ("find", ZURICH)]),
    ("llama3_json", f" \n{L}\n", None, [("get_weather", WEATHER)]),
    ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but not a call
    ("llama3_json", L[:-2], L[:-2], []),  # cut off
    ("llama3_json", "<|python_tag|>{oops}", "<|python_tag|>{oops}", []),
    ("mistral", M, None, [("get_weather", WEATHER), ("get_time", {"zone": "UTC"})]),
    ("mistral", "Sure. " + mistral_calls(("find", ZURICH)), "Sure. ", [("find", ZURICH)]),
    ("mistral", "No [TOOLS] here.", "No [TOOLS] here.", []),
    ("mistral", M[:-12], M[M.index("}}") + 2:-12], [("get_weather", WEATHER)]),  # cut off
    ("mistral", "[TOOL_CALLS][{bad json}]", "[TOOL_CALLS][{bad json}]", []),
    # v11 and v13 tokenizers: a marker and the name before each call's arguments
    ("mistral", f"[TOOL_CALLS]get_weather{json.dumps(WEATHER)}", None, [("get_weather", WEATHER)]),
    ("mistral", f"Sure. [TOOL_CALLS]get_weather[ARGS]{json.dumps(WEATHER)}[TOOL_CALLS]find[ARGS]"
     f"{json.dumps(ZURICH, ensure_ascii=False)}", "Sure. ",
     [("get_weather", WEATHER), ("find", ZURICH)]),
    ("mistral", "[TOOL_CALLS]get_weather", "[TOOL_CALLS]get_weather", []),  # cut off
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]", "[TOOL_CALLS]get_weather[ARGS]", []),
    ("mistral", '[TOOL_CALLS]f["x"]', '[TOOL_CALLS]f["x"]', []),  # arguments not an object
    ("mistral", "Sure [TOOL_CALLS]", "Sure [TOOL_CALLS]", []),  # a marker and no call: content
    ("pythonic", "[]", "[]", []),
    ("pythonic", P, None, [("get_weather", WEATHER)]),
    ("pythonic", f' [{P[1:-1]}, get_time(zone="UTC")]\n', None,
     [("get_weather", WEATHER), ("get_time", {"zone": "UTC"})]),
    ("pythonic", f"[find(city={ZURICH['city']!r}, note={ZURICH['note']!r})]", None,
     [("find", ZURICH)]),
    ("pythonic", '[f(flag=True, x=None, xs=[1, 2.5], d={"a": (1, 2)}, s=")(")]', None,
     [("f", {"flag": True, "x": None, "xs": [1, 2.5], "d": {"a": [1, 2]}, "s": ")("})]),
    ("pythonic", "[g()]", None, [("g", {})]),
    ("pythonic", "The weather is nice.", "The weather is nice.", []),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),  # a list, but not of calls
    ("pythonic", P[:-4], P[:-4], []),  # cut off
    ("pythonic", "[f(3)]", "[f(3)]", []),  # positional arguments name nothing
    ("pythonic", '[f(x=__import__("os").getcwd())]', '[f(x=__import__("os").getcwd())]',
     []),  # not a literal: never evaluated
    # content resumes right after the last call, as in the other formats
    ("pythonic", f"{P} Done.", "] Done.", [("get_weather", WEATHER)]),
]


def found(answer: ParsedAnswer) -> tuple[str | None, list[tuple[str, dict]]]:
    return answer.content, [(c.function.name, json.loads(c.function.arguments))
                            for c in answer.calls]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_parse_finds_the_calls_and_the_content(name, text, content, calls):
    answer = tool_parser_named(name).parse(text)
    assert found(answer) == (content, calls)
    for call in answer.calls:  # arguments as vLLM dumps them: JSON text, unicode kept
        assert call.function.arguments == json.dumps(json.loads(call.function.arguments),
                                                     ensure_ascii=False)
        assert call.type == "function"


def fed_in_chunks(name: str, text: str, sizes: list[int]) -> ParsedAnswer:
    """The answer read as a stream of chunks of these sizes, as the server streams it."""
    stream = tool_parser_named(name).stream()
    content, calls, end = "", [], 0
    for size in sizes:
        end += size
        delta = stream.update(text[:end])
        content, calls = content + delta.content, calls + delta.calls
    delta = stream.update(text, final=True)
    content, calls = content + delta.content, calls + delta.calls
    return ParsedAnswer(content or None if calls else content, calls)


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_streaming_in_chunks_of_any_size_finds_the_same(name, text, content, calls):
    rng = random.Random(1234)
    splits = [[1] * len(text)]  # every boundary, inside the markers too
    for _ in range(20):
        sizes = []
        while sum(sizes) < len(text):
            sizes.append(rng.randint(1, 9))
        splits.append(sizes)
    for sizes in splits:
        assert found(fed_in_chunks(name, text, sizes)) == (content, calls), sizes


def test_a_partial_marker_is_held_back_until_decided():
    stream = tool_parser_named("hermes").stream()
    assert stream.update("It is <tool_c").content == "It is "
    assert stream.update("It is <tool_cat").content == "<tool_cat"
    assert stream.update("It is <tool_cat>. " + W[:20]).content == ">. "
    delta = stream.update("It is <tool_cat>. " + W)  # complete: sent before the answer ends
    assert delta.content == "" and [c.function.name for c in delta.calls] == ["get_weather"]
    assert stream.update("It is <tool_cat>. " + W + "\n").content == ""  # maybe another call
    delta = stream.update("It is <tool_cat>. " + W + "\n<tool", final=True)
    assert delta.content == "\n<tool" and delta.calls == []


def test_llama3_json_decides_at_the_first_character():
    stream = tool_parser_named("llama3_json").stream()
    assert stream.update(" ").content == ""  # (an answer may begin with whitespace)
    assert stream.update(" Hi {").content == " Hi {"
    assert stream.update(" Hi {there}").content == "there}"


def test_call_ids_are_fresh_and_mistral_ids_are_what_its_templates_take():
    hermes = tool_parser_named("hermes").parse(f"{W}{W}").calls
    assert len({c.id for c in hermes}) == 2
    assert all(c.id.startswith("chatcmpl-tool-") for c in hermes)
    for call in tool_parser_named("mistral").parse(M).calls:
        assert len(call.id) == 9 and call.id.isalnum(), call.id


def test_an_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool-call parser 'qwen'; Kiln has hermes, "
                                         "llama3_json, mistral, pythonic"):
        tool_parser_named("qwen")
    assert list(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral", "pythonic"]


PIECES = ["<tool_call>", "</tool_call>", "\n", " ", '{"name": "f", "arguments": {"a": 1}}',
          '{"name": "g", "parameters": {}}', "[TOOL_CALLS]", "[ARGS]", "get_weather", "{", "}",
          "[", "]", ",", ";", "<|python_tag|>", "f(x=1)", "g()", "(", ")", '"', "'", "\\", "hi ",
          '{"a": [1, "}"]}', "<tool", "_call>", "[TOOL_", "CALLS]"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(list(TOOL_PARSERS)),
       pieces=st.lists(st.sampled_from(PIECES), max_size=12),
       cuts=st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=40))
def test_any_text_parses_without_error_and_streams_as_it_parses(name, pieces, cuts):
    """Whatever the model writes: no exception, and the stream finds what the whole text has,
    the content and the calls together making up the text's characters outside the calls."""
    text = "".join(pieces)
    whole = tool_parser_named(name).parse(text)
    sizes = (cuts * (len(text) // len(cuts) + 1))[:len(text)]
    assert found(fed_in_chunks(name, text, sizes)) == found(whole)
    if not whole.calls:
        assert whole.content == text

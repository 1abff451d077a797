"""Structured outputs through the official openai client: OpenAI's response_format, vLLM's
guided_* and structured_outputs, streaming or not, on a kiln-tiny server (a trained tokenizer);
bad ones are 400s naming the field."""

from __future__ import annotations

import json
import re

import openai
import pytest

import kiln

from .conftest import MODEL, assert_idle, kiln_tiny_server

COLORS = ["red", "green", "light blue"]
SCHEMA = {"type": "object",
          "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "color": {"type": "string", "enum": COLORS}},
          "required": ["age", "color"]}
JSON_SCHEMA = {"type": "json_schema",
               "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
PROMPT = "def parse(data):\n    return"
CHOICES = ["alpha", "beta", "gamma delta"]
REGEX = r"(0|[1-9][0-9]{0,3})-[a-z]{2,6}"


def follows_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"age", "color"} and value["color"] in COLORS, text
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150, text


@pytest.fixture(scope="module")
def tiny_server():
    with kiln_tiny_server() as served:
        yield served


def chat_text(tiny_client, stream: bool, **kwargs) -> tuple[list[str], list[str]]:
    """(each choice's content, each choice's finish reason)."""
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 64, **kwargs}
    if not stream:
        result = tiny_client.chat.completions.create(**kwargs)
        return ([c.message.content for c in result.choices],
                [c.finish_reason for c in result.choices])
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in tiny_client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return [texts[i] for i in sorted(texts)], [reasons[i] for i in sorted(reasons)]


def completion_text(tiny_client, stream: bool, **kwargs) -> tuple[list[str], list[str]]:
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 48, **kwargs}
    if not stream:
        result = tiny_client.completions.create(**kwargs)
        return [c.text for c in result.choices], [c.finish_reason for c in result.choices]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in tiny_client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return [texts[i] for i in sorted(texts)], [reasons[i] for i in sorted(reasons)]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_response_format_json_schema_answers_follow_the_schema(tiny_client, tiny_engine,
                                                                    stream):
    # (hotter, kiln-tiny may spend its tokens on the whitespace JSON allows between tokens)
    texts, reasons = chat_text(tiny_client, stream, response_format=JSON_SCHEMA, n=2,
                               temperature=0.5, seed=2)
    assert len(texts) == 2 and reasons == ["stop", "stop"]
    for text in texts:
        follows_schema(text)
    assert_idle(tiny_engine)


def test_chat_json_schema_answers_as_kiln_llm_does(tiny_client):
    llm = kiln.LLM("kiln-tiny", device="cpu", dtype="float32", num_kv_blocks=64)
    [want] = llm.chat(MESSAGES, kiln.SamplingParams(
        temperature=0.0, max_tokens=64,
        structured_outputs=kiln.StructuredOutputsParams(json=SCHEMA)))
    texts, _ = chat_text(tiny_client, False, response_format=JSON_SCHEMA, temperature=0.0)
    assert texts == [want.outputs[0].text]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_response_format_json_object_answers_a_json_object(tiny_client, stream):
    texts, reasons = chat_text(tiny_client, stream, response_format={"type": "json_object"},
                               temperature=0.0,
                               messages=[{"role": "user", "content": "Give me a JSON object."}])
    assert reasons == ["stop"] and isinstance(json.loads(texts[0]), dict), texts


@pytest.mark.parametrize("stream", [False, True])
def test_guided_choice_and_regex_through_extra_body(tiny_client, tiny_engine, stream):
    texts, reasons = completion_text(tiny_client, stream, n=3, temperature=1.5, seed=1,
                                     extra_body={"guided_choice": CHOICES})
    assert reasons == ["stop"] * 3 and set(texts) <= set(CHOICES), texts
    texts, reasons = completion_text(tiny_client, stream, n=2, temperature=1.0, seed=2,
                                     extra_body={"guided_regex": REGEX})
    assert reasons == ["stop"] * 2 and all(re.fullmatch(REGEX, t) for t in texts), texts
    texts, _ = chat_text(tiny_client, stream, extra_body={"guided_choice": CHOICES})
    assert texts[0] in CHOICES
    assert_idle(tiny_engine)


@pytest.mark.parametrize("body", [
    {"guided_json": json.dumps(SCHEMA)},
    {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    {"response_format": JSON_SCHEMA}])  # vLLM takes response_format on completions too
def test_a_schema_in_each_of_vllms_ways(tiny_client, body):
    texts, reasons = completion_text(tiny_client, False, temperature=0.0, max_tokens=64,
                                     extra_body=body)
    assert reasons == ["stop"]
    follows_schema(texts[0])


def test_structured_outputs_grammar_and_choice(tiny_client):
    grammar = 'root ::= "x = " [1-9] [0-9]? ";"'
    texts, _ = completion_text(tiny_client, False, extra_body={"structured_outputs": {
        "grammar": grammar}})
    assert re.fullmatch(r"x = [1-9]\d?;", texts[0]), texts
    texts, _ = completion_text(tiny_client, False, extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"x = [1-9]\d?;", texts[0]), texts
    texts, _ = chat_text(tiny_client, True, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert texts[0] in CHOICES


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}


@pytest.mark.parametrize("chat, body, param, says", [
    (True, {"response_format": BAD_SCHEMA}, "response_format.json_schema.schema",
     'response_format.json_schema.schema: the JSON schema does not compile: Unsupported type '
     '"foo"'),
    (True, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "needs json_schema.schema"),
    (True, {"response_format": {"type": "xml"}}, "response_format.type",
     "Input should be 'text', 'json_object' or 'json_schema'"),
    (False, {"guided_regex": "(ab"}, "guided_regex",
     "guided_regex: the regex does not compile: Regex parsing error"),
    (False, {"guided_regex": ""}, "guided_regex", "guided_regex must be a non-empty string"),
    (False, {"guided_json": "{not json"}, "guided_json", "guided_json is not valid JSON"),
    (False, {"guided_choice": []}, "guided_choice", "guided_choice must be a non-empty list"),
    (False, {"guided_grammar": "root ::= "}, "guided_grammar",
     "guided_grammar: the grammar does not compile: EBNF parser error"),
    (False, {"structured_outputs": {"regex": "[", "choice": ["a"]}}, "structured_outputs",
     "structured_outputs takes exactly one of json, regex, choice, grammar, json_object; got "
     "regex, choice"),
    (False, {"structured_outputs": {"json": {"type": "foo"}}}, "structured_outputs.json",
     "structured_outputs.json: the JSON schema does not compile"),
    (False, {"structured_outputs": {"choice": "a"}}, "structured_outputs.choice",
     "structured_outputs.choice must be a non-empty list"),
    (False, {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs",
     "structured_outputs has no field 'structural_tag'; Kiln takes json, regex"),
    (True, {"guided_choice": ["a"], "response_format": {"type": "json_object"}},
     "response_format", "guided_choice and response_format each ask for structured outputs"),
])
def test_bad_structured_outputs_are_400s_naming_the_field(tiny_client, tiny_engine, chat, body,
                                                          param, says):
    with pytest.raises(openai.BadRequestError) as caught:
        if chat:
            tiny_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                                extra_body=body)
        else:
            tiny_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                           extra_body=body)
    error = caught.value.body
    assert error["param"] == param and says in error["message"], error
    assert ".cc:" not in error["message"]  # xgrammar's source lines stay out of it
    assert_idle(tiny_engine)

"""Parsers of a model's own tool-call syntax, which tool_choice "auto" reads the calls out of
(vLLM's ``--tool-call-parser``; same names, same formats):

- ``hermes`` (Hermes, Qwen2.5, Qwen3): content, then blocks
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number;
- ``llama3_json`` (Llama 3.1 / 3.2): the whole answer is ``{"name": ..., "parameters": {...}}``
  objects ("arguments" too), maybe after ``<|python_tag|>``, several separated by ``;``;
- ``mistral``: content, then ``[TOOL_CALLS]`` and a JSON array of
  ``{"name": ..., "arguments": {...}}``, or (newer tokenizers) ``[TOOL_CALLS]name{...}`` /
  ``[TOOL_CALLS]name[ARGS]{...}`` per call;
- ``pythonic`` (Llama 3.2 / Llama 4): the whole answer is a Python list of calls with keyword
  arguments, ``[get_weather(days=3), get_time(zone="UTC")]``.

Every format is an answer of content, then a region of calls from where the first call may
begin. Calls are read one at a time; the first thing in the region that is not a complete call
(bad JSON, a call cut off by max_tokens, text after the calls) ends it, and the answer from
there on is content too: a text that does not parse is never an error. A finished text is
parsed as a stream fed all of it at once, so streaming finds exactly the calls and content that
the whole text has, whatever the chunks.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kiln.serve.protocol import ToolCall
from kiln.serve.tools import new_call, new_call_id

_WHITESPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


@dataclass
class ParsedAnswer:
    content: str | None  # the text outside the calls; None when calls leave none (vLLM's)
    calls: list[ToolCall]


@dataclass
class ParsedDelta:
    """What a stream's text decided since its last update."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser(ABC):
    """One call syntax. Subclasses say where the calls begin and how to read one; parsing and
    streaming are shared, so they cannot disagree."""

    name: ClassVar[str]
    argument_keys: ClassVar[tuple[str, ...]] = ("arguments",)  # the first one present counts
    # Its marker is a special token of the model's tokenizer, which detokenizing must then
    # keep (vLLM's adjust_request turns skip_special_tokens off for it too)
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def calls_start(self, text: str, pos: int) -> tuple[int, bool]:
        """(i, True) when the calls begin at i (>= pos); else (i, False): ``text[pos:i]`` is
        content for sure, and ``text[i:]`` might still become the beginning of the calls."""

    @abstractmethod
    def next_call(self, text: str, pos: int, final: bool) -> tuple[ToolCall | None, int] | None:
        """The call that begins at ``pos`` in the calls region and where it ends; (None, i)
        when none does, ``text[i:]`` being content (i is ``len(text)`` when only separators
        are left); None when the text so far cannot tell (never when ``final``)."""

    def parse(self, text: str) -> ParsedAnswer:
        """The calls and content of a finished answer."""
        found = self.stream().update(text, final=True)
        return ParsedAnswer(found.content or None if found.calls else found.content, found.calls)

    def stream(self) -> CallStream:
        """A parser of one answer that grows (one per streamed choice)."""
        return CallStream(self)

    def new_id(self) -> str:
        return new_call_id()

    def call_of(self, item: Any) -> ToolCall | None:
        """The call a decoded JSON object ``{"name": ..., <an argument key>: {...}}``
        describes; None when it is not one."""
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        key = next((k for k in self.argument_keys if k in item), None)
        if key is None or not isinstance(item[key], dict):
            return None
        return new_call(item["name"], item[key], self.new_id())


class CallStream:
    """Reads one answer as its text grows: each update returns what became certain, content up
    to where a call may begin and the calls completed since; the rest waits for more text (or
    for ``final``, when whatever is not a complete call is content)."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._pos = 0  # the text before this is decided (and returned)
        self._in_calls = False  # past the start of the calls
        self._calls_from = 0  # where they start, once past it
        self._any_call = False
        self._in_rest = False  # past the calls: all content from here on

    def update(self, text: str, final: bool = False) -> ParsedDelta:
        """What ``text`` (the whole answer so far, which only grows) decides since the last
        update; ``final`` when the answer is complete."""
        delta = ParsedDelta()
        if not self._in_calls:
            start, self._in_calls = self._parser.calls_start(text, self._pos)
            end = len(text) if final and not self._in_calls else start
            delta.content, self._pos, self._calls_from = text[self._pos:end], end, end
        while self._in_calls and not self._in_rest:
            step = self._parser.next_call(text, self._pos, final)
            if step is None:
                return delta
            call, self._pos = step
            if call is None:
                self._in_rest = True
                if not self._any_call:  # a marker, or brackets, with no call: all content
                    self._pos = self._calls_from
            else:
                delta.calls.append(call)
                self._any_call = True
        if self._in_rest:
            delta.content += text[self._pos:]
            self._pos = len(text)
        return delta


def _find_marker(text: str, pos: int, marker: str) -> tuple[int, bool]:
    """``calls_start`` for calls that begin with ``marker`` anywhere: its first position, else
    where a suffix that could be its beginning starts (held back until it is decided)."""
    i = text.find(marker, pos)
    if i >= 0:
        return i, True
    for num_chars in range(min(len(marker) - 1, len(text) - pos), 0, -1):
        if text.endswith(marker[:num_chars]):
            return len(text) - num_chars, False
    return len(text), False


def _may_become(text: str, i: int, markers: tuple[str, ...]) -> bool:
    """Whether ``text[i:]`` is not empty and could still grow into one of ``markers``."""
    tail = text[i:]
    return bool(tail) and any(len(m) > len(tail) and m.startswith(tail) for m in markers)


def _opens_the_answer(text: str, pos: int, openers: tuple[str, ...]) -> tuple[int, bool]:
    """``calls_start`` for calls that are the whole answer, opening it (after whitespace) with
    one of ``openers``: undecided while the answer so far could still open so."""
    if pos > 0:  # content was decided: only an answer that opens with a call has calls
        return len(text), False
    i = _WHITESPACE.match(text).end()
    if text.startswith(openers, i):
        return 0, True
    if i == len(text) or _may_become(text, i, openers):
        return 0, False
    return len(text), False


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def calls_start(self, text: str, pos: int) -> tuple[int, bool]:
        return _find_marker(text, pos, self.START)

    def next_call(self, text: str, pos: int, final: bool) -> tuple[ToolCall | None, int] | None:
        i = _WHITESPACE.match(text, pos).end()
        if not text.startswith(self.START, i):
            if not final and (i == len(text) or _may_become(text, i, (self.START,))):
                return None
            return None, len(text) if i == len(text) else pos
        body = i + len(self.START)
        end = text.find(self.END, body)
        if end < 0 and not final:
            return None
        # (vLLM reads an unclosed last block too: a stop string may have ended the answer)
        try:
            call = self.call_of(json.loads(text[body:] if end < 0 else text[body:end]))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return None, pos
        return call, len(text) if end < 0 else end + len(self.END)


class _SequenceParser(ToolParser):
    """Calls one after another, between ``separators`` and whitespace, each read by
    ``read_call``."""

    separators: ClassVar[tuple[str, ...]]

    @abstractmethod
    def read_call(self, text: str, i: int, final: bool) -> tuple[ToolCall | None, int] | None:
        """The call written from ``i`` and where it ends; (None, i) when none is; None when the
        text so far cannot tell (never when ``final``)."""

    def next_call(self, text: str, pos: int, final: bool) -> tuple[ToolCall | None, int] | None:
        i = pos
        while True:
            i = _WHITESPACE.match(text, i).end()
            if not final and _may_become(text, i, self.separators):
                return None
            separator = next((s for s in self.separators if text.startswith(s, i)), None)
            if separator is None:
                break
            i += len(separator)
        if i == len(text):
            return (None, len(text)) if final else None
        read = self.read_call(text, i, final)
        if read is None:
            return None
        call, end = read
        return (None, pos) if call is None else (call, end)


class _JsonSequenceParser(_SequenceParser):
    """Calls as JSON objects ``{"name": ..., <an argument key>: {...}}``."""

    def read_call(self, text: str, i: int, final: bool) -> tuple[ToolCall | None, int] | None:
        if text[i] != "{":
            return None, i
        try:
            item, end = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:  # not valid JSON, or not all of it yet
            return (None, i) if final else None
        return self.call_of(item), end


class Llama3JsonParser(_JsonSequenceParser):
    name = "llama3_json"
    argument_keys = ("arguments", "parameters")
    PYTHON_TAG = "<|python_tag|>"
    separators = (PYTHON_TAG, ";")

    def calls_start(self, text: str, pos: int) -> tuple[int, bool]:
        return _opens_the_answer(text, pos, ("{", self.PYTHON_TAG))


class MistralParser(_JsonSequenceParser):
    """Mistral's three generations of the syntax: ``[TOOL_CALLS][{"name": ..., "arguments":
    {...}}, ...]`` (tokenizers before v11), ``[TOOL_CALLS]name{...}`` per call (v11) and
    ``[TOOL_CALLS]name[ARGS]{...}`` (v13)."""

    name = "mistral"
    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
    separators = (MARKER, "[", ",", "]")  # (the marker first: it begins with "[")
    keeps_special_tokens = True

    def calls_start(self, text: str, pos: int) -> tuple[int, bool]:
        return _find_marker(text, pos, self.MARKER)

    def read_call(self, text: str, i: int, final: bool) -> tuple[ToolCall | None, int] | None:
        if text[i] == "{":  # an object with its name inside
            return super().read_call(text, i, final)
        named = _FUNCTION_NAME.match(text, i)
        if named is None:
            return None, i
        j = named.end()
        if j < len(text) and text.startswith(self.ARGS, j):
            j += len(self.ARGS)
        elif j == len(text) or _may_become(text, j, (self.ARGS,)):
            return (None, i) if final else None  # the name, or [ARGS], is still coming
        if j == len(text) or text[j] != "{":
            return (None, i) if final or j < len(text) else None
        try:
            arguments, end = _DECODER.raw_decode(text, j)
        except json.JSONDecodeError:
            return (None, i) if final else None
        if not isinstance(arguments, dict):
            return None, i
        return new_call(named.group(), arguments, self.new_id()), end

    def new_id(self) -> str:
        # Mistral's templates refuse other ids when the call comes back in the history
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def _call_end(text: str, i: int) -> int:
    """Where the call whose argument list opens before ``i`` ends (past its ")"), skipping
    brackets and quoted strings; -1 when the text ends first."""
    depth, quote = 1, None
    while i < len(text):
        c = text[i]
        if quote is not None:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


class PythonicParser(_SequenceParser):
    """Llama 3.2 / Llama 4's (and ToolACE's) Python list of calls with keyword arguments, the
    whole answer: ``[get_weather(days=3, unit="celsius"), get_time(zone="UTC")]``. The values
    are Python literals (True / None included), read with ast.literal_eval, never evaluated."""

    name = "pythonic"
    separators = ("[", ",", "]")

    def calls_start(self, text: str, pos: int) -> tuple[int, bool]:
        return _opens_the_answer(text, pos, ("[",))

    def read_call(self, text: str, i: int, final: bool) -> tuple[ToolCall | None, int] | None:
        opened = _CALL_OPEN.match(text, i)
        if opened is None:  # (a name still being written may yet open its arguments)
            return None if not final and _NAME.fullmatch(text, i) else (None, i)
        end = _call_end(text, opened.end())
        if end < 0:
            return (None, i) if final else None
        try:
            node = ast.parse(text[i:end], mode="eval").body
            if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name)
                    or node.args or any(kw.arg is None for kw in node.keywords)):
                return None, i
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except (SyntaxError, ValueError):  # not Python, or a value that is not a literal
            return None, i
        return new_call(node.func.id, arguments, self.new_id()), end


_NAME = re.compile(r"[A-Za-z_]\w*")
_FUNCTION_NAME = re.compile(r"[A-Za-z_][\w.-]*")  # (OpenAI's function names take - too)
_CALL_OPEN = re.compile(r"[A-Za-z_]\w*\(")

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)}


def tool_parser_named(name: str) -> ToolParser:
    """The parser called ``name``; ValueError listing the names otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; Kiln has "
                         f"{', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()

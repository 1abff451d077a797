"""Function calling in chat as vLLM does it: a forced call is generated under structured
outputs, so its JSON needs no parsing out of free text; under "auto" the model answers freely and
a parser of its own call syntax (kiln.serve.tool_parsers) finds the calls.

``tool_choice`` {"type": "function", "function": {"name": N}} constrains the answer to tool N's
``parameters`` schema, and the answer is that call's arguments. ``"required"`` constrains it to
a JSON array of one or more ``{"name": ..., "parameters": ...}`` objects, one per call (an
anyOf over the tools, as vLLM builds it). ``"none"`` leaves the answer free. ``"auto"``, where
the model decides, leaves it free too (a request's own structured outputs still apply), and the
server's tool-call parser reads the calls it holds, if any: a server started without
--enable-auto-tool-choice --tool-call-parser NAME has none and refuses "auto", as vLLM does.
The tools reach the chat template in every case, so that a template that describes them does.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.sampling.params import StructuredOutputsParams
from kiln.serve.errors import APIError
from kiln.serve.generation import check_text
from kiln.serve.protocol import ChatCompletionRequest, ChatMessage, FunctionCall, Tool, ToolCall
from kiln.serve.structured import StructuredRequest

if TYPE_CHECKING:  # (tool_parsers builds its calls with this module's helpers)
    from kiln.serve.tool_parsers import CallStream, ToolParser

# a tool without parameters is called with an empty object, as OpenAI's tools are
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_NAMED_SHAPE = '{"type": "function", "function": {"name": ...}}'
_DECODER = json.JSONDecoder()


@dataclass
class ToolRequest:
    tools: list[dict[str, Any]] | None  # for the chat template; None when the request has none
    function: str | None = None  # the named tool_choice's function; None with "required"
    structured: StructuredRequest | None = None  # the constraint either one needs
    parser: ToolParser | None = None  # "auto": finds the calls in the free answer

    @property
    def forced(self) -> bool:
        """Whether the answer is tool calls rather than content."""
        return self.structured is not None

    @property
    def may_call(self) -> bool:
        """Whether the answer may hold tool calls: forced ones, or ones the parser finds."""
        return self.forced or self.parser is not None


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template gets them (None for none); 400 for a nameless tool or
    two of one name."""
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools or []):
        name = check_text(tool.function.name, f"tools.{i}.function.name")
        if not name:
            raise APIError(400, f"tools.{i}.function.name is empty; give the function a name",
                           param=f"tools.{i}.function.name")
        if name in seen:
            raise APIError(400, f"tools.{i}.function.name {name!r} is also tools.{seen[name]}'s; "
                                f"tool names must be unique", param=f"tools.{i}.function.name")
        seen[name] = i
    return [tool.model_dump(exclude_none=True) for tool in tools or []] or None


def _structured(schema: dict[str, Any], param: str) -> StructuredRequest:
    try:
        return StructuredRequest(StructuredOutputsParams(json=schema), param)
    except ValueError as exc:  # a schema that is not JSON (compiling comes later, in the engine)
        raise APIError(400, f"{param} is not a usable JSON schema: {exc}", param=param) from None


def _required_schema(tools: list[Tool]) -> dict[str, Any]:
    """A JSON array of 1+ calls, each one tool's name with arguments that follow its schema.

    Each tool's ``$defs`` move to the root, where its ``#/$defs/...`` references now point."""
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        parameters = dict(tool.function.parameters or _NO_PARAMETERS)
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise APIError(400, f"tools.{i}.function.parameters.$defs.{name} differs from "
                                    f"another tool's $defs.{name}; with tool_choice \"required\""
                                    f" the tools share one $defs, so rename one of them",
                               param=f"tools.{i}.function.parameters")
        calls.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    return {**schema, "$defs": defs} if defs else schema


def _named_function(choice: Any, tools: list[Tool]) -> tuple[str, int]:
    """The named choice's function and its index in ``tools``; 400 for any other choice."""
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or choice.get("type") != "function":
        got = json.dumps(choice) if isinstance(choice, dict) else repr(choice)
        raise APIError(400, f"tool_choice must be \"none\", \"auto\", \"required\" or "
                            f"{_NAMED_SHAPE}; got {got}", param="tool_choice")
    index = next((i for i, tool in enumerate(tools) if tool.function.name == name), None)
    if index is None:
        known = ", ".join(repr(tool.function.name) for tool in tools) or "none"
        raise APIError(400, f"tool_choice names function {name!r}, which is not among tools "
                            f"(they hold {known})", param="tool_choice")
    return name, index


def tool_request_of(body: ChatCompletionRequest, parser: ToolParser | None = None
                    ) -> ToolRequest:
    """The request's tools and what its tool_choice asks; 400 naming the field otherwise.
    ``parser`` reads the calls of "auto" answers (None: the server refuses "auto")."""
    sent = body.model_extra or {}
    if sent.get("functions") not in (None, []):
        raise APIError(400, "functions (deprecated by OpenAI) is not supported; send them as "
                            "tools, with tool_choice", param="functions")
    if sent.get("function_call") not in (None, "none", "auto"):
        raise APIError(400, "function_call (deprecated by OpenAI) is not supported; use "
                            "tool_choice with tools", param="function_call")
    rendered = template_tools(body.tools)
    tools = body.tools or []
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"  # OpenAI's default
    if choice == "none" or (choice == "auto" and not tools):
        return ToolRequest(rendered)  # (a plain answer meets "auto" when there are no tools)
    if choice == "auto":
        if parser is not None:
            return ToolRequest(rendered, parser=parser)
        raise APIError(400, "tool_choice \"auto\" (the default when tools are given) needs a "
                            "parser for this model's own tool-call syntax, which this server "
                            "was not started with (restart it with --enable-auto-tool-choice "
                            "--tool-call-parser NAME); or set tool_choice to \"required\", to a "
                            f"named function {_NAMED_SHAPE}, or to \"none\"", param="tool_choice")
    if not tools:
        raise APIError(400, "tool_choice asks for a tool call, but the request has no tools; "
                            "send tools, or drop tool_choice", param="tool_choice")
    if choice == "required":
        return ToolRequest(rendered, structured=_structured(_required_schema(tools), "tools"))
    name, index = _named_function(choice, tools)
    param = f"tools.{index}.function.parameters"
    return ToolRequest(rendered, function=name,
                       structured=_structured(tools[index].function.parameters or _NO_PARAMETERS,
                                              param))


def history_fields(message: ChatMessage, index: int) -> dict[str, Any]:
    """A history message's tool fields, as chat templates read them: an assistant turn's calls
    with their arguments as objects (JSON text in the API; templates expect dicts, as vLLM
    hands them), a tool turn's ``tool_call_id``."""
    fields: dict[str, Any] = {}
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for j, call in enumerate(message.tool_calls):
            param = f"messages.{index}.tool_calls.{j}.function.arguments"
            try:
                arguments = json.loads(check_text(call.function.arguments, param))
            except json.JSONDecodeError as exc:
                raise APIError(400, f"{param} is not JSON text: {exc}", param=param) from None
            calls.append({"id": call.id, "type": call.type,
                          "function": {"name": call.function.name, "arguments": arguments}})
        fields["tool_calls"] = calls
    return fields


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's random tool-call id


def new_call(name: str, arguments: Any, call_id: str | None = None) -> ToolCall:
    """A call of ``name`` with these arguments as JSON text (as vLLM dumps them), under a new
    id unless ``call_id`` is given."""
    return ToolCall(id=call_id or new_call_id(), function=FunctionCall(
        name=name, arguments=json.dumps(arguments, ensure_ascii=False)))


def complete_calls(text: str, start: int = 0) -> tuple[list[ToolCall], int]:
    """The calls of a "required" answer that are complete in ``text`` from ``start``, and where
    the next one begins. The grammar shapes the answer, ``[{"name": ..., "parameters": ...},
    ...]`` with any whitespace, so each ``{`` past the brackets, commas and whitespace opens a
    call, which parses once its closing brace has arrived (a cut-off answer ends before it)."""
    calls = []
    while True:
        while start < len(text) and text[start] in " \t\n\r[,":
            start += 1
        if not text.startswith("{", start):
            return calls, start
        try:
            item, start = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            return calls, start
        calls.append(new_call(item["name"], item["parameters"]))


def answer_calls(request: ToolRequest, text: str) -> list[ToolCall]:
    """A forced answer's calls: the named function's with the text as its arguments (cut off
    as the text is, when max_tokens ends it early, as in vLLM), or each complete call of a
    "required" answer."""
    if request.function is not None:
        return [ToolCall(id=new_call_id(), function=FunctionCall(name=request.function,
                                                                 arguments=text))]
    return complete_calls(text)[0]


class ToolCallDeltas:
    """The deltas of a streamed answer that may hold calls, choice by choice, in vLLM's shape:
    a call's first delta carries its ``index``, ``id``, ``type`` and ``function.name``, later
    ones ``function.arguments`` fragments. A named call opens with the first output and its
    arguments stream as the text does; a "required" call, and a call the "auto" parser finds,
    is sent whole once complete (vLLM sends its arguments in fragments too, by parsing the
    partial JSON). Under "auto" the content streams too, up to where a call may begin."""

    def __init__(self, request: ToolRequest) -> None:
        self._request = request
        self._num_calls: dict[int, int] = {}  # choice index -> calls opened
        self._scanned: dict[int, int] = {}  # choice index -> where its next call begins
        self._streams: dict[int, CallStream] = {}  # choice index -> its "auto" parse

    def delta(self, choice: int, text: str, num_chars: int, finished: bool = False
              ) -> dict[str, Any]:
        """The delta for ``text`` of which ``num_chars`` characters were sent before
        (``finished``: the choice's last)."""
        new = text[num_chars:]
        if self._request.function is not None:
            if choice in self._num_calls:
                return {"tool_calls": [{"index": 0, "function": {"arguments": new}}]} if new else {}
            self._num_calls[choice] = 1
            return {"tool_calls": [{"index": 0, "id": new_call_id(), "type": "function",
                                    "function": {"name": self._request.function,
                                                 "arguments": new}}]}
        if self._request.parser is not None:
            if choice not in self._streams:
                self._streams[choice] = self._request.parser.stream()
            found = self._streams[choice].update(text, final=finished)
            content = {"content": found.content} if found.content else {}
            return {**content, **self._whole_calls(choice, found.calls)}
        calls, self._scanned[choice] = complete_calls(text, self._scanned.get(choice, 0))
        return self._whole_calls(choice, calls)

    def _whole_calls(self, choice: int, calls: list[ToolCall]) -> dict[str, Any]:
        first = self._num_calls.setdefault(choice, 0)
        self._num_calls[choice] += len(calls)
        return {"tool_calls": [{"index": first + k, **call.model_dump()}
                               for k, call in enumerate(calls)]} if calls else {}

    def called(self, choice: int) -> bool:
        """Whether the choice has sent a call (its finish_reason is then "tool_calls")."""
        return self._num_calls.get(choice, 0) > 0

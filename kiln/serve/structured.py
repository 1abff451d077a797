"""Structured outputs asked of the API, in any of the ways vLLM takes them, as one
StructuredOutputsParams: OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM
v1's ``structured_outputs``, and vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. A request uses one of them at most; a bad value, or a
grammar that does not compile, is a 400 naming the field that gave it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from kiln.engine.async_engine import AsyncEngine
from kiln.sampling.params import StructuredOutputsParams
from kiln.serve.errors import APIError, bad_request

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_KEYS = tuple(f.name for f in fields(StructuredOutputsParams))
_OWNER = re.compile(r"^StructuredOutputsParams(?:\.(\w+))?")


@dataclass
class StructuredRequest:
    params: StructuredOutputsParams
    param: str  # the request field that holds the constraint, named in errors


def _param(field: str, kind: str) -> str:
    """The request field of constraint ``kind`` asked through ``field``."""
    return f"{field}.{kind}" if field == "structured_outputs" else field


def _asked(body: Any) -> list[tuple[str, dict[str, Any]]]:
    """(request field, StructuredOutputsParams' arguments) for each way the request asks."""
    asked = [(field, {kind: getattr(body, field)}) for field, kind in _GUIDED.items()
             if getattr(body, field) is not None]
    if body.structured_outputs is not None:
        asked.append(("structured_outputs", body.structured_outputs))
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return asked
    if response_format.type == "json_object":
        return [*asked, ("response_format", {"json_object": True})]
    schema = response_format.json_schema and response_format.json_schema.schema_
    if schema is None:
        raise APIError(400, "response_format of type json_schema needs json_schema.schema: the "
                            "JSON schema the answer follows",
                       param="response_format.json_schema.schema")
    return [*asked, ("response_format.json_schema.schema", {"json": schema})]


def structured_outputs_of(body: Any) -> StructuredRequest | None:
    """The request's structured outputs, None when it asks for none; 400 naming the field for
    a bad value, an unknown key of structured_outputs, or two ways at once."""
    asked = _asked(body)
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(400, f"{' and '.join(f for f, _ in asked)} each ask for structured "
                            f"outputs; send one of them", param=asked[1][0])
    (field, arguments), = asked
    unknown = sorted(set(arguments) - set(_KEYS))
    if unknown:
        raise APIError(400, f"{field} has no field {unknown[0]!r}; Kiln takes "
                            f"{', '.join(_KEYS)}", param=field)
    try:
        params = StructuredOutputsParams(**arguments)
    except ValueError as exc:  # "StructuredOutputsParams.regex must be ..." -> "guided_regex
        # must be ...", "StructuredOutputsParams takes ..." -> "structured_outputs takes ..."
        message = str(exc)
        match = _OWNER.match(message)
        param = _param(field, match.group(1)) if match.group(1) else field
        raise APIError(400, param + message[match.end():], param=param) from None
    return StructuredRequest(params, _param(field, params.kind))


async def compile_grammar(engine: AsyncEngine, requested: StructuredRequest | None) -> None:
    """Compile the request's grammar into the engine's cache on a worker thread, where the
    engine then finds it: a large schema takes a while, which on the event loop would hold up
    every other request. 400 naming the field when it does not compile."""
    if requested is None:
        return
    try:
        await engine.compile_grammar(requested.params)
    except ValueError as exc:  # "SamplingParams.structured_outputs: ..." -> "guided_json: ..."
        raise bad_request(exc, {"structured_outputs": requested.param}) from None

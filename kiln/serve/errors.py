"""Every error leaves the server in OpenAI's shape: ``{"error": {message, type, param, code}}``.

Handlers turn FastAPI's validation errors (422 by default; OpenAI says 400), Starlette's
404/405 and anything unexpected into that shape, so clients' error parsing always works.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kiln.engine.async_engine import EngineDeadError

log = logging.getLogger("kiln.serve")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          429: "requests", 500: "server_error", 503: "server_error"}
_CODES = {401: "invalid_api_key", 429: "rate_limit_exceeded", 503: "service_unavailable"}
_SAMPLING_FIELD = re.compile(r"^SamplingParams\.(\w+)\b")


class APIError(Exception):
    """An error the client caused or must know about; ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or _CODES.get(status)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code if code is not None else _CODES.get(status)}}


class ErrorJSONResponse(JSONResponse):
    """ASCII-escaped: a message quoting user input may hold lone surrogates, which UTF-8 cannot
    encode but a JSON escape can."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return ErrorJSONResponse(error_body(err.status, err.message, err.param, err.code),
                        status_code=err.status, headers=headers)


def bad_request(exc: Exception, request_fields: Mapping[str, str] | None = None) -> APIError:
    """A ValueError/TypeError from validation -> 400, naming the field when the text does.

    ``request_fields`` maps SamplingParams fields to the request fields that set them where
    the names differ (chat's top_logprobs sets logprobs), so the client hears its own name.
    """
    message = str(exc)
    match = _SAMPLING_FIELD.match(message)
    param = None
    if match:  # "SamplingParams.top_p must be ..." -> "top_p must be ...", param top_p
        param = (request_fields or {}).get(match.group(1), match.group(1))
        message = param + message[match.end():]
    return APIError(400, message, param=param)


_JSON_KINDS: dict[type, str] = {list: "an array", str: "a string", bool: "a boolean",
                                 int: "a number", float: "a number", type(None): "null"}


def _body_problem(error: dict[str, Any], body: Any) -> str | None:
    """The message for a validation error about the body as a whole, or None for a field's.

    FastAPI reports these in its own terms ("JSON decode error" at a character offset, "Field
    required" for an empty body); clients need to hear what to send instead.
    """
    kind, loc = error.get("type"), tuple(error.get("loc", ()))
    if kind == "json_invalid":  # loc is ("body", offset) and body the decoded text
        decoded = json.JSONDecodeError(error.get("ctx", {}).get("error", "invalid JSON"),
                                       body if isinstance(body, str) else "", loc[-1])
        return (f"request body is not valid JSON: {decoded.msg} "
                f"(line {decoded.lineno} column {decoded.colno})")
    if loc != ("body",):
        return None
    if kind == "missing":
        return "request body is empty: send a JSON object"
    value = error.get("input")
    if isinstance(value, bytes):  # FastAPI parses JSON only under a JSON content type
        return ("request body must be a JSON object, sent with 'Content-Type: "
                "application/json'")
    sent = _JSON_KINDS.get(type(value), type(value).__name__)
    return f"request body must be a JSON object, not {sent}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return error_response(exc, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        message = _body_problem(first, exc.body)
        if message is not None:
            return error_response(APIError(400, message))
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        detail = first.get("msg", "invalid request")
        message = f"{param}: {detail}" if param else detail
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problems)"
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, ClientDisconnect):  # FastAPI's 400 for an unread body:
            # the client left while sending it, so it is not a bad request (499, as nginx logs)
            return error_response(APIError(499, "client closed the request"))
        code = "not_found" if exc.status_code == 404 else None
        return error_response(APIError(exc.status_code, str(exc.detail), code=code),
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        # A failed step or a shutdown ended the request: say why, as a stream's error event
        # does (the engine has logged the traceback already).
        return error_response(APIError(503, str(exc)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"))

"""The FastAPI app: ``create_app(engine, ...)`` wires state, gate, error handlers and routes.

The socket opens before the model loads: given an ``engine_factory`` instead of an engine, the
app builds the engine on a background thread after start-up and answers 503 (``/health``
included) until it is ready, so orchestrators see a live but not yet ready server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kiln
from kiln.engine.async_engine import AsyncEngine
from kiln.serve.auth import KeyChecker
from kiln.serve.chat import chat_prompt_ids, create_chat_completion
from kiln.serve.completions import create_completion
from kiln.serve.errors import APIError, ErrorJSONResponse, error_body, install_error_handlers
from kiln.serve.generation import check_text
from kiln.serve.metrics import CONTENT_TYPE
from kiln.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from kiln.serve.state import ServerState
from kiln.serve.streaming import sse
from kiln.serve.tool_parsers import tool_parser_named
from kiln.serve.tools import template_tools

log = logging.getLogger("kiln.serve")

# Open without a key, so probes and scrapers need no secret: /health /version /metrics /docs
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
ROUTES = ("/health", "/version", "/metrics", "/v1/models", "/v1/completions",
          "/v1/chat/completions", "/tokenize", "/detokenize")
MODEL_ROUTE = "/v1/models/{model}"  # one label for every model id
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 429, 503)}


def _endpoint_label(path: str) -> str:
    """The metrics label of a path: a route's, or "other" (label values must stay few)."""
    if path in ROUTES:
        return path
    return MODEL_ROUTE if path.startswith("/v1/models/") else "other"


class _Gate:
    """Pure ASGI (streams pass straight through): API keys first, then a count per status."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        status = 500  # if the app dies before starting a response, that is what the client sees
        started = ended = event_stream = False

        async def send_and_record(message: Message) -> None:
            nonlocal status, started, ended, event_stream
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                event_stream = any(k == b"content-type" and v.startswith(b"text/event-stream")
                                   for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True
            await send(message)

        try:
            if path.startswith(PROTECTED_PREFIXES) and not self._authorized(scope):
                response = ErrorJSONResponse(
                    error_body(401, "missing or invalid API key; send 'Authorization: Bearer "
                                    "<key>'"), status_code=401,
                    headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send_and_record)
            else:
                await self.app(scope, receive, send_and_record)
        except asyncio.CancelledError:
            if not self.state.draining:
                raise
            # uvicorn cancels what outlives the shutdown grace period; one line, no traceback
            log.warning("%s cut off: the shutdown grace period ran out", path)
            # Tell the client why, in OpenAI's shape, rather than leave uvicorn to answer a bare
            # 500 or cut a stream mid-body (the engine requests are aborted already).
            error = error_body(503, "the server shut down before this request finished")
            with contextlib.suppress(Exception):  # the client may be gone too
                if not started:
                    await ErrorJSONResponse(error, status_code=503)(scope, receive,
                                                                    send_and_record)
                elif event_stream and not ended:
                    await send_and_record({"type": "http.response.body",
                                           "body": sse(error).encode(), "more_body": False})
        finally:
            self.state.metrics.http_requests.labels(_endpoint_label(path), str(status)).inc()

    def _authorized(self, scope: Scope) -> bool:
        if not self.state.keys.enabled:
            return True
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return self.state.keys.check(header.decode("latin-1"))


def _start_loading(state: ServerState, factory: Callable[[], AsyncEngine],
                   on_error: Callable[[BaseException], None] | None) -> None:
    """Build the engine on a daemon thread (a stuck load must not block exit)."""

    def load() -> None:
        try:
            state.engine = factory()
            log.info("engine ready; serving %s", ", ".join(state.served_model_names))
        except BaseException as exc:  # noqa: BLE001 - reported through /health and on_error
            state.startup_error = f"{type(exc).__name__}: {exc}"
            log.error("the engine failed to start: %s", state.startup_error)
            if on_error is not None:
                on_error(exc)

    state.loader = threading.Thread(target=load, name="kiln-engine-load", daemon=True)
    state.loader.start()


def create_app(engine: AsyncEngine | None = None,
               served_model_name: str | Sequence[str] = "kiln",
               api_keys: Sequence[str] = (),
               max_waiting: int | None = None,
               *,
               engine_factory: Callable[[], AsyncEngine] | None = None,
               model_path: str | None = None,
               chat_template: str | None = None,
               tool_call_parser: str | None = None,
               on_startup_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    """An OpenAI-compatible app around ``engine`` (or one ``engine_factory`` builds at start-up).

    ``max_waiting`` bounds the engine's waiting queue (429 beyond it); None uses the engine's
    ``max_waiting_requests``. ``tool_call_parser`` names the parser of the model's tool-call
    syntax that tool_choice "auto" needs (vLLM's --tool-call-parser; None refuses "auto"). An
    engine built by the factory is shut down with the app; one passed in belongs to the caller.
    """
    if (engine is None) == (engine_factory is None):
        raise ValueError("pass exactly one of engine and engine_factory")
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    tool_parser = tool_parser_named(tool_call_parser) if tool_call_parser is not None else None
    state = ServerState(served_model_names=names, keys=KeyChecker(api_keys),
                        max_waiting=max_waiting, model_path=model_path,
                        chat_template=chat_template, engine=engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine_factory is not None:
            _start_loading(state, engine_factory, on_startup_error)
        try:
            yield
        finally:
            state.draining = True
            if engine_factory is not None and state.engine is not None:
                await asyncio.to_thread(state.engine.shutdown)  # aborts what is left

    app = FastAPI(title="Kiln", version=kiln.__version__, lifespan=lifespan)
    app.state.kiln = state
    install_error_handlers(app)
    app.add_middleware(_Gate, state=state)

    @app.get("/health")
    async def health() -> Response:
        state.ready_engine()  # 503 while loading, after a failed load, or while draining
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kiln.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    def model_card(name: str) -> ModelCard:
        max_len = state.engine.max_model_len if state.engine is not None else None
        return ModelCard(id=name, created=state.created, root=state.model_path,
                         max_model_len=max_len)

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models() -> ModelList:
        return ModelList(data=[model_card(n) for n in state.served_model_names])

    # :path, as served names may hold slashes (hub ids, directories); clients send them as %2F
    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=ERRORS)
    async def retrieve_model(model: str) -> ModelCard:
        state.check_model(model)
        return model_card(model)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await create_completion(state, body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await create_chat_completion(state, body, request, tool_parser)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        engine = state.ready_engine()
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            ids = chat_prompt_ids(state, body.messages, body.add_generation_prompt,
                                  body.chat_template_kwargs, template_tools(body.tools))
        else:
            if engine.tokenizer is None:
                raise APIError(400, "this model has no tokenizer", param="prompt")
            ids = list(engine.tokenizer.encode(check_text(body.prompt or "", "prompt"),
                                               add_special_tokens=body.add_special_tokens))
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_model_len)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        engine = state.ready_engine()
        state.check_model(body.model)
        vocab_size = engine.engine.loaded.arch.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab_size})",
                           param="tokens")
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))

    return app

"""What every handler needs: the engine (once loaded), names, keys, limits, metrics.

One ``ServerState`` per app, stored on ``app.state.kiln``; nothing lives in module globals.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kiln.engine.async_engine import AsyncEngine
from kiln.serve.auth import KeyChecker
from kiln.serve.errors import APIError
from kiln.serve.metrics import ServerMetrics

# Logprobs of -inf (a token the model rules out) are not valid JSON; OpenAI and vLLM send this.
MIN_LOGPROB = -9999.0


@dataclass
class ServerState:
    served_model_names: list[str]
    keys: KeyChecker
    max_waiting: int | None = None  # None: the engine's --max-waiting-requests, if any
    model_path: str | None = None
    chat_template: str | None = None
    engine: AsyncEngine | None = None
    startup_error: str | None = None
    loader: threading.Thread | None = None  # the thread building the engine (engine_factory)
    draining: bool = False
    # the model cards' "created": fixed, so every listing and lookup returns the same object
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServerMetrics = field(init=False)
    _token_text: dict[int, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        self.metrics = ServerMetrics(self.served_model_names[0], lambda: self.engine)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def ready_engine(self) -> AsyncEngine:
        """The engine, or 503 while it loads, after it failed to load, or while shutting down."""
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if self.engine is None:
            detail = (f"the model failed to load: {self.startup_error}" if self.startup_error
                      else "the model is still loading; retry when GET /health answers 200")
            raise APIError(503, detail)
        return self.engine

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_model_names:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.served_model_names)}",
                           param="model", code="model_not_found")

    def check_queue(self, engine: AsyncEngine) -> None:
        """429 once the waiting queue holds the configured bound (a request would only wait)."""
        bound = self.max_waiting
        if bound is None:
            bound = engine.engine.config.scheduler.max_waiting_requests
        if bound is not None and engine.num_waiting() >= bound:
            raise APIError(429, f"the server is at capacity: {engine.num_waiting()} requests "
                                f"are waiting (bound {bound}); retry later")

    def token_text(self, tokenizer: Any, token_id: int) -> str:
        """One token's text for logprobs (cached: the vocabulary is finite)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = (tokenizer.decode([token_id], skip_special_tokens=False)
                    if tokenizer is not None else f"<{token_id}>")
            self._token_text[token_id] = text
        return text


def finite_logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # also maps NaN (all compares False)

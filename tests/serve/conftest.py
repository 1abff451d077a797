"""Real uvicorn servers on 127.0.0.1 (ports picked by the OS) around real engines on CPU."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import uvicorn

import kiln
from kiln.engine.async_engine import AsyncEngine
from kiln.serve.app import create_app

MODEL = "tiny"
NUM_KV_BLOCKS = 256
LONG_CONTEXT = 16384  # tokens: at ~1 ms per decode step, a 16k request outlasts any test step


class ServerThread:
    """uvicorn on a socket bound to port 0, run on a daemon thread (no signal handlers there)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)

    @property
    def state(self) -> Any:
        return self.app.state.kiln

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@contextmanager
def kiln_tiny_server(device: str = "cpu", **app_options: Any
                     ) -> Iterator[tuple[ServerThread, AsyncEngine]]:
    """A server around kiln-tiny (its trained tokenizer: grammars and templates behave as with a
    real model) in float32 on ``device``, and its engine; ``app_options`` go to create_app."""
    engine = AsyncEngine.from_kwargs("kiln-tiny", dtype="float32", device=device,
                                     num_kv_blocks=128)
    with ServerThread(create_app(engine, served_model_name=MODEL, **app_options)) as srv:
        yield srv, engine
    engine.shutdown()


def openai_client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


# The modules serving kiln-tiny define `tiny_server` (kiln_tiny_server with their app options)
@pytest.fixture(scope="module")
def tiny_client(tiny_server: tuple[ServerThread, AsyncEngine]) -> openai.OpenAI:
    return openai_client(tiny_server[0])


@pytest.fixture(scope="module")
def tiny_engine(tiny_server: tuple[ServerThread, AsyncEngine]) -> AsyncEngine:
    return tiny_server[1]


def wait_until(predicate: Any, timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread() -> Iterator[None]:
    # Server, engine and client threads share two cores here; torch's intra-op pool would
    # make every tiny matmul wait on a busy sibling thread (tens of ms per op).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def engine(tiny_llama) -> Iterator[AsyncEngine]:
    eng = AsyncEngine.from_kwargs(str(tiny_llama), dtype="float32", device="cpu",
                                  num_kv_blocks=NUM_KV_BLOCKS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="package")
def long_context_llama(tiny_llama, tmp_path_factory) -> Path:
    """tiny_llama with a 16k context, for requests that must outlast a test's actions."""
    path = tmp_path_factory.mktemp("long-context") / "llama"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def long_server(long_context_llama) -> Iterator[ServerThread]:
    """A server of its own (per test module) over the 16k-context model, with KV for two
    full-length requests."""
    engine = AsyncEngine.from_kwargs(str(long_context_llama), dtype="float32", device="cpu",
                                     num_kv_blocks=2 * LONG_CONTEXT // 16)
    with ServerThread(create_app(engine, served_model_name=MODEL)) as srv:
        yield srv
    engine.shutdown()


@pytest.fixture(scope="package")
def server(engine) -> Iterator[ServerThread]:
    with ServerThread(create_app(engine, served_model_name=MODEL)) as srv:
        yield srv


@pytest.fixture(scope="package")
def reference_llm(tiny_llama) -> kiln.LLM:
    """The offline API on the same checkpoint: what the server's answers must equal."""
    return kiln.LLM(str(tiny_llama), dtype="float32", device="cpu", num_kv_blocks=64)


def assert_idle(engine: AsyncEngine, timeout: float = 1.0) -> None:
    """No request left anywhere and every KV block back in the pool (cached blocks count)."""
    inner = engine.engine

    def idle() -> bool:
        return (not inner.has_unfinished_requests() and not inner.requests
                and inner.kv.num_free_blocks == inner.kv_cache.num_blocks)

    assert wait_until(idle, timeout), (
        f"not idle after {timeout}s: {len(inner.requests)} requests, "
        f"{inner.kv.num_free_blocks}/{inner.kv_cache.num_blocks} blocks free")


def assert_openai_error(response: Any, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert set(error) == {"message", "type", "param", "code"}, error
    return error

"""``kiln serve`` as a real process: start-up, API keys from the environment, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from kiln.cli import main

from .conftest import LONG_CONTEXT, wait_until

REPO = Path(__file__).resolve().parents[2]
KEYS = ("sk-kiln-test-7f3a9c", "second-key-51b2")
GRACE_S = 4.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Stream(threading.Thread):
    """Reads one streaming completion on its own thread; records every data line."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[str] = []
        self.started = threading.Event()
        self.error: Exception | None = None

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {KEYS[1]}"}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body,
                              headers=headers, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.started.set()
        except httpx.HTTPError as exc:  # the server closing a stream it aborted
            self.error = exc
        self.started.set()

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"


@pytest.fixture
def serve_process(long_context_llama, tmp_path):
    port = free_port()
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "KILN_API_KEY": ",".join(KEYS), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "kiln.cli", "--log-level", "debug", "serve",
               "--model", str(long_context_llama), "--served-model-name", "tiny",
               "--dtype", "float32", "--device", "cpu", "--num-kv-blocks",
               str(2 * LONG_CONTEXT // 16), "--port", str(port),
               "--shutdown-timeout", str(GRACE_S)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
    try:
        yield process, f"http://127.0.0.1:{port}", log_path
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.TransportError:
        return 0  # not listening (yet, or any more)


def test_sigterm_drains_in_flight_aborts_the_rest_and_exits_0(serve_process):
    process, url, log_path = serve_process
    assert wait_until(lambda: health(url) == 200 or process.poll() is not None, timeout=90,
                      interval=0.2), log_path.read_text()[-2000:]
    assert process.poll() is None, log_path.read_text()[-2000:]

    # ignore_eos: the random model may sample its end-of-text token first (a 1-token completion)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
    assert httpx.post(url + "/v1/completions", json=body).status_code == 401
    ok = httpx.post(url + "/v1/completions", json=body,
                    headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2

    stream = {"model": "tiny", "prompt": "hi", "stream": True, "ignore_eos": True,
              "stream_options": {"include_usage": True}}
    short = Stream(url, {**stream, "max_tokens": 100})
    long = Stream(url, {**stream, "max_tokens": LONG_CONTEXT - 100})
    for s in (long, short):
        s.start()
        assert s.started.wait(timeout=30)
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert wait_until(lambda: health(url) != 200, timeout=2)  # draining: 503, then closed

    assert process.wait(timeout=GRACE_S + 20) == 0, log_path.read_text()[-2000:]
    short.join(timeout=5)
    long.join(timeout=5)
    # the short stream was in flight and finished in the grace period, with every token
    assert short.done, short.events[-3:]
    assert json.loads(short.events[-2])["usage"]["completion_tokens"] == 100
    # the long one was cut when the grace period ran out: no [DONE]
    assert not long.done and len(long.events) < LONG_CONTEXT - 100
    assert time.monotonic() - sent >= GRACE_S - 0.5

    log = log_path.read_text()
    for key in KEYS:
        assert key not in log  # not at debug level, not in the access log, not on errors


def test_bad_flags_fail_before_binding(long_context_llama):
    port = free_port()
    result = CliRunner().invoke(main, ["serve", "--model", str(long_context_llama),
                                       "--max-num-seqs", "0", "--port", str(port)])
    assert result.exit_code != 0
    assert "max_num_seqs" in result.output
    assert health(f"http://127.0.0.1:{port}") == 0  # never listened


@pytest.mark.parametrize("host, hint", [
    ("127.0.0.1", "Address already in use; pass another --port"),
    ("999.1.1.1", "; pass a valid --host")])
def test_a_bind_failure_is_one_clear_error_and_a_clean_exit(tiny_llama, host, hint):
    # The port is held by a listening socket, so binding 127.0.0.1 fails; 999.1.1.1 never
    # resolves. Either way the process must not claim to listen, nor abort (SIGABRT, 134).
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kiln.cli", "serve", "--model", str(tiny_llama),
             "--device", "cpu", "--host", host, "--port", str(port)],
            cwd=REPO, capture_output=True, text=True, timeout=60)
    (line,) = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 1, line
    assert line.startswith(f"Error: cannot listen on {host}:{port}: ") and hint in line, line


@pytest.mark.parametrize("flag, logged", [("--access-log", True), ("--no-access-log", False)])
def test_access_log_follows_its_flag_at_the_default_log_level(tiny_llama, tmp_path, flag, logged):
    """--access-log (the default) prints one line per request even at --log-level warning,
    whose level uvicorn would give its access logger."""
    port, log_path = free_port(), tmp_path / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli", "serve", "--model", str(tiny_llama), "--device",
             "cpu", "--port", str(port), flag],
            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: health(url) == 200 or process.poll() is not None, timeout=90,
                          interval=0.2), log_path.read_text()[-2000:]
        assert httpx.get(url + "/v1/models").status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log_path.read_text()[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert ('"GET /v1/models HTTP/1.1" 200' in log_path.read_text()) == logged


def test_sigterm_while_the_model_loads_exits_0_at_once():
    """Nothing to drain yet: the process says so and exits 0 without waiting for the load (its
    interpreter torn down under the loading thread had aborted: "terminate called", 134)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", "serve", "--model", "kiln-tiny", "--device", "cpu",
         "--port", str(port)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "listening on" in process.stdout.readline()
        # serving (its signal handlers in place) while the model loads
        assert wait_until(lambda: health(f"http://127.0.0.1:{port}") == 503, timeout=30,
                          interval=0.02)
        process.send_signal(signal.SIGTERM)
        rest = process.stdout.read()
        assert process.wait(timeout=30) == 0, rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "kiln serve: stopped while the model was loading" in rest, rest
    assert "terminate called" not in rest and "Traceback" not in rest, rest


def test_listen_on_the_ipv6_wildcard_stays_dual_stack():
    """--host :: resolves to one IPv6 address: its socket must take IPv4 clients too (as
    uvicorn's does); IPv6-only is only for the IPv6 socket beside an IPv4 one."""
    from kiln.serve.cli import _listen

    (sock,) = _listen("::", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
        port = sock.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        sock.close()


@pytest.mark.parametrize("flags, says", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser, "
                                    "the model's tool-call syntax: one of hermes, llama3_json, "
                                    "mistral, pythonic"),
    (["--tool-call-parser", "hermes"], "--tool-call-parser hermes is used only with "
                                       "--enable-auto-tool-choice; pass both, or neither"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "qwen"],
     "'qwen' is not one of 'hermes', 'llama3_json', 'mistral', 'pythonic'"),
])
def test_auto_tool_choice_takes_both_flags_or_neither(flags, says):
    """As vLLM: --enable-auto-tool-choice and a known --tool-call-parser go together; anything
    else fails before the model loads or the port opens."""
    port = free_port()
    result = CliRunner().invoke(main, ["serve", "--port", str(port), *flags])
    assert result.exit_code == 2 and says in result.output, result.output
    assert health(f"http://127.0.0.1:{port}") == 0


def test_the_tool_call_parser_reaches_the_app(tiny_llama, monkeypatch):
    import kiln.serve.app
    import kiln.serve.cli

    class Reached(Exception):
        pass

    def create_app(**options):
        raise Reached(options)

    monkeypatch.setattr(kiln.serve.app, "create_app", create_app)
    monkeypatch.setattr(kiln.serve.cli, "_listen", lambda host, port: [])  # (no socket)
    result = CliRunner().invoke(main, ["serve", "--model", str(tiny_llama), "--device", "cpu",
                                       "--enable-auto-tool-choice", "--tool-call-parser",
                                       "mistral"])
    assert isinstance(result.exception, Reached), result.output
    assert result.exception.args[0]["tool_call_parser"] == "mistral"

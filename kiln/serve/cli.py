"""``kiln serve``: the OpenAI-compatible server on uvicorn, with every engine flag of kiln.LLM.

Start-up order: flags are validated, the socket opens, then the engine loads on a background
thread (``/health`` answers 503 until it is ready). SIGTERM or Ctrl-C: ``/health`` and new
requests get 503, listeners close, in-flight requests have ``--shutdown-timeout`` seconds to
finish, the rest are aborted, and the process exits 0.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import click
import uvicorn

from kiln.cli_options import engine_options
from kiln.serve.auth import API_KEY_ENV, load_api_keys
from kiln.serve.state import ServerState
from kiln.serve.tool_parsers import TOOL_PARSERS
from kiln.zoo import DEFAULT_MODEL

log = logging.getLogger("kiln.serve")


class KilnServer(uvicorn.Server):
    """uvicorn's server, with a shutdown that drains first and ends in exit status 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.kiln_state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn we do not record the signal: uvicorn re-raises recorded signals after
        # a graceful shutdown, which would end the process with status 128 + SIGTERM, not 0.
        self.kiln_state.draining = True
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C skips the grace period
        else:
            self.should_exit = True


# What to change when listening fails with these errors
_BIND_HINTS = {
    errno.EADDRINUSE: "pass another --port, or stop the process that holds this one",
    errno.EADDRNOTAVAIL: "pass an address of this machine as --host (0.0.0.0 for every "
                         "interface)",
    errno.EACCES: "pass a --port above 1023 (lower ports need privileges)",
}
_HOST_HINT = "pass a valid --host (an IP address, or a name this machine resolves)"
BACKLOG = 2048  # uvicorn's default


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` resolves to, as uvicorn would open them.

    Binding here, before uvicorn and the engine start, turns a bad host or a busy port into one
    clear error: uvicorn would log the bare OSError and sys.exit() while the engine still loads
    on its thread, and tearing down the interpreter under that thread aborts the process.
    """
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        infos = list(dict.fromkeys(infos))  # unique, in order
        has_ipv4 = any(info[0] == socket.AF_INET for info in infos)
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            # a restart must not wait for the last run's connections to leave TIME_WAIT
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and has_ipv4:  # the IPv4 address has its own socket;
                # alone (--host ::) the IPv6 socket stays dual-stack, as uvicorn's
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        hint = (_HOST_HINT if isinstance(exc, socket.gaierror)  # the name did not resolve
                else _BIND_HINTS.get(exc.errno or 0))
        message = f"cannot listen on {_address(host, port)}: {exc.strerror or exc}"
        raise click.ClickException(f"{message}; {hint}" if hint else message) from None
    return sockets


def _auto_tool_choice(enabled: bool, parser: str | None) -> str | None:
    """The parser of tool_choice "auto", None while it is off: both flags or neither, as vLLM
    requires."""
    if enabled and parser is None:
        raise click.UsageError(f"--enable-auto-tool-choice needs --tool-call-parser, the model's "
                               f"tool-call syntax: one of {', '.join(TOOL_PARSERS)}")
    if parser is not None and not enabled:
        raise click.UsageError(f"--tool-call-parser {parser} is used only with "
                               f"--enable-auto-tool-choice; pass both, or neither")
    return parser


def _read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    return path.read_text() if path.is_file() else value


@click.command("serve")
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="checkpoint directory, Hugging Face hub id, or zoo name")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to bind (0.0.0.0 for every interface)")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", "api_keys", multiple=True, metavar="KEY",
              help=f"require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize; "
                   f"repeat for several keys, or set {API_KEY_ENV} (comma-separated)")
@click.option("--served-model-name", "served_model_names", multiple=True, metavar="NAME",
              help="model name(s) the API answers to (default: the --model value)")
@click.option("--chat-template", default=None,
              help="Jinja chat template, or a file holding one (default: the tokenizer's)")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help='answer tool_choice "auto" (the default with tools): the model decides, and '
                   "--tool-call-parser finds its calls")
@click.option("--tool-call-parser", type=click.Choice(list(TOOL_PARSERS)), default=None,
              help="the model's tool-call syntax (with --enable-auto-tool-choice): hermes (Hermes,"
                   " Qwen2.5, Qwen3), llama3_json (Llama 3.1 / 3.2), mistral, pythonic (Llama"
                   " 3.2 / 4)")
@click.option("--shutdown-timeout", default=30.0, show_default=True, type=click.FloatRange(0),
              help="seconds in-flight requests may take to finish after SIGTERM")
@click.option("--access-log/--no-access-log", default=True, show_default=True,
              help="log one line per HTTP request (never headers, so never keys)")
@engine_options
def serve_command(model: str, host: str, port: int, api_keys: tuple[str, ...],
                  served_model_names: tuple[str, ...], chat_template: str | None,
                  enable_auto_tool_choice: bool, tool_call_parser: str | None,
                  shutdown_timeout: float, access_log: bool,
                  engine_kwargs: dict[str, Any]) -> None:
    """Serve MODEL behind an OpenAI-compatible HTTP API (completions, chat, metrics)."""
    from kiln.config import EngineConfig
    from kiln.engine.async_engine import AsyncEngine
    from kiln.engine.llm_engine import LLMEngine
    from kiln.serve.app import create_app

    tool_call_parser = _auto_tool_choice(enable_auto_tool_choice, tool_call_parser)
    try:
        config = EngineConfig.from_kwargs(model, **engine_kwargs)  # bad flags fail before binding
        template = _read_chat_template(chat_template)
    except (ValueError, TypeError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    sockets = _listen(host, port)
    failed: list[BaseException] = []
    server: KilnServer | None = None

    def on_startup_error(exc: BaseException) -> None:
        failed.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(served_model_name=list(served_model_names) or [model],
                     api_keys=load_api_keys(api_keys),
                     engine_factory=lambda: AsyncEngine(LLMEngine(config)),
                     model_path=model, chat_template=template,
                     tool_call_parser=tool_call_parser, on_startup_error=on_startup_error)
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    uv_config = uvicorn.Config(app, log_level=level, access_log=access_log,
                               timeout_graceful_shutdown=shutdown_timeout, lifespan="on")
    if access_log:  # uvicorn gives its access logger --log-level (warning): its lines are info
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    server = KilnServer(uv_config, app.state.kiln)
    bound = _address(host, sockets[0].getsockname()[1])  # the port the OS chose for --port 0
    click.echo(f"kiln serve: loading {model}; listening on http://{bound} "
               f"(GET /health answers 200 once the model is ready)", err=True)
    server.run(sockets=sockets)
    if failed:
        raise click.ClickException(f"the engine failed to start: {failed[0]}")
    loader = app.state.kiln.loader
    if loader is not None and loader.is_alive():
        # stopped (SIGTERM) while the model loads: nothing to drain, and tearing the interpreter
        # down under the loading thread aborts the process ("terminate called ...", SIGABRT)
        click.echo("kiln serve: stopped while the model was loading", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.stdout.flush()

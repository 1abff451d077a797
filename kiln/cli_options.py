"""What the ``kiln`` commands share: -h, the settings of Typer sub-apps, the results directory,
and the engine flags of every command that builds an engine, generated from the config
dataclasses.

``--block-size``, ``--max-num-seqs``, ``--gpu-memory-utilization`` ... are the dashed forms of
``EngineConfig.from_kwargs`` names (vLLM's names), so ``kiln serve``, ``kiln generate`` and
``kiln bench`` accept the same flags as ``kiln.LLM(...)`` keyword arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kiln import config as cfg

HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}  # every kiln command takes -h


def typer_app(help: str) -> Any:
    """A Typer sub-app (eval, zoo) that behaves as the click commands: -h, plain usage errors
    (Typer's rich mode boxes them), no shell-completion options."""
    import typer  # (only the commands that are Typer apps pay its import)

    return typer.Typer(help=help, context_settings=HELP_OPTIONS, rich_markup_mode=None,
                       add_completion=False)


def result_dir(kind: str, output_dir: str | None) -> Path:
    """``--output-dir``, or out/bench/<kind>-<time>. One that already holds a run's results is
    refused before any work: its plots would stay beside the new result.json, mixing runs."""
    from kiln.bench.result import default_output_dir

    path = Path(output_dir) if output_dir else default_output_dir(kind)
    if (path / "result.json").exists():
        raise click.UsageError(f"--output-dir {path} already holds a run's results "
                               "(result.json); choose another directory or remove that one")
    return path


_CHOICES = {
    "dtype": cfg.DTYPE_CHOICES, "device": cfg.DEVICE_CHOICES, "load_format": cfg.LOAD_FORMATS,
    "preemption_mode": cfg.PREEMPTION_MODES, "attention_backend": cfg.ATTENTION_BACKENDS,
    "kv_cache_dtype": cfg.KV_CACHE_DTYPES, "quantization": cfg.QUANTIZATION_METHODS,
}
_SKIP = {"model"}
_HELP = {
    "dtype": "weights and activations dtype (auto: the checkpoint's on GPU, float32 on CPU)",
    "device": "where the model runs (auto: CUDA when visible)",
    "load_format": "dummy: random weights from config.json alone (benchmarks)",
    "max_model_len": "longest prompt + output served (default: the model's limit)",
    "revision": "hub revision to download",
    "seed": "seed of the sampling of requests without their own and of --load-format dummy",
    "quantization": "quantize the weights at load",
    "block_size": "tokens per KV-cache block",
    "gpu_memory_utilization": "fraction of GPU memory Kiln may use (weights + KV pool)",
    "swap_space": "GB of CPU memory for swapped-out requests (preemption_mode swap)",
    "cpu_kv_cache_space": "GB for the KV pool when running on CPU",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "num_kv_blocks": "fix the KV pool size in blocks (overrides the memory budget)",
    "kv_cache_dtype": "fp8 stores K/V in float8 e4m3 with per-layer scales",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (longer prompts are chunked); kiln serve "
                              "and GPUs under 70 GiB default to 8192, offline runs to 16384",
    "preemption_mode": "what happens to a request preempted for KV space",
    "max_waiting_requests": "the server answers 429 beyond this many waiting requests",
    "async_scheduling": "launch the next decode step while the host finishes the last one",
    "tensor_parallel_size": "GPUs to split each layer over",
    "enforce_eager": "no CUDA graphs",
    "attention_backend": "torch (reference, any device) or triton (CUDA); auto picks",
}  # each command declares --model itself (with its own default)


def _click_type(name: str, annotation: str) -> Any:
    if name in _CHOICES:
        return click.Choice(list(_CHOICES[name]))
    base = annotation.replace(" | None", "")
    return {"int": int, "float": float, "bool": bool, "str": str}.get(base, str)


def _engine_fields() -> list[tuple[str, str, Any]]:
    fields = []
    for klass in (cfg.ModelConfig, cfg.CacheConfig, cfg.SchedulerConfig, cfg.ParallelConfig):
        hints = typing.get_type_hints(klass)
        for f in dataclasses.fields(klass):
            if f.name not in _SKIP:
                annotation = str(f.type) if isinstance(f.type, str) else str(hints[f.name])
                fields.append((f.name, annotation, f.default))
    fields.append(("enforce_eager", "bool", False))
    fields.append(("attention_backend", "str", "auto"))
    return fields


def engine_options(command: Callable) -> Callable:
    """Add every engine flag to a click command; the command receives them as ``engine_kwargs``.

    Only flags the user actually gave are passed on, so the engine's own defaults apply.
    """
    names = []
    for name, annotation, default in reversed(_engine_fields()):
        flag = "--" + name.replace("_", "-")
        if annotation == "bool":
            decl = f"{flag}/--no-{name.replace('_', '-')}"
            command = click.option(decl, name, default=None, show_default=str(default),
                                   help=_HELP.get(name, name))(command)
        else:
            command = click.option(flag, name, type=_click_type(name, annotation), default=None,
                                   show_default=str(default), help=_HELP.get(name, name))(command)
        names.append(name)

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        engine_kwargs = {n: kwargs.pop(n) for n in names if kwargs.get(n) is not None}
        for n in names:
            kwargs.pop(n, None)
        return command(*args, engine_kwargs=engine_kwargs, **kwargs)

    return wrapper

"""Named ranges around the phases of an engine step, seen by torch.profiler and by Nsight.

Each phase runs inside ``torch.profiler.record_function`` (a range in the Chrome trace) and, on
CUDA, an NVTX range (a row in ``nsys``). The engine and model runner stay untouched: while the
``annotate_engine`` context is open, the bound methods that make up a step are wrapped on
*these instances only*, and restored on exit.

    schedule        engine.scheduler.schedule
    prepare_inputs  engine.runner.prepare        (flat token ids, positions, slot mapping ...)
    forward         engine.runner.model.forward
    logits          engine.runner.model.compute_logits   (the LM head on the sampled rows)
    sample          engine.runner.sampler.sample
    update          engine._update               (append tokens, stop checks, free blocks)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

PHASES = ("schedule", "prepare_inputs", "forward", "logits", "sample", "update")
PREFIX = "kiln."


@contextmanager
def phase_range(name: str, nvtx: bool) -> Iterator[None]:
    """A profiler range, plus an NVTX range when ``nvtx`` (CUDA builds only)."""
    marker = torch.cuda.nvtx.range(name) if nvtx else nullcontext()
    with torch.profiler.record_function(name), marker:
        yield


def _wrap(fn: Callable[..., Any], name: str, nvtx: bool) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with phase_range(name, nvtx):
            return fn(*args, **kwargs)

    return wrapper


def _targets(engine: Any) -> list[tuple[Any, str, str]]:
    """(object, method name, phase) for every phase of a step."""
    runner = engine.runner
    return [(engine.scheduler, "schedule", "schedule"), (runner, "prepare", "prepare_inputs"),
            (runner.model, "forward", "forward"), (runner.model, "compute_logits", "logits"),
            (runner.sampler, "sample", "sample"),
            (engine, "_update", "update")]


@contextmanager
def annotate_engine(engine: Any, nvtx: bool | None = None) -> Iterator[None]:
    """Wrap the step's phases of ``engine`` in named ranges while the context is open."""
    if nvtx is None:
        nvtx = engine.loaded.device.type == "cuda" and torch.cuda.is_available()
    saved = []
    try:
        for obj, method, phase in _targets(engine):
            had_own = method in vars(obj)  # an instance attribute to put back, not a class one
            saved.append((obj, method, had_own, vars(obj).get(method)))
            setattr(obj, method, _wrap(getattr(obj, method), PREFIX + phase, nvtx))
        yield
    finally:
        for obj, method, had_own, original in reversed(saved):
            if had_own:
                setattr(obj, method, original)
            else:
                delattr(obj, method)


def step_range(index: int, nvtx: bool) -> Any:
    return phase_range(f"{PREFIX}step {index}", nvtx)

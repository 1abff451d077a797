"""Garbage collection around step loops: the start-up heap left out, no full collection inside.

A full collection (the oldest generation) scans every tracked object. Once an engine is up that
is the model's modules, the tokenizer, compiled kernels and CUDA graphs: several hundred
thousand objects and a pause of 100-250 ms, and a loop that steps 512 requests allocates enough
to trigger one every few seconds. On the H100 that was 2-4 stalls of 70-230 ms in each 13 s run
of the 512-request benchmark (benchmarks/results/h100/ab_runs.txt 34); in a server it is a
spike in every in-flight request's inter-token latency.

``frozen_heap()`` moves the objects that exist on entry to the permanent generation
(``gc.freeze``) for as long as the loop runs and hands them back (``gc.unfreeze``) when the
outermost loop ends, so nothing is kept from collection for good. Inside, the young generations
are collected as before (a cycle that dies young goes at once) but no full collection starts on
its own: one still scanned everything the loop keeps alive, 20-70 ms at 64-512 requests, and it
found nothing (the step loop makes no cyclic garbage: 256 requests run on the CPU, 0 objects
freed), while each one cost a stall (ab_runs.txt 36). The default thresholds come back with the
last exit. A loop that lives as long as a server, whose other threads may leave cycles to age,
runs full collections itself through ``FullCollections``: when it is idle (at most every 10 s),
and once a minute if it stays busy. Freezing and unfreezing are O(1) list splices. Loops may
nest or run in several threads (an engine thread beside an offline run): the heap is frozen on
the first entry and released on the last exit.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

# young collections between two full ones (CPython's third threshold): never, in practice
NO_FULL_COLLECTIONS = 2**31 - 1

_lock = threading.Lock()
_depth = 0
_thresholds: tuple[int, ...] = ()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Run a step loop with the heap of its start left out of garbage collection and no
    automatic full collection."""
    global _depth, _thresholds
    with _lock:
        if _depth == 0:
            gc.freeze()
            _thresholds = gc.get_threshold()
            gc.set_threshold(_thresholds[0], _thresholds[1], NO_FULL_COLLECTIONS)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.set_threshold(*_thresholds)
                gc.unfreeze()


class FullCollections:
    """The full collections of a long-lived loop under ``frozen_heap()``: when it is idle (the
    cheap moment), at most every ``idle_interval_s``, and if it stays busy, every
    ``busy_interval_s``; only after steps ran since the last one."""

    def __init__(self, idle_interval_s: float = 10.0, busy_interval_s: float = 60.0) -> None:
        self.idle_interval_s = idle_interval_s
        self.busy_interval_s = busy_interval_s
        self._last = time.monotonic()
        self._dirty = False

    def after_step(self) -> None:
        self._dirty = True
        self._collect_after(self.busy_interval_s)

    def on_idle(self) -> None:
        self._collect_after(self.idle_interval_s)

    def _collect_after(self, interval_s: float) -> None:
        if self._dirty and time.monotonic() - self._last >= interval_s:
            gc.collect()
            self._last = time.monotonic()
            self._dirty = False

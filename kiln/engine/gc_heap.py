"""Keep the heap that exists when a step loop starts out of Python's garbage collection.

A full collection (the oldest generation) scans every tracked object. Once an engine is up that
is the model's modules, the tokenizer, compiled kernels and CUDA graphs: several hundred
thousand objects and a pause of 100-250 ms, and a loop that steps 512 requests allocates enough
to trigger one every few seconds. On the H100 that was 2-4 stalls of 70-230 ms in each 13 s run
of the 512-request benchmark (benchmarks/results/h100/ab_runs.txt 34); in a server it is a
spike in every in-flight request's inter-token latency.

``frozen_heap()`` moves the objects that exist on entry to the permanent generation
(``gc.freeze``) for as long as the loop runs and hands them back (``gc.unfreeze``) when the
outermost loop ends, so nothing is kept from collection for good; the objects the loop creates
are collected as before, and a full collection then scans only those. Both calls are O(1) list
splices. Loops may nest or run in several threads (an engine thread beside an offline run): the
heap is frozen on the first entry and released on the last exit.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Run a step loop with the heap of its start left out of garbage collection."""
    global _depth
    with _lock:
        if _depth == 0:
            gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()

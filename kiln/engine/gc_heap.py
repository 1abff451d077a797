"""Garbage collection around step loops: the start-up heap left out, and in finite loops no full
collection at all.

A full collection (the oldest generation) scans every tracked object. Once an engine is up that
is the model's modules, the tokenizer, compiled kernels and CUDA graphs: several hundred
thousand objects and a pause of 100-250 ms, and a loop that steps 512 requests allocates enough
to trigger one every few seconds. On the H100 that was 2-4 stalls of 70-230 ms in each 13 s run
of the 512-request benchmark (benchmarks/results/h100/ab_runs.txt 34); in a server it is a
spike in every in-flight request's inter-token latency.

``frozen_heap()`` moves the objects that exist on entry to the permanent generation
(``gc.freeze``) for as long as the loop runs and hands them back (``gc.unfreeze``) when the
outermost loop ends, so nothing is kept from collection for good; the objects the loop creates
are collected as before, and a full collection then scans only those. Every step loop runs in it.

``no_full_collections()`` also keeps full collections from starting on their own (the young
generations are collected as before, so a cycle that dies young still goes at once): in a loop
that steps 64-512 requests one still scanned everything the loop keeps alive, a 15-70 ms stall,
to free nothing, as the steps make no cyclic garbage (ab_runs.txt 36). The loops that end (an
offline batch, a benchmark) run in it; a server's step thread does not, since the process is
long-lived and its other threads may leave cycles to age: there CPython's own rule applies, and
with the start-up heap frozen it rarely starts one.

Both nest and work across threads (an engine thread beside an offline run): the first entry
switches, the last exit switches back; freezing and unfreezing are O(1) list splices.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

# young collections between two full ones (CPython's third threshold): never, in practice
NO_FULL_COLLECTIONS = 2**31 - 1


def _nested(enter: Callable[[], None], leave: Callable[[], None],
            doc: str) -> Callable[[], AbstractContextManager[None]]:
    """A context manager that calls ``enter`` on the first of any number of nested or
    concurrent entries and ``leave`` on the last exit."""
    lock, depth = threading.Lock(), [0]

    @contextmanager
    def scope() -> Iterator[None]:
        with lock:
            if depth[0] == 0:
                enter()
            depth[0] += 1
        try:
            yield
        finally:
            with lock:
                depth[0] -= 1
                if depth[0] == 0:
                    leave()

    scope.__doc__ = doc
    return scope


_thresholds: list[tuple[int, ...]] = []


def _stop_full_collections() -> None:
    _thresholds.append(gc.get_threshold())
    gc.set_threshold(_thresholds[-1][0], _thresholds[-1][1], NO_FULL_COLLECTIONS)


def _restore_full_collections() -> None:
    gc.set_threshold(*_thresholds.pop())


frozen_heap = _nested(gc.freeze, gc.unfreeze,
                      "Run a step loop with the heap of its start left out of garbage collection.")
no_full_collections = _nested(_stop_full_collections, _restore_full_collections,
                              "Run a loop that ends with no full collection starting on its own.")


@contextmanager
def finite_loop_heap() -> Iterator[None]:
    """A loop that ends (an offline batch, a benchmark, a profile): both of the above."""
    with frozen_heap(), no_full_collections():
        yield

"""gc_heap: step loops run with the heap of their start out of garbage collection, loops that end
also with no full collection starting on its own, and both come back with the last exit; the
server's step thread keeps CPython's own full collections."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

import kiln
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.gc_heap import NO_FULL_COLLECTIONS, frozen_heap, no_full_collections
from kiln.engine.llm_engine import LLMEngine


class Node:
    """A weak-referenceable object that can sit in a reference cycle."""


def cycle() -> weakref.ref:
    """A self-referencing object, already garbage: only the cycle collector frees it."""
    node = Node()
    node.self = node
    return weakref.ref(node)


@pytest.fixture(autouse=True)
def nothing_frozen():
    gc.collect()
    thresholds = gc.get_threshold()
    assert gc.get_freeze_count() == 0, "an earlier test left the heap frozen"
    yield
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == thresholds


@pytest.fixture
def collections_started():
    """The generation of every collection that starts while the test runs."""
    started = []

    def record(phase, info):
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(record)
    yield started
    gc.callbacks.remove(record)


def _allocate_survivors() -> list:
    """Enough objects that live through young collections to trigger full ones (by default)."""
    return [[] for _ in range(400_000)]


def test_no_full_collection_starts_inside_a_finite_loop(collections_started):
    gc.collect()
    collections_started.clear()
    kept = _allocate_survivors()
    assert 2 in collections_started  # the default thresholds: full collections on their own
    del kept
    gc.collect()
    collections_started.clear()
    with no_full_collections():
        assert gc.get_threshold()[2] == NO_FULL_COLLECTIONS
        with no_full_collections():
            kept = _allocate_survivors()
        assert gc.get_threshold()[2] == NO_FULL_COLLECTIONS  # the outer loop still runs
    assert 1 in collections_started and 2 not in collections_started  # young ones still run
    del kept


def test_a_cycle_older_than_the_loop_waits_for_its_end():
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        older = cycle()  # garbage from before this loop's next collection...
    gc.collect()
    assert older() is None  # ...collected once the loop ended
    node = Node()
    node.self = node
    before = weakref.ref(node)
    with frozen_heap():
        del node  # existed on entry: frozen
        gc.collect()
        assert before() is not None
        during = cycle()  # created inside the loop: collected as usual
        gc.collect()
        assert during() is None
    gc.collect()
    assert before() is None


def test_nested_and_failing_loops_release_on_the_last_exit():
    with pytest.raises(RuntimeError), frozen_heap():
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > 0  # the outer loop still runs
        raise RuntimeError("a step failed")
    assert gc.get_freeze_count() == 0


def test_loops_in_two_threads():
    entered, release = threading.Event(), threading.Event()

    def other_loop() -> None:
        with frozen_heap():
            entered.set()
            release.wait(timeout=10)

    thread = threading.Thread(target=other_loop)
    thread.start()
    assert entered.wait(timeout=10)
    with frozen_heap():
        pass
    assert gc.get_freeze_count() > 0  # the other thread's loop has not ended
    release.set()
    thread.join(timeout=10)
    assert gc.get_freeze_count() == 0


def test_the_engine_steps_with_the_heap_frozen(tiny_llama, monkeypatch):
    engine = LLMEngine.from_kwargs(str(tiny_llama), dtype="float32", device="cpu",
                                   num_kv_blocks=128, block_size=4)
    frozen_at_step = []
    real_step = engine.step

    def step():
        frozen_at_step.append(gc.get_freeze_count() > 0
                              and gc.get_threshold()[2] == NO_FULL_COLLECTIONS)
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    engine.add_request("a", [5, 6, 7], kiln.SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(engine.run_to_completion()) == 1
    assert frozen_at_step and all(frozen_at_step)
    # a consumer that leaves the stream early gives the heap back when the stream is closed
    engine.add_request("b", [5, 6, 7], kiln.SamplingParams(max_tokens=4, ignore_eos=True))
    stream = engine.stream_outputs()
    next(stream)
    assert gc.get_freeze_count() > 0
    stream.close()
    assert gc.get_freeze_count() == 0
    engine.abort_request("b")


def test_the_async_engine_thread_holds_it_until_shutdown(tiny_llama):
    engine = AsyncEngine.from_kwargs(str(tiny_llama), dtype="float32", device="cpu",
                                     num_kv_blocks=128, block_size=4)
    try:
        for _ in range(200):  # the step thread enters its loop right after it starts
            if gc.get_freeze_count() > 0:
                break
            time.sleep(0.01)
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[2] != NO_FULL_COLLECTIONS  # a server's full collections stay
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0


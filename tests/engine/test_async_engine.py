"""AsyncEngine: concurrent streams, early exit aborts, bad input, and aborts from outside."""

from __future__ import annotations

import asyncio

import pytest

import kiln
from kiln.engine.async_engine import AsyncEngine, EngineDeadError


@pytest.fixture
def engine(tiny_llama):
    eng = AsyncEngine.from_kwargs(str(tiny_llama), dtype="float32", device="cpu",
                                  num_kv_blocks=128, block_size=4)
    yield eng
    eng.shutdown()


async def test_concurrent_streams_and_early_exit(engine):
    async def consume(i: int) -> tuple[int, int]:
        params = kiln.SamplingParams(max_tokens=12, ignore_eos=True, seed=i)
        count, last = 0, None
        async for out in engine.generate([5, 6, 7, 8 + i], params):
            count, last = count + 1, out
            if i == 0 and count == 3:
                break  # leaving the stream aborts the request
        return count, len(last.outputs[0].token_ids)

    results = await asyncio.gather(*[consume(i) for i in range(8)])
    assert results[0] == (3, 3)
    assert all(n == 12 for _, n in results[1:])
    for _ in range(50):  # the abort travels the command queue; wait for the step thread
        if engine.engine.kv.num_free_blocks == 128:
            break
        await asyncio.sleep(0.02)
    assert engine.engine.kv.num_free_blocks == 128
    assert engine.engine.stats.finished_by_reason["abort"] == 1


async def test_bad_input_raises_before_queueing(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        async for _ in engine.generate([7] * 600, kiln.SamplingParams()):
            pass
    with pytest.raises(ValueError, match="stop_token_ids"):
        async for _ in engine.generate([7], kiln.SamplingParams(stop_token_ids=[10**6])):
            pass
    with pytest.raises(ValueError, match="KV blocks"):
        async for _ in engine.generate([7], kiln.SamplingParams(n=8, max_tokens=200)):
            pass
    assert engine.num_in_flight == 0


async def test_abort_from_outside_ends_the_stream(engine):
    params = kiln.SamplingParams(max_tokens=400, ignore_eos=True)
    outputs = []

    async def consume() -> None:
        async for out in engine.generate([5, 6], params, request_id="victim"):
            outputs.append(out)

    task = asyncio.create_task(consume())
    while not outputs:
        await asyncio.sleep(0.01)
    engine.abort("victim")
    await asyncio.wait_for(task, timeout=5)
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"


async def test_a_request_racing_shutdown_fails_instead_of_hanging(engine):
    """shutdown() landing between generate()'s checks and the request's hand-over (here: while
    the prompt is tokenized) used to leave a stream no one would ever answer."""
    make_request = engine.engine.make_request

    def make_request_while_shutting_down(*args, **kwargs):
        engine.shutdown()
        return make_request(*args, **kwargs)

    engine.engine.make_request = make_request_while_shutting_down

    async def consume() -> None:
        async for _ in engine.generate([5, 6], kiln.SamplingParams(max_tokens=4)):
            pass

    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(consume(), timeout=5)
    assert engine.num_in_flight == 0

"""The paged engine against the contiguous reference path (greedy, float32, CPU)."""

from __future__ import annotations

import random

import pytest
from engine_helpers import make_engine, run_all

import kiln


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_greedy_matches_reference_with_chunked_prefill(tiny_llama, reference_outputs, block_size):
    prompts, params, expected = reference_outputs
    # a 96-token budget splits every prompt longer than that over several steps
    engine = make_engine(tiny_llama, block_size=block_size, max_num_batched_tokens=96,
                         max_num_seqs=32)
    got = run_all(engine, prompts, params)
    assert got == expected
    assert engine.kv.num_free_blocks == engine.kv_cache.num_blocks
    engine.kv.check_integrity()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_small_pool_preempts_and_still_matches(tiny_llama, reference_outputs, mode):
    prompts, params, expected = reference_outputs
    prompts, params = prompts[:24], params[:24]
    expected = {k: v for k, v in expected.items() if int(k) < 24}
    # 40 blocks of 16 tokens: room for about two long requests at a time
    engine = make_engine(tiny_llama, num_kv_blocks=40, block_size=16, preemption_mode=mode,
                         swap_space=0.01, max_num_batched_tokens=256)
    got = run_all(engine, prompts, params)
    assert got == expected
    assert engine.stats.num_preemptions > 0
    assert (engine.scheduler.num_swap_outs > 0) == (mode == "swap")
    assert engine.kv.num_free_blocks == 40
    engine.kv.check_integrity()


def test_swapped_request_comes_back_with_room_to_run(tiny_llama, monkeypatch):
    """A request swapped back in beside running ones leaves a free block for each of them, so
    it is never preempted again before computing a token (its KV moved out and back for
    nothing: without the reserve 10 of 57 swaps in a run like this one)."""
    engine = make_engine(tiny_llama, num_kv_blocks=250, block_size=16, preemption_mode="swap",
                         swap_space=0.05)
    preempted = []  # (request id, tokens it had generated)
    preempt = engine.scheduler._preempt

    def record(request, out):
        preempted.append((request.request_id, len(request.seqs[0].output_token_ids)))
        preempt(request, out)

    monkeypatch.setattr(engine.scheduler, "_preempt", record)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(100)] for _ in range(32)]
    params = [kiln.SamplingParams(max_tokens=250, temperature=0.0, ignore_eos=True)] * 32
    run_all(engine, prompts, params)
    assert engine.scheduler.num_swap_outs > 0
    again = [p for i, p in enumerate(preempted) if p in preempted[:i]]
    assert not again, f"swapped in and out again without computing a token: {again}"
    assert engine.kv.num_free_blocks == 250
    engine.kv.check_integrity()

"""The paged engine against the contiguous reference path (greedy, float32, CPU)."""

from __future__ import annotations

import pytest
from engine_helpers import make_engine, run_all


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

"""Blocks out of every sliding window given back (kiln/cache/window.py): tiny pools of 4-token
blocks, exact block ids. Block 0 is the null block the freed table entries name."""

import pytest
import torch

from kiln.cache import KVCache, KVCacheManager, max_blocks_held, num_unreachable_blocks

BS = 4


def make(lookback: int, num_gpu_blocks: int = 8, num_cpu_blocks: int = 0) -> KVCacheManager:
    return KVCacheManager(num_gpu_blocks, BS, num_cpu_blocks=num_cpu_blocks, lookback=lookback)


def test_unreachable_blocks():
    assert [num_unreachable_blocks(p, 5, BS) for p in (0, 5, 8, 9, 12, 13)] == [0, 0, 0, 1, 1, 2]
    assert num_unreachable_blocks(10**6, None, BS) == 0  # a layer sees everything
    assert num_unreachable_blocks(7, 0, BS) == 1  # the query's own block is never given back


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("lookback", [None, 0, 5, 134])
@pytest.mark.parametrize("max_step_tokens", [1, 3, 16])
def test_max_blocks_held_bounds_every_step(block_size, lookback, max_step_tokens):
    """No step [p0, p0 + n) of a sequence of up to 80 tokens holds more blocks than the bound,
    which some step reaches (it is tight) and which is every block without a lookback."""
    for num_tokens in range(1, 80):
        held = max(-(-(p0 + n) // block_size)
                   - num_unreachable_blocks(p0, lookback, block_size)
                   for p0 in range(num_tokens)
                   for n in range(1, min(max_step_tokens, num_tokens - p0) + 1))
        bound = max_blocks_held(num_tokens, max_step_tokens, block_size, lookback)
        assert held <= bound <= -(-num_tokens // block_size), (num_tokens, held, bound)
        if lookback is None:
            assert bound == -(-num_tokens // block_size)
        # a sequence much longer than a step and the lookback reaches its bound exactly
        if num_tokens >= max_step_tokens + (lookback or 0) + 2 * block_size:
            assert held == bound, (num_tokens, held, bound)


def test_blocks_out_of_reach_are_given_back_for_the_null_block():
    m = make(lookback=5)
    assert m.null_block == 0 and m.num_usable_blocks == 7
    assert m.num_free_blocks == 7 and m.usage == 0.0
    assert m.allocate_slots("a", 10, 0) and m.block_table("a") == [1, 2, 3]
    assert m.allocate_slots("a", 11, 10)  # keys from 10 - 5 on: block 1 (0-3) is out of reach
    assert m.block_table("a") == [0, 2, 3]
    assert m.gpu_pool.free_block_ids() == [4, 5, 6, 7, 1] and m.usage == 2 / 7
    assert m.allocate_slots("a", 13, 11) and m.block_table("a") == [0, 2, 3, 4]
    assert m.allocate_slots("a", 14, 13)  # keys from 8 on: block 2 goes
    assert m.block_table("a") == [0, 0, 3, 4]
    assert m.gpu_pool.free_block_ids() == [5, 6, 7, 1, 2]
    m.check_integrity()
    m.free("a")
    assert m.gpu_pool.free_block_ids() == [5, 6, 7, 1, 2, 4, 3] and m.usage == 0.0
    m.check_integrity()


def test_blocks_given_back_pay_for_the_step_and_a_failure_keeps_them():
    m = make(lookback=0, num_gpu_blocks=4)  # blocks 1-3 usable
    assert m.allocate_slots("a", 12, 0) and m.num_free_blocks == 0
    assert m.allocate_slots("a", 13, 12)  # fits only with the three blocks it gives back
    assert m.block_table("a") == [0, 0, 0, 1]
    m.check_integrity()

    m = make(lookback=4, num_gpu_blocks=4)
    assert m.allocate_slots("a", 12, 0)
    before = (m.block_table("a"), m.gpu_pool.free_block_ids())
    assert not m.allocate_slots("a", 17, 8)  # gives back one block, needs two
    assert (m.block_table("a"), m.gpu_pool.free_block_ids()) == before
    assert m.allocate_slots("a", 16, 8) and m.block_table("a") == [0, 2, 3, 1]
    with pytest.raises(ValueError, match="given back"):
        m.allocate_slots("a", 16, 3)  # a step never goes back before what was given back
    m.check_integrity()


def test_forked_blocks_stay_with_the_sibling_that_still_reaches_them():
    m = make(lookback=0)
    assert m.allocate_slots("p", 8, 0) and m.block_table("p") == [1, 2]
    m.fork("p", "c")
    assert m.allocate_slots("p", 9, 8)  # p lets go of blocks 1 and 2; c still holds them
    assert m.block_table("p") == [0, 0, 3] and m.block_table("c") == [1, 2]
    assert [m.gpu_pool.ref_count(b) for b in (1, 2, 3)] == [1, 1, 1]
    assert m.gpu_pool.free_block_ids() == [4, 5, 6, 7]
    assert m.allocate_slots("c", 9, 8)  # now they are free
    assert m.block_table("c") == [0, 0, 4]
    assert m.gpu_pool.free_block_ids() == [5, 6, 7, 1, 2]
    m.fork("c", "d")  # a fork inherits the entries given back
    assert m.block_table("d") == [0, 0, 4] and m.gpu_pool.ref_count(4) == 2
    m.check_integrity()


def prefill_in_chunks(m: KVCacheManager, seq_id: str, tokens: list[int], chunk: int) -> None:
    for start in range(0, len(tokens), chunk):
        end = min(start + chunk, len(tokens))
        assert m.allocate_slots(seq_id, end, start)
        m.cache_full_blocks(seq_id, tokens, end)
        m.check_integrity()


def test_given_back_blocks_stay_cached_and_a_hit_needs_only_what_it_reaches():
    m = make(lookback=3)
    tokens = list(range(20))
    assert m.match_prefix("a", tokens) == 0
    prefill_in_chunks(m, "a", tokens, 8)
    # chunks from 8 and 16 gave back blocks 1-3 (keys 0-11): hashed, in the evictable queue
    assert m.block_table("a") == [0, 0, 0, 4, 5]
    assert sorted(m.gpu_pool.cached_block_ids().values()) == [1, 2, 3, 4, 5]
    assert m.gpu_pool.free_block_ids() == [6, 7, 1, 2, 3]
    m.free("a")
    assert m.allocate_slots("x", 12, 0) and m.block_table("x") == [6, 7, 1]  # evicts block 1
    assert 1 not in m.gpu_pool.cached_block_ids().values()
    # the whole prompt hits although its first block is gone: from 20 on, attention reaches
    # keys 17 and up only, i.e. block 5, the one reference taken
    assert m.match_prefix("b", tokens + [99]) == 20
    assert m.block_table("b") == [0, 0, 0, 0, 5]
    assert m.gpu_pool.ref_count(5) == 1 and m.gpu_pool.ref_count(4) == 0
    assert m.allocate_slots("b", 21, 20) and m.block_table("b") == [0, 0, 0, 0, 5, 2]
    m.check_integrity()


def test_a_hit_stops_where_a_reached_block_is_missing():
    m = make(lookback=3)
    tokens = list(range(20))
    m.match_prefix("a", tokens)
    prefill_in_chunks(m, "a", tokens, 8)
    m.free("a")  # queue [6, 7, 1, 2, 3, 5, 4]: block 5 (keys 16-19) before block 4
    assert m.allocate_slots("x", 24, 0) and 5 in m.block_table("x")
    # 20 would reach block 5's keys, gone; 16 reaches keys 13 and up: block 4, still cached
    assert m.match_prefix("b", tokens + [99]) == 16
    assert m.block_table("b") == [0, 0, 0, 4]
    m.check_integrity()


def test_swap_moves_only_the_blocks_still_held():
    m = make(lookback=0, num_cpu_blocks=4)
    tokens = list(range(16))
    m.match_prefix("a", tokens)
    prefill_in_chunks(m, "a", tokens, 12)  # the second chunk gives back blocks 1-3
    assert m.block_table("a") == [0, 0, 0, 4]
    assert m.swap_out(["a"]) == [(4, 0)]  # no null block, no block given back
    assert m.num_free_cpu_blocks == 3
    m.check_integrity()
    # block 4 is still cached on the GPU: the swap-in revives it in place, nothing to copy
    assert m.swap_in(["a"]) == []
    assert m.block_table("a") == [0, 0, 0, 4] and m.num_free_cpu_blocks == 4
    assert m.swap_out(["a"]) == [(4, 1)]
    assert m.allocate_slots("x", 28, 0)  # every free block: block 4's hash is evicted
    m.free("x")  # queue [4, 3, 2, 1, 7, 6, 5]
    assert m.swap_in(["a"]) == [(1, 4)]  # copied back this time
    assert m.block_table("a") == [0, 0, 0, 4]
    assert m.match_prefix("b", tokens + [99]) == 16  # restored under its position's hash
    m.check_integrity()


def test_a_pool_without_lookback_keeps_everything():
    m = KVCacheManager(8, BS)
    assert m.null_block is None and m.num_usable_blocks == 8
    assert m.allocate_slots("a", 32, 0) and m.allocate_slots("a", 32, 31)
    assert m.block_table("a") == list(range(8))
    with pytest.raises(ValueError, match="null block"):
        KVCacheManager(0, BS, lookback=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_zero_block_clears_one_block_in_every_layer(dtype):
    cache = KVCache(num_layers=2, num_blocks=3, block_size=BS, num_kv_heads=1, head_dim=2,
                    dtype=dtype, device="cpu")
    cache.kv.view(torch.uint8).fill_(0xFF)  # all-one bits: NaN in each of these dtypes
    cache.zero_block(1)
    assert (cache.kv[:, :, 1].float() == 0).all()
    assert cache.kv[:, :, [0, 2]].float().isnan().all()

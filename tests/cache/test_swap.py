"""Swapping groups of sequences to CPU and back, with exact block ids."""

import pytest

from kiln.cache import KVCacheManager


def forked_pair(prefix: bool) -> KVCacheManager:
    """p and c share block 0 (full) after a fork; p CoW'd block 1 into block 2."""
    m = KVCacheManager(8, 4, enable_prefix_caching=prefix, num_cpu_blocks=8)
    tokens = list(range(6))
    assert m.allocate_slots("p", 6, 0)
    m.cache_full_blocks("p", tokens, 6)
    m.fork("p", "c")
    assert m.allocate_slots("p", 7, 6)
    assert m.take_pending_copies() == [(1, 2)]
    assert m.block_table("p") == [0, 2] and m.block_table("c") == [0, 1]
    return m


def test_swap_round_trip_preserves_sharing_and_frees_blocks():
    m = forked_pair(prefix=False)
    assert m.can_swap_out(["p", "c"])
    assert m.swap_out(["p", "c"]) == [(0, 0), (2, 1), (1, 2)]
    assert m.is_swapped("p") and m.is_swapped("c")
    assert m.num_free_blocks == 8 and m.num_free_cpu_blocks == 5
    assert m.gpu_pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert [m.cpu_pool.ref_count(b) for b in range(3)] == [2, 1, 1]
    m.check_integrity()
    with pytest.raises(KeyError, match="swapped out"):
        m.allocate_slots("p", 8, 7)
    assert m.can_swap_in(["p", "c"])
    assert m.swap_in(["p", "c"]) == [(0, 3), (1, 4), (2, 5)]
    assert m.block_table("p") == [3, 4] and m.block_table("c") == [3, 5]
    assert m.gpu_pool.ref_count(3) == 2
    assert m.num_free_cpu_blocks == 8 and not m.is_swapped("p")
    m.check_integrity()
    # Writing after swap-in: the restored sharing still triggers copy-on-write.
    m.fork("c", "d")
    assert m.allocate_slots("d", 7, 6)
    assert m.take_pending_copies() == [(5, 6)]


def test_swap_in_reuses_blocks_still_in_the_prefix_cache():
    m = forked_pair(prefix=True)  # block 0 is hashed
    assert m.swap_out(["p", "c"]) == [(0, 0), (2, 1), (1, 2)]
    assert m.gpu_pool.get_cached_block(m.gpu_pool.cached_block_ids().popitem()[0]) == 0
    assert m.swap_in(["p", "c"]) == [(1, 3), (2, 4)]  # cpu 0 revives gpu 0: no copy
    assert m.block_table("p") == [0, 3] and m.block_table("c") == [0, 4]
    m.check_integrity()


def test_swap_in_rehashes_evicted_full_blocks():
    m = forked_pair(prefix=True)
    m.swap_out(["p", "c"])
    assert m.allocate_slots("x", 32, 0)  # takes all 8 blocks: block 0's hash is evicted
    assert m.gpu_pool.cached_block_ids() == {}
    assert not m.can_swap_in(["p", "c"])
    with pytest.raises(RuntimeError, match="not enough free GPU blocks"):
        m.swap_in(["p", "c"])
    assert m.block_table("x") == [3, 4, 5, 6, 7, 2, 1, 0]
    m.free("x")  # tail first: the queue is [0, 1, 2, 7, 6, 5, 4, 3]
    assert m.swap_in(["p", "c"]) == [(0, 0), (1, 1), (2, 2)]
    assert m.gpu_pool.block_hash(0) is not None  # restored full block is findable again
    assert m.match_prefix("q", list(range(6))) == 4 and m.block_table("q") == [0]
    m.check_integrity()


def test_swap_out_needs_enough_cpu_blocks():
    m = KVCacheManager(8, 4, num_cpu_blocks=2)
    assert m.allocate_slots("a", 12, 0)
    assert not m.can_swap_out(["a"])
    with pytest.raises(RuntimeError, match="not enough free CPU blocks"):
        m.swap_out(["a"])
    assert m.block_table("a") == [0, 1, 2]
    m.check_integrity()


def test_free_swapped_sequence_returns_cpu_blocks():
    m = forked_pair(prefix=False)
    m.swap_out(["p", "c"])
    m.free("p")
    assert m.num_free_cpu_blocks == 6
    m.free("c")
    assert m.num_free_cpu_blocks == 8 and m.num_free_blocks == 8
    m.check_integrity()


def test_swap_out_reads_a_pending_copy_destination_from_its_source():
    """A group preempting itself after some of its sequences copied on write this step: the
    swap-out runs before the copies, so it reads the copy's source, and the copy is dropped."""
    m = KVCacheManager(8, 4, num_cpu_blocks=8)
    assert m.allocate_slots("p", 6, 0)
    m.fork("p", "c")
    assert m.allocate_slots("p", 7, 6)  # queues (1, 2), not yet executed
    assert m.block_table("p") == [0, 2]
    assert m.swap_out(["p"]) == [(0, 0), (1, 1)]
    assert m.take_pending_copies() == []
    assert m.block_table("c") == [0, 1] and m.gpu_pool.ref_count(2) == 0
    m.check_integrity()


def test_can_swap_in_counts_revived_cached_blocks_but_not_shared_ones():
    m = forked_pair(prefix=True)
    m.swap_out(["p", "c"])  # free queue [3, 4, 5, 6, 7, 2, 1, 0], block 0 still cached
    assert m.allocate_slots("x", 24, 0) and m.gpu_pool.free_block_ids() == [1, 0]
    # Reviving cached block 0 takes a free block too: 1 + 2 misses > 2 free.
    assert not m.can_swap_in(["p", "c"])
    m.free("x")
    assert m.match_prefix("q", list(range(6))) == 4 and m.block_table("q") == [0]
    assert m.allocate_slots("y", 20, 0) and m.gpu_pool.free_block_ids() == [4, 3]
    # Block 0 is now referenced by q: sharing it costs nothing, the 2 misses fit exactly.
    assert m.can_swap_in(["p", "c"])
    assert m.swap_in(["p", "c"]) == [(1, 4), (2, 3)]
    assert m.block_table("p") == [0, 4] and m.block_table("c") == [0, 3]
    assert m.gpu_pool.ref_count(0) == 3
    m.check_integrity()

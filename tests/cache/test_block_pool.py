import pytest

from kiln.cache import BlockPool, hash_block_tokens


def test_allocate_pops_least_recently_freed_first():
    pool = BlockPool(8, enable_prefix_caching=True)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    pool.release(1)
    pool.release(0)
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 1, 0]
    assert [pool.allocate() for _ in range(7)] == [3, 4, 5, 6, 7, 1, 0]
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError, match="no free blocks"):
        pool.allocate()


def test_cached_block_survives_free_until_popped():
    pool = BlockPool(4, enable_prefix_caching=True)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    block = pool.allocate()
    assert pool.cache_block(block, h)
    pool.release(block)
    assert pool.get_cached_block(h) == 0 and pool.free_block_ids() == [1, 2, 3, 0]
    pool.touch(0)  # revive: out of the free queue, hash kept
    assert pool.ref_count(0) == 1 and pool.free_block_ids() == [1, 2, 3]
    pool.release(0)
    assert [pool.allocate() for _ in range(3)] == [1, 2, 3]
    assert pool.get_cached_block(h) == 0
    assert pool.allocate() == 0  # popped for reuse: the hash is evicted
    assert pool.get_cached_block(h) is None and pool.block_hash(0) is None
    pool.check_integrity()


def test_cache_block_keeps_first_mapping_and_respects_disabled():
    pool = BlockPool(4, enable_prefix_caching=True)
    h = hash_block_tokens(None, [7] * 4)
    a, b = pool.allocate(), pool.allocate()
    assert pool.cache_block(a, h)
    assert not pool.cache_block(b, h)
    assert not pool.cache_block(a, h + 1)  # already hashed
    assert pool.cached_block_ids() == {h: a} and pool.block_hash(b) is None
    off = BlockPool(4, enable_prefix_caching=False)
    assert not off.cache_block(off.allocate(), h)
    assert off.cached_block_ids() == {}


def test_hash_chains_on_parent():
    h0 = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(h0, [3, 4]) == hash_block_tokens(h0, (3, 4))
    assert hash_block_tokens(h0, [3, 4]) != hash_block_tokens(None, [3, 4])


def test_release_unreferenced_raises():
    pool = BlockPool(2, enable_prefix_caching=False)
    with pytest.raises(RuntimeError, match="no references"):
        pool.release(0)


def test_check_integrity_catches_corruption():
    pool = BlockPool(4, enable_prefix_caching=True)
    a = pool.allocate()
    pool.check_integrity([[a]])
    with pytest.raises(AssertionError, match="table references"):
        pool.check_integrity([[a], [a]])
    pool.blocks[1].ref_count = 1  # referenced yet still in the free queue
    with pytest.raises(AssertionError, match="free queue with ref_count"):
        pool.check_integrity()
    pool.blocks[1].ref_count = 0
    pool.blocks[2].block_hash = 123  # hash not in the map
    with pytest.raises(AssertionError, match="missing from hash map"):
        pool.check_integrity()

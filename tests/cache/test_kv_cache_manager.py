"""KVCacheManager on tiny pools (8 blocks of 4 tokens) with exact block ids."""

import pytest

from kiln.cache import KVCacheManager

BS = 4


def make(num_gpu_blocks: int = 8, prefix: bool = True, num_cpu_blocks: int = 0) -> KVCacheManager:
    return KVCacheManager(
        num_gpu_blocks, BS, enable_prefix_caching=prefix, num_cpu_blocks=num_cpu_blocks
    )


def prefill(m: KVCacheManager, seq_id: str, tokens: list[int]) -> int:
    """Admit a prompt and pretend the forward pass computed all of it."""
    num_cached = m.match_prefix(seq_id, tokens)
    assert m.allocate_slots(seq_id, len(tokens), num_cached)
    m.cache_full_blocks(seq_id, tokens, len(tokens))
    m.check_integrity()
    return num_cached


def refs(m: KVCacheManager) -> list[int]:
    return [m.gpu_pool.ref_count(b) for b in range(m.gpu_pool.num_blocks)]


def test_allocate_new_blocks_and_usage():
    m = make()
    assert m.allocate_slots("a", 10, 0)
    assert m.block_table("a") == [0, 1, 2]
    assert m.allocate_slots("a", 12, 10)  # still fits in 3 blocks
    assert m.block_table("a") == [0, 1, 2]
    assert m.allocate_slots("a", 13, 12)
    assert m.block_table("a") == [0, 1, 2, 3]
    assert m.num_free_blocks == 4 and m.usage == 0.5
    assert m.num_blocks_needed(13) == 4 and m.num_blocks_needed(0) == 0
    m.check_integrity()


def test_allocate_failure_changes_nothing():
    m = make()
    assert m.allocate_slots("a", 20, 0)  # blocks 0-4
    assert m.allocate_slots("b", 8, 0)  # blocks 5, 6
    before = (m.block_table("a"), m.block_table("b"), m.gpu_pool.free_block_ids(), refs(m))
    assert not m.allocate_slots("b", 13, 8)  # needs 2, only block 7 free
    after = (m.block_table("a"), m.block_table("b"), m.gpu_pool.free_block_ids(), refs(m))
    assert after == before
    assert m.allocate_slots("b", 12, 8) and m.block_table("b") == [5, 6, 7]
    m.check_integrity()


def test_failed_first_allocation_does_not_register_the_sequence():
    m = make(num_gpu_blocks=2)
    assert not m.allocate_slots("a", 9, 0)
    with pytest.raises(KeyError, match="unknown"):
        m.block_table("a")
    assert m.match_prefix("a", [1, 2, 3]) == 0  # still a new sequence
    m.check_integrity()


def test_freeing_a_sequence_drops_its_pending_copies():
    m = make()
    prefill(m, "p", list(range(6)))
    m.fork("p", "c")
    assert m.allocate_slots("p", 7, 6) and m.block_table("p") == [0, 2]
    m.free("p")  # preempted (recompute) in the same step: the copy into block 2 is moot
    assert m.take_pending_copies() == []
    m.check_integrity()


def test_num_computed_tokens_is_validated():
    m = make()
    assert m.allocate_slots("a", 4, 0)
    with pytest.raises(ValueError, match="num_computed_tokens=5"):
        m.allocate_slots("a", 8, 5)  # cannot have written more than was reserved


def test_prefix_hit_across_requests():
    m = make()
    a = list(range(10))
    assert prefill(m, "a", a) == 0
    assert m.block_table("a") == [0, 1, 2]
    b = a[:8] + [99, 98, 97]
    assert m.match_prefix("b", b) == 8
    assert m.block_table("b") == [0, 1]
    assert refs(m)[:3] == [2, 2, 1]
    assert m.allocate_slots("b", 11, 8)
    assert m.block_table("b") == [0, 1, 3]
    assert (m.stats.prefix_cache_queries, m.stats.prefix_cache_hits) == (21, 8)
    # The third block differs (token 8), so a prompt diverging there gets two blocks only.
    assert m.match_prefix("c", a[:8] + [5, 6, 7, 8, 9]) == 8
    m.check_integrity()


def test_fully_cached_prompt_still_computes_its_last_token():
    m = make()
    prefill(m, "a", list(range(8)))  # two full blocks, both hashed
    assert m.gpu_pool.block_hash(0) is not None and m.gpu_pool.block_hash(1) is not None
    assert m.match_prefix("b", list(range(8))) == 4  # block 1 would hold the last token
    assert m.match_prefix("c", list(range(9))) == 8
    assert m.block_table("b") == [0] and m.block_table("c") == [0, 1]


def test_free_releases_tail_first_and_cached_blocks_revive():
    m = make()
    tokens = list(range(10))
    prefill(m, "a", tokens)
    m.free("a")
    assert m.gpu_pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert m.num_free_blocks == 8 and m.usage == 0.0
    assert prefill(m, "b", tokens) == 8
    # Blocks 0 and 1 were revived out of the queue; the partial tail needs a new block.
    assert m.block_table("b") == [0, 1, 3]
    assert m.gpu_pool.free_block_ids() == [4, 5, 6, 7, 2]


def test_lru_evicts_prefix_tail_before_head_and_older_requests_first():
    m = make()
    a, b = [1] * 9, [2] * 9
    prefill(m, "a", a)  # [0, 1, 2], blocks 0, 1 hashed
    prefill(m, "b", b)  # [3, 4, 5], blocks 3, 4 hashed
    m.free("a")
    m.free("b")
    assert m.gpu_pool.free_block_ids() == [6, 7, 2, 1, 0, 5, 4, 3]
    assert m.allocate_slots("x", 12, 0) and m.block_table("x") == [6, 7, 2]
    assert m.allocate_slots("y", 4, 0) and m.block_table("y") == [1]  # evicts a's 2nd block
    assert m.match_prefix("a2", a) == 4 and m.block_table("a2") == [0]
    assert m.match_prefix("b2", b) == 8 and m.block_table("b2") == [3, 4]
    assert m.allocate_slots("z", 4, 0) and m.block_table("z") == [5]
    m.check_integrity()


def test_duplicate_content_keeps_first_cached_block():
    m = make()
    tokens = list(range(5))
    m.match_prefix("a", tokens)
    m.match_prefix("b", tokens)  # nothing cached yet: both compute the same block
    assert m.allocate_slots("a", 5, 0) and m.allocate_slots("b", 5, 0)
    m.cache_full_blocks("a", tokens, 5)
    m.cache_full_blocks("b", tokens, 5)
    assert m.block_table("a") == [0, 1] and m.block_table("b") == [2, 3]
    assert list(m.gpu_pool.cached_block_ids().values()) == [0]
    assert m.gpu_pool.block_hash(2) is None
    m.free("a")
    m.free("b")
    assert m.match_prefix("c", tokens) == 4 and m.block_table("c") == [0]
    m.check_integrity()


def test_prefix_caching_disabled():
    m = make(prefix=False)
    prefill(m, "a", list(range(9)))
    assert m.match_prefix("b", list(range(9))) == 0
    assert m.block_table("b") == [] and m.gpu_pool.cached_block_ids() == {}
    assert (m.stats.prefix_cache_queries, m.stats.prefix_cache_hits) == (0, 0)


def test_fork_then_write_copies_the_shared_partial_block():
    m = make()
    prefill(m, "p", list(range(6)))  # [0, 1]; block 1 holds tokens 4, 5
    m.fork("p", "c")
    assert m.block_table("c") == [0, 1] and refs(m)[:2] == [2, 2]
    assert m.allocate_slots("p", 7, 6)  # writes position 6 into shared block 1
    assert m.block_table("p") == [0, 2]
    assert m.take_pending_copies() == [(1, 2)]
    assert m.take_pending_copies() == []
    assert m.allocate_slots("c", 7, 6)  # block 1 is c's alone now: written in place
    assert m.block_table("c") == [0, 1] and m.take_pending_copies() == []
    assert refs(m)[:3] == [2, 1, 1]
    m.check_integrity()


def test_fork_on_block_boundary_needs_no_copy():
    m = make()
    prefill(m, "p", list(range(8)))
    m.fork("p", "c")
    assert m.allocate_slots("p", 9, 8) and m.allocate_slots("c", 9, 8)
    assert m.block_table("p") == [0, 1, 2] and m.block_table("c") == [0, 1, 3]
    assert m.take_pending_copies() == []


def test_shared_reserved_but_unwritten_block_is_replaced_without_copy():
    m = make()
    assert m.allocate_slots("p", 12, 0)  # reserves 3 blocks, only 8 tokens get written
    m.fork("p", "c")
    assert m.allocate_slots("c", 9, 8)  # block 2 is shared but holds no KV yet
    assert m.block_table("c") == [0, 1, 3] and m.take_pending_copies() == []
    m.check_integrity()


def test_copy_on_write_counts_against_free_blocks():
    m = make(num_gpu_blocks=4)
    prefill(m, "p", list(range(6)))  # [0, 1]
    m.fork("p", "c")
    assert m.allocate_slots("x", 8, 0)  # takes the last two blocks
    before = (m.block_table("p"), m.gpu_pool.free_block_ids(), refs(m))
    assert not m.allocate_slots("p", 7, 6)
    assert (m.block_table("p"), m.gpu_pool.free_block_ids(), refs(m)) == before
    assert m.take_pending_copies() == []


def test_free_unknown_is_noop_and_bad_ids_raise():
    m = make()
    m.free("never-admitted")
    with pytest.raises(KeyError, match="unknown"):
        m.block_table("nope")
    m.allocate_slots("a", 4, 0)
    with pytest.raises(ValueError, match="already exists"):
        m.match_prefix("a", [1, 2])
    with pytest.raises(ValueError, match="already exists"):
        m.fork("a", "a")


def test_check_integrity_catches_table_drift():
    m = make()
    prefill(m, "a", list(range(9)))
    m._tables["a"].pop()  # table lost a block the pool still counts
    with pytest.raises(AssertionError, match="table references"):
        m.check_integrity()

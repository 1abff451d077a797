"""BlockPool: the physical blocks of one device, their ref counts, free LRU and prefix-hash map.

A block is in exactly one of three states:

- referenced: ref_count > 0, owned by one or more block tables;
- cached: ref_count == 0 but carries a content hash, so a later request with the same prefix
  can revive it (it sits in the free queue and is also findable in the hash map);
- free: ref_count == 0, no hash.

Cached and free blocks share one LRU queue: a block whose last reference is dropped goes to the
tail, allocation pops the head. A cached block loses its hash only when it is popped for reuse,
so a prefix survives until memory is actually needed.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def hash_block_tokens(parent_block_hash: int | None, token_ids: Sequence[int]) -> int:
    """Content hash of one full block, chained on the previous block's hash.

    Deterministic within a process (ints are never salted; hash(None) is only fixed across
    processes from Python 3.12), which is all the in-memory map needs. Chaining on the parent
    makes a block's hash stand for the whole prefix up to and including it.
    """
    return hash((parent_block_hash, tuple(token_ids)))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class BlockPool:
    """Fixed set of blocks 0..num_blocks-1 with ref counts, an LRU free queue and a hash map."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # OrderedDict as an O(1) LRU: head = least recently freed; reviving a cached block
        # removes it from the middle, which a deque cannot do cheaply.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0 (free or cached): what an allocation can take."""
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """Free queue in eviction order (head first); for tests and debugging."""
        return list(self._free)

    def cached_block_ids(self) -> dict[int, int]:
        """Copy of the prefix-hash map {block_hash: block_id}."""
        return dict(self._hash_to_block)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def block_hash(self, block_id: int) -> int | None:
        return self.blocks[block_id].block_hash

    def allocate(self) -> int:
        """Pop the least recently freed block, evict its hash, and give it one reference."""
        if not self._free:
            raise RuntimeError("BlockPool.allocate: no free blocks (check num_free_blocks first)")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self._hash_to_block[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def touch(self, block_id: int) -> None:
        """Take one more reference; a cached block is revived out of the free queue."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """Drop one reference; at zero the block goes to the free queue tail, keeping its hash."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"BlockPool.release: block {block_id} has no references")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def get_cached_block(self, block_hash: int) -> int | None:
        """Block id holding content with this hash (referenced or cached), or None."""
        return self._hash_to_block.get(block_hash)

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a full, computed block under its hash.

        Returns False (and changes nothing) if prefix caching is off, the block already has a
        hash, or another block already holds this hash: the first registered copy stays the
        one the map points at, the duplicate is freed as an ordinary block later.
        """
        block = self.blocks[block_id]
        if (
            not self.enable_prefix_caching
            or block.block_hash is not None
            or block_hash in self._hash_to_block
        ):
            return False
        assert block.ref_count > 0, f"cache_block: block {block_id} is not referenced"
        block.block_hash = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def check_integrity(self, tables: Iterable[Sequence[int]] | None = None) -> None:
        """Raise AssertionError naming the first broken invariant.

        tables, if given, must be every block table referencing this pool: each block's
        ref_count must then equal the number of table entries naming it.
        """
        refs: Counter[int] | None = None
        if tables is not None:
            refs = Counter()
            for table in tables:
                assert len(set(table)) == len(table), f"a block table lists a block twice: {table}"
                refs.update(table)
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has ref_count {block.ref_count}"
            if refs is not None:
                num_refs = refs[block.block_id]
                assert num_refs == block.ref_count, (
                    f"block {block.block_id}: ref_count {block.ref_count} but {num_refs} "
                    "table references"
                )
            in_free = block.block_id in self._free
            if block.ref_count > 0:
                assert not in_free, (
                    f"block {block.block_id} is in the free queue with ref_count {block.ref_count}"
                )
            else:
                assert in_free, f"block {block.block_id} has ref_count 0 but is not in free queue"
            if block.block_hash is not None:
                assert self._hash_to_block.get(block.block_hash) == block.block_id, (
                    f"block {block.block_id} has hash {block.block_hash} missing from hash map"
                )
        for block_hash, block_id in self._hash_to_block.items():
            assert self.blocks[block_id].block_hash == block_hash, (
                f"hash map entry {block_hash} -> {block_id} disagrees with the block's hash "
                f"{self.blocks[block_id].block_hash}"
            )
        assert len(self._free) == sum(b.ref_count == 0 for b in self.blocks), (
            "free queue holds duplicate or unknown block ids"
        )

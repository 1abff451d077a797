"""KVCacheManager: per-sequence block tables over a BlockPool (prefix reuse, CoW, fork, swap,
freeing the blocks that fell out of every layer's sliding window: kiln/cache/window.py).

The manager only does bookkeeping; data moves happen in KVCache when the engine executes the
pairs this class hands out. Within one engine step, execute them in this order: swap_out
pairs, take_pending_copies(), swap_in pairs, then the forward pass. A block freed during the
step may be handed out again in the same step, and this order reads its old data before
anything writes the new. It holds if the scheduler, like vLLM's v0 one, never swaps in during
a step that swapped out (a CPU block freed by the swap-in could be overwritten first).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from kiln.cache.block_pool import BlockPool, hash_block_tokens
from kiln.cache.window import num_unreachable_blocks


@dataclass
class CacheStats:
    """Prefix-cache counters in tokens (a request re-queried after waiting counts again)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.prefix_cache_hits / max(self.prefix_cache_queries, 1)


class KVCacheManager:
    """Block tables for sequences identified by any hashable seq_id.

    Per sequence it tracks the block table (GPU ids while running, CPU ids while swapped out),
    the number of token slots reserved (the largest num_tokens granted by allocate_slots, or
    the match_prefix count), and the chain hashes of its computed full blocks.

    With a ``lookback`` (every layer slides; see kiln/cache/window.py) the leading blocks that
    attention can no longer reach are given back as the sequence advances: its table then holds
    only the blocks after them, and ``block_table`` names the null block in their place.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
        lookback: int | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if lookback is not None and (lookback < 0 or num_gpu_blocks < 1):
            raise ValueError(f"lookback must be >= 0 and the pool hold a null block, got "
                             f"lookback={lookback}, num_gpu_blocks={num_gpu_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.lookback = lookback
        self.gpu_pool = BlockPool(num_gpu_blocks, enable_prefix_caching)
        # what freed table entries name: held here for good, so nothing allocates (or writes) it
        self.null_block = self.gpu_pool.allocate() if lookback is not None else None
        # CPU blocks only need ref counts and a free list; prefix lookups stay on the GPU pool.
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_prefix_caching=False)
        self._tables: dict[Hashable, list[int]] = {}  # running: GPU block ids
        self._cpu_tables: dict[Hashable, list[int]] = {}  # swapped out: CPU block ids
        self._num_tokens: dict[Hashable, int] = {}  # reserved slots, running or swapped
        self._block_hashes: dict[Hashable, list[int]] = {}  # chain hashes of full blocks
        self._num_freed: dict[Hashable, int] = {}  # leading blocks given back, out of reach
        self._pending_copies: list[tuple[int, int]] = []
        self.stats = CacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.gpu_pool.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """GPU blocks sequences can hold: all but the null block."""
        return self.gpu_pool.num_blocks - (self.null_block is not None)

    @property
    def usage(self) -> float:
        """Fraction of usable GPU blocks referenced by some sequence (cached free blocks count as
        free)."""
        total = self.num_usable_blocks
        return (total - self.gpu_pool.num_free_blocks) / total if total else 0.0

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Copy of a running sequence's GPU block table, the null block in the entries given
        back."""
        table = self._running_table(seq_id, "block_table")
        return [self.null_block] * self._num_freed[seq_id] + table

    def is_swapped(self, seq_id: Hashable) -> bool:
        return seq_id in self._cpu_tables

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src, dst) GPU block copies owed by copy-on-write; the caller must execute them."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def match_prefix(self, seq_id: Hashable, token_ids: Sequence[int],
                     use_cache: bool = True) -> int:
        """Start a new sequence on the longest cached prefix; return the tokens it covers.

        ``use_cache=False`` starts it empty (0), e.g. for prompt logprobs, which need every
        position computed: registered all the same, so that a swap finds its (empty) table.

        Only blocks lying wholly inside token_ids[:-1] can match, so at least the last prompt
        token is always computed (it yields the logits to sample from), and since a match ends
        on a block boundary the first write lands in a fresh block, never a shared one.
        References are taken at once: if the following allocate_slots fails, free(seq_id).

        With a lookback the match need not start at block 0 (vLLM's sliding-window match): it is
        the longest prefix whose blocks from the first one its computation can reach are all
        cached, those before starting out given back (a long prompt's first blocks, freed first
        while it was generated from, are also the first evicted).
        """
        if seq_id in self._num_tokens:
            raise ValueError(f"match_prefix: sequence {seq_id!r} already exists")
        table = self._new_seq(seq_id)
        if not (self.enable_prefix_caching and use_cache):
            return 0
        hashes = self._block_hashes[seq_id]
        bs = self.block_size
        num_hit = run_start = 0  # run_start: the first block of the run of cached blocks
        for i in range((len(token_ids) - 1) // bs):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                            token_ids[i * bs : (i + 1) * bs]))
            if self.gpu_pool.get_cached_block(hashes[-1]) is None:
                if self.lookback is None:
                    break
                run_start = i + 1
            elif run_start <= self._num_unreachable((i + 1) * bs):
                num_hit = i + 1
        del hashes[num_hit:]
        num_matched = num_hit * bs
        num_freed = self._num_freed[seq_id] = self._num_unreachable(num_matched)
        for block_hash in hashes[num_freed:]:
            block_id = self.gpu_pool.get_cached_block(block_hash)
            self.gpu_pool.touch(block_id)
            table.append(block_id)
        self._num_tokens[seq_id] = num_matched
        self.stats.prefix_cache_queries += len(token_ids)
        self.stats.prefix_cache_hits += num_matched
        return num_matched

    def allocate_slots(self, seq_id: Hashable, num_tokens: int, num_computed_tokens: int) -> bool:
        """Reserve num_tokens slots in total; this step writes [num_computed_tokens, num_tokens).

        num_computed_tokens is the number of tokens whose KV is already written (the caller's
        source of truth, not inferred here). Every block the step writes into that is shared
        (ref_count > 1, e.g. after fork) is replaced by a fresh block first (copy-on-write);
        if it already holds written KV, a (src, dst) copy is queued for take_pending_copies.
        With a lookback, the leading blocks that attention from num_computed_tokens on cannot
        reach are given back first (a step never goes back: later ones cannot either), and those
        that this frees count as free.
        Returns False and changes nothing if new + CoW blocks exceed the free blocks.
        An unknown seq_id starts a new sequence, registered only if the allocation succeeds.
        """
        is_new = seq_id not in self._num_tokens
        table = [] if is_new else self._running_table(seq_id, "allocate_slots")
        reserved = 0 if is_new else self._num_tokens[seq_id]
        bs = self.block_size
        num_freed = 0 if is_new else self._num_freed[seq_id]
        if not num_freed * bs <= num_computed_tokens <= min(num_tokens, reserved):
            raise ValueError(
                f"allocate_slots({seq_id!r}): num_computed_tokens={num_computed_tokens} must be "
                f"in [{num_freed * bs} (the blocks before are given back), "
                f"min(num_tokens={num_tokens}, reserved={reserved})]"
            )
        # table[:num_gone] go out of reach now; indices below are into what follows them
        num_gone = max(0, self._num_unreachable(num_computed_tokens) - num_freed)
        num_required = self.num_blocks_needed(num_tokens) - num_freed - num_gone
        num_new = max(0, num_required - (len(table) - num_gone))
        written = range(num_computed_tokens // bs - num_freed - num_gone,
                        min(len(table) - num_gone, num_required))
        cow = [i for i in written if self.gpu_pool.ref_count(table[num_gone + i]) > 1]
        reclaimed = sum(self.gpu_pool.ref_count(b) == 1 for b in table[:num_gone])
        if num_new + len(cow) > self.gpu_pool.num_free_blocks + reclaimed:
            return False
        if num_gone:
            for block_id in table[:num_gone]:
                self.gpu_pool.release(block_id)
            del table[:num_gone]
            self._num_freed[seq_id] = num_freed + num_gone
        for i in cow:
            src = table[i]
            table[i] = self.gpu_pool.allocate()
            self.gpu_pool.release(src)  # was shared, so it stays referenced by the others
            if i * bs < num_computed_tokens:
                self._pending_copies.append((src, table[i]))
        table.extend(self.gpu_pool.allocate() for _ in range(num_new))
        if is_new:
            self._new_seq(seq_id).extend(table)
        self._num_tokens[seq_id] = max(reserved, num_tokens)
        return True

    def cache_full_blocks(
        self, seq_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Hash every full block in [0, num_computed_tokens) not hashed yet (after a forward).

        A hash already in the map keeps its existing block; the sequence still records the hash
        so later blocks chain correctly.
        """
        if not self.enable_prefix_caching:
            return
        table = self._running_table(seq_id, "cache_full_blocks")
        bs = self.block_size
        num_freed = self._num_freed[seq_id]
        capacity = (num_freed + len(table)) * bs
        assert num_computed_tokens <= min(len(token_ids), capacity), (
            f"cache_full_blocks({seq_id!r}): {num_computed_tokens} computed tokens exceed "
            f"{len(token_ids)} token ids or table capacity {capacity}"
        )
        hashes = self._block_hashes[seq_id]
        # a step's blocks are hashed before the next step is allocated, and only that frees them
        assert len(hashes) >= num_freed, f"cache_full_blocks({seq_id!r}): freed before hashed"
        for i in range(len(hashes), num_computed_tokens // bs):
            parent = hashes[-1] if hashes else None
            block_hash = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            self.gpu_pool.cache_block(table[i - num_freed], block_hash)
            hashes.append(block_hash)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Give child_id the parent's blocks (shared, ref_count + 1); writes will CoW them."""
        table = self._running_table(parent_id, "fork")
        if child_id in self._num_tokens:
            raise ValueError(f"fork: child sequence {child_id!r} already exists")
        for block_id in table:
            self.gpu_pool.touch(block_id)
        self._tables[child_id] = list(table)
        self._num_tokens[child_id] = self._num_tokens[parent_id]
        self._block_hashes[child_id] = list(self._block_hashes[parent_id])
        self._num_freed[child_id] = self._num_freed[parent_id]

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence (running or swapped); unknown ids are ignored (abort before start).

        Tail blocks are released first so they sit nearer the free-queue head: a prompt's
        first blocks, the ones most likely to be shared again, are evicted last.
        """
        if seq_id in self._tables:
            pool, table = self.gpu_pool, self._tables.pop(seq_id)
        elif seq_id in self._cpu_tables:
            pool, table = self.cpu_pool, self._cpu_tables.pop(seq_id)
        else:
            return
        for block_id in reversed(table):
            pool.release(block_id)
        del self._num_tokens[seq_id]
        del self._block_hashes[seq_id]
        del self._num_freed[seq_id]
        if self._pending_copies:
            # A copy into a block freed this step is moot, and its dst may be reallocated as
            # another copy's dst: two writes to one block in one batched copy have no order.
            self._pending_copies = [
                (src, dst) for src, dst in self._pending_copies if self.gpu_pool.ref_count(dst)
            ]

    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        blocks = {b for s in seq_ids for b in self._running_table(s, "can_swap_out")}
        return len(blocks) <= self.cpu_pool.num_free_blocks

    def swap_out(self, seq_ids: Sequence[Hashable]) -> list[tuple[int, int]]:
        """Move a group (e.g. forked siblings) to CPU; returns (gpu_block, cpu_block) pairs.

        A GPU block shared inside the group gets one CPU block shared the same way. A block
        still waiting for its copy-on-write (a group preempting itself after some of its
        sequences were allocated this step) is read from the copy's source instead: the copy
        would run after the swap read it, and once its destination is freed it is moot.
        """
        if not self.can_swap_out(seq_ids):
            raise RuntimeError(f"swap_out: not enough free CPU blocks for {list(seq_ids)!r}")
        gpu_to_cpu: dict[int, int] = {}
        for seq_id in seq_ids:
            gpu_table = self._tables.pop(seq_id)
            cpu_table = []
            for gpu in gpu_table:
                if gpu in gpu_to_cpu:
                    self.cpu_pool.touch(gpu_to_cpu[gpu])
                else:
                    gpu_to_cpu[gpu] = self.cpu_pool.allocate()
                cpu_table.append(gpu_to_cpu[gpu])
            for gpu in reversed(gpu_table):
                self.gpu_pool.release(gpu)
            self._cpu_tables[seq_id] = cpu_table
        copied_from = {dst: src for src, dst in self._pending_copies}
        # the source is still referenced (it was shared) and swap-outs run first in the step
        self._pending_copies = [(src, dst) for src, dst in self._pending_copies
                                if dst not in gpu_to_cpu]
        return [(copied_from.get(gpu, gpu), cpu) for gpu, cpu in gpu_to_cpu.items()]

    def can_swap_in(self, seq_ids: Iterable[Hashable], reserve: int = 0) -> bool:
        """Whether the group fits with ``reserve`` blocks still free after it."""
        needed = self._num_swap_in_blocks(*self._plan_swap_in(seq_ids))
        return needed + reserve <= self.num_free_blocks

    def swap_in(self, seq_ids: Sequence[Hashable]) -> list[tuple[int, int]]:
        """Bring a swapped group back; returns (cpu_block, gpu_block) pairs to copy.

        A full block whose hash is still in the GPU prefix map is reused in place (no copy);
        the others get fresh GPU blocks, with sharing inside the group preserved.
        """
        hits, misses = self._plan_swap_in(seq_ids)
        if self._num_swap_in_blocks(hits, misses) > self.num_free_blocks:
            raise RuntimeError(f"swap_in: not enough free GPU blocks for {list(seq_ids)!r}")
        # Hold each target once before allocating, so allocation cannot evict a hit.
        cpu_to_gpu = dict(hits)
        for gpu in hits.values():
            self.gpu_pool.touch(gpu)
        pairs = [(cpu, self.gpu_pool.allocate()) for cpu in misses]
        cpu_to_gpu.update(pairs)
        for seq_id in seq_ids:
            cpu_table = self._cpu_tables.pop(seq_id)
            hashes = self._kept_block_hashes(seq_id)
            table = self._tables[seq_id] = [cpu_to_gpu[cpu] for cpu in cpu_table]
            for i, gpu in enumerate(table):
                self.gpu_pool.touch(gpu)
                if i < len(hashes):  # make restored full blocks findable again
                    self.gpu_pool.cache_block(gpu, hashes[i])
            for cpu in reversed(cpu_table):
                self.cpu_pool.release(cpu)
        for gpu in cpu_to_gpu.values():
            self.gpu_pool.release(gpu)  # drop the holds; the tables keep their references
        return pairs

    def _plan_swap_in(self, seq_ids: Iterable[Hashable]) -> tuple[dict[int, int], list[int]]:
        """Split the group's distinct CPU blocks into hash hits {cpu: gpu} and misses."""
        hits: dict[int, int] = {}
        misses: list[int] = []
        seen: set[int] = set()
        for seq_id in seq_ids:
            if seq_id not in self._cpu_tables:
                raise KeyError(f"swap in: sequence {seq_id!r} is not swapped out")
            hashes = self._kept_block_hashes(seq_id)
            for i, cpu in enumerate(self._cpu_tables[seq_id]):
                if cpu in seen:
                    continue
                seen.add(cpu)
                gpu = self.gpu_pool.get_cached_block(hashes[i]) if i < len(hashes) else None
                if gpu is None:
                    misses.append(cpu)
                else:
                    hits[cpu] = gpu
        return hits, misses

    def _num_swap_in_blocks(self, hits: dict[int, int], misses: list[int]) -> int:
        revived = {gpu for gpu in hits.values() if self.gpu_pool.ref_count(gpu) == 0}
        return len(misses) + len(revived)

    def _kept_block_hashes(self, seq_id: Hashable) -> list[int]:
        """The hashes of the full blocks the sequence still holds (its table's, in order)."""
        return self._block_hashes[seq_id][self._num_freed[seq_id]:]

    def _num_unreachable(self, first_query_pos: int) -> int:
        return num_unreachable_blocks(first_query_pos, self.lookback, self.block_size)

    def _new_seq(self, seq_id: Hashable) -> list[int]:
        table: list[int] = []
        self._tables[seq_id] = table
        self._num_tokens[seq_id] = 0
        self._block_hashes[seq_id] = []
        self._num_freed[seq_id] = 0
        return table

    def _running_table(self, seq_id: Hashable, op: str) -> list[int]:
        table = self._tables.get(seq_id)
        if table is None:
            state = "swapped out" if seq_id in self._cpu_tables else "unknown"
            raise KeyError(f"{op}: sequence {seq_id!r} is {state}, not running")
        return table

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant; cheap enough for tests."""
        both = self._tables.keys() & self._cpu_tables.keys()
        assert not both, f"sequences both running and swapped: {both}"
        known = self._tables.keys() | self._cpu_tables.keys()
        assert (self._num_tokens.keys() == known == self._block_hashes.keys()
                == self._num_freed.keys()), (
            "per-sequence bookkeeping dicts disagree on which sequences exist"
        )
        held = [] if self.null_block is None else [[self.null_block]]  # the manager's own
        self.gpu_pool.check_integrity([*self._tables.values(), *held])
        self.cpu_pool.check_integrity(self._cpu_tables.values())
        for seq_id, table in (self._tables | self._cpu_tables).items():
            num_blocks = self._num_freed[seq_id] + len(table)
            assert num_blocks * self.block_size >= self._num_tokens[seq_id], (
                f"{seq_id!r}: {num_blocks} blocks cannot hold {self._num_tokens[seq_id]} tokens"
            )
            assert len(self._block_hashes[seq_id]) <= num_blocks, (
                f"{seq_id!r}: more block hashes than blocks"
            )
            assert self.lookback is not None or not self._num_freed[seq_id], (
                f"{seq_id!r}: blocks given back without a lookback"
            )

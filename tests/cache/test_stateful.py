"""Random add / step / fork / abort / swap sequences, checked against a model of KV contents.

The model writes, for token p of a sequence, a value standing for its KV (a hash of the tokens
up to p) into the block the manager's table names, and replays the copy and swap pairs the
manager hands out. After every rule each running sequence must read back its own values for
every computed token: that checks prefix matches, copy-on-write and swaps end to end, beyond
the bookkeeping that check_integrity() verifies. With a lookback (every layer slides, see
kiln/cache/window.py) the blocks a sequence gave back name the null block instead, which nothing
writes, and only for tokens that no later step can reach.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kiln.cache import KVCacheManager

BS = 4
NUM_GPU_BLOCKS = 10  # small enough that allocations fail and cached blocks get evicted
NUM_CPU_BLOCKS = 8
tokens_st = st.integers(0, 2)
# Prompts start with a slice of one of two system prompts so that full blocks repeat often.
SYSTEM_PROMPTS = ([0, 1, 2, 0, 1, 2, 0, 1], [2, 2, 1, 1, 0, 0, 2, 2])
prompt_st = st.builds(
    lambda system, cut, tail: system[:cut] + tail,
    st.sampled_from(SYSTEM_PROMPTS),
    st.integers(0, 8),
    st.lists(tokens_st, max_size=6),
).filter(len)


def kv_value(tokens: list[int], pos: int) -> int:
    return hash(tuple(tokens[: pos + 1]))


class CacheMachine(RuleBasedStateMachine):
    @initialize(prefix=st.booleans(), lookback=st.sampled_from([None, 0, 5]))
    def setup(self, prefix: bool, lookback: int | None) -> None:
        self.prefix = prefix
        self.lookback = lookback
        self.m = KVCacheManager(NUM_GPU_BLOCKS, BS, prefix, num_cpu_blocks=NUM_CPU_BLOCKS,
                                lookback=lookback)
        self.gpu: dict[int, dict[int, int]] = {}  # block -> {offset: kv value}
        self.cpu: dict[int, dict[int, int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.group: dict[int, int] = {}  # seq -> id of the request its samples belong to
        self.swapped: set[int] = set()
        self.next_id = 0

    def running(self) -> list[int]:
        return sorted(s for s in self.tokens if s not in self.swapped)

    def members(self, group: int) -> list[int]:
        return sorted(s for s, g in self.group.items() if g == group)

    def snapshot(self) -> tuple:
        pool = self.m.gpu_pool
        return (
            pool.free_block_ids(),
            [pool.ref_count(b) for b in range(NUM_GPU_BLOCKS)],
            pool.cached_block_ids(),
            {s: self.m.block_table(s) for s in self.running()},
        )

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule(prompt=prompt_st)
    def add(self, prompt: list[int]) -> None:
        seq = self.new_id()
        num_cached = self.m.match_prefix(seq, prompt)
        assert 0 <= num_cached < len(prompt) and num_cached % BS == 0
        assert self.prefix or num_cached == 0
        self.tokens[seq], self.computed[seq], self.group[seq] = list(prompt), num_cached, seq

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One engine step: allocate for a few sequences (preempting some right after, as a
        scheduler short of blocks does), run the copies, then write the scheduled tokens."""
        batch = data.draw(st.lists(st.sampled_from(self.running()), min_size=1, max_size=3))
        scheduled: dict[int, tuple[int, int]] = {}
        for seq in dict.fromkeys(batch):
            tokens, start = self.tokens[seq], self.computed[seq]
            if start == len(tokens):  # decode: the token sampled last step needs its KV
                tokens.append(data.draw(tokens_st))
            end = min(start + data.draw(st.integers(1, 8)), len(tokens))
            lookahead = data.draw(st.integers(0, 3))  # reserved slots left unwritten
            before = self.snapshot()
            if self.m.allocate_slots(seq, end + lookahead, start):
                scheduled[seq] = (start, end)
            else:
                assert self.snapshot() == before, "failed allocate_slots changed state"
            if scheduled and data.draw(st.integers(0, 3)) == 0:  # preempt 1 in 4
                victim = data.draw(st.sampled_from(sorted(scheduled)))
                del scheduled[victim]
                self.forget(victim)
        copies = self.m.take_pending_copies()
        dsts = [dst for _, dst in copies]
        assert len(set(dsts)) == len(dsts), f"one block is the dst of two copies: {copies}"
        owned = {b for seq in scheduled for b in self.m.block_table(seq)}
        assert set(dsts) <= owned, f"copy into a block no scheduled sequence owns: {copies}"
        self.gpu.update({dst: dict(self.gpu.get(src, {})) for src, dst in copies})
        for seq, (start, end) in scheduled.items():
            table, tokens = self.m.block_table(seq), self.tokens[seq]
            for pos in range(start, end):
                block = table[pos // BS]
                assert block != self.m.null_block, f"seq {seq} writes the null block at {pos}"
                assert self.m.gpu_pool.ref_count(block) == 1, f"write into shared block {block}"
                self.gpu.setdefault(block, {})[pos % BS] = kv_value(tokens, pos)
            self.computed[seq] = end
            self.m.cache_full_blocks(seq, tokens, end)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.running()))
        child = self.new_id()
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]
        self.group[child] = self.group[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.forget(data.draw(st.sampled_from(sorted(self.tokens))))

    def forget(self, seq: int) -> None:
        self.m.free(seq)
        for d in (self.tokens, self.computed, self.group):
            del d[seq]
        self.swapped.discard(seq)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        group = self.members(self.group[data.draw(st.sampled_from(self.running()))])
        distinct = {b for s in group for b in self.m.block_table(s)} - {self.m.null_block}
        if not self.m.can_swap_out(group):
            assert len(distinct) > self.m.num_free_cpu_blocks
            return
        pairs = self.m.swap_out(group)
        assert sorted(gpu for gpu, _ in pairs) == sorted(distinct)
        assert len({cpu for _, cpu in pairs}) == len(pairs)
        for gpu, cpu in pairs:
            self.cpu[cpu] = dict(self.gpu.get(gpu, {}))
        self.swapped.update(group)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        group = self.members(self.group[data.draw(st.sampled_from(sorted(self.swapped)))])
        if not self.m.can_swap_in(group):
            return
        for cpu, gpu in self.m.swap_in(group):
            self.gpu[gpu] = dict(self.cpu[cpu])
        self.swapped.difference_update(group)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check_integrity()
        assert self.m.take_pending_copies() == []
        for seq in self.running():
            table, tokens = self.m.block_table(seq), self.tokens[seq]
            num_freed = table.count(self.m.null_block)
            assert table[:num_freed] == [self.m.null_block] * num_freed, table
            # a freed block's keys are all out of reach of the next step, which starts here
            assert not num_freed or num_freed * BS + self.lookback <= self.computed[seq], (
                seq, table)
            for pos in range(num_freed * BS, self.computed[seq]):
                got = self.gpu.get(table[pos // BS], {}).get(pos % BS)
                assert got == kv_value(tokens, pos), f"seq {seq} reads wrong KV at {pos}"

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for seq in list(self.tokens):
            self.m.free(seq)
        self.m.check_integrity()
        assert self.m.num_free_blocks == self.m.num_usable_blocks and self.m.usage == 0.0
        assert self.m.num_free_cpu_blocks == NUM_CPU_BLOCKS


CacheMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase

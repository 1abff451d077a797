"""Continuous batching: which sequences run this step, and how many tokens each.

Every step has a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``). Running requests go first (a decode costs one token, an unfinished prompt a
chunk of what is left), then swapped requests come back, then waiting requests are admitted in
arrival order with as much of their prompt as the budget allows. When KV blocks run out, the most
recently arrived running request is preempted whole: by recompute (its blocks are freed; its
prompt and outputs are prefilled again later) or by swap (its blocks move to CPU memory). When
every layer slides, each allocation first gives back the sequence's blocks out of every window
(kiln/cache/window.py), and those count as free.

A swapped request comes back only with a block left free for each running sequence
(``can_swap_in_next``): swapped into the last free blocks it would be, as the newest arrival,
what the next decode crossing a block boundary preempts again before it computed a token, its
KV copied out and back for nothing (on an H100, 32 requests of an 8B model over 700 blocks: 87
swaps in three rounds without the reserve, 53 with it, rounds 7.5% shorter;
benchmarks/results/h100/swap_reserve_ab.txt). Readmission after a recompute preemption keeps
no reserve: it computes at least the token its prefill samples, and the same reserve there cost
more steps than the prefills it saved (CPU runs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.cache.kv_cache_manager import KVCacheManager
from kiln.config import SchedulerConfig
from kiln.engine.request import Request, RequestStatus
from kiln.engine.sequence import Sequence


@dataclass
class ScheduledSeq:
    request: Request
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, starting at `start`
    # tokens an earlier step still in flight computes for this sequence (async scheduling):
    # this step starts after them and feeds the token that step is sampling
    pending: int = 0

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens + self.pending

    @property
    def samples(self) -> bool:
        """This chunk reaches the sequence's last token, so its logits pick the next one (past
        it: a decode row whose input is the token the step in flight samples)."""
        return self.start + self.num_new_tokens >= self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.num_preemptions = 0
        self.num_swap_outs = 0

    # ---- queue management ----------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def free_request(self, request: Request) -> None:
        for seq in request.seqs:
            self.kv.free(seq.seq_id)

    def remove(self, request: Request) -> None:
        """Take a request out of whichever queue holds it and release its blocks."""
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        self.free_request(request)

    def num_running_seqs(self) -> int:
        return sum(len(r.active_seqs()) for r in self.running)

    def can_swap_in_next(self) -> bool:
        """Whether the first swapped request may come back now, leaving a free block for each
        running sequence (see the module docstring)."""
        if not self.swapped:
            return False
        seq_ids = [s.seq_id for s in self.swapped[0].active_seqs()]
        num_seqs = self.num_running_seqs()
        return (num_seqs + len(seq_ids) <= self.config.max_num_seqs
                and self.kv.can_swap_in(seq_ids, reserve=num_seqs))

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda r: r.arrival_time)
        queue = list(self.running)
        kept: list[Request] = []
        while queue:
            request = queue.pop(0)
            chunks = self._chunks(request, budget)
            if chunks is None:  # budget exhausted: stays running, scheduled next step
                kept.append(request)
                continue
            while not self._allocate(chunks):
                # newest arrival first; the queue is sorted, so its tail is the newest
                victim = queue.pop() if queue else request
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                kept.append(request)
                out.scheduled += [ScheduledSeq(request, s, n) for s, n in chunks]
                budget -= sum(n for _, n in chunks)
        self.running = kept
        if out.num_preempted == 0:
            self._swap_in(out)
            budget = self.admit_waiting(out, budget)
        out.copies = self.kv.take_pending_copies()
        return out

    def _chunks(self, request: Request, budget: int) -> list[tuple[Sequence, int]] | None:
        """(sequence, tokens to compute) for the request's sequences that fit the budget, or None.

        A prompt may be cut to fit what is left. The samples of a request advance within one
        step when the budget allows; when it does not (a preempted multi-sample request
        re-prefilling), the first ones advance now and the rest in later steps.
        """
        chunks, left = [], budget
        for seq in request.active_seqs():
            take = min(seq.num_tokens - seq.num_computed_tokens, left)
            if take <= 0:
                break
            chunks.append((seq, take))
            left -= take
        return chunks or None

    def _allocate(self, chunks: list[tuple[Sequence, int]]) -> bool:
        return all(self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + n,
                                          seq.num_computed_tokens) for seq, n in chunks)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        out.num_preempted += 1
        seq_ids = [s.seq_id for s in request.active_seqs()]
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(seq_ids):
            out.swap_out += self.kv.swap_out(seq_ids)
            self.num_swap_outs += 1
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            return
        self.free_request(request)
        for seq in request.seqs:
            seq.num_computed_tokens = 0  # prompt and outputs are prefilled again on readmission
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _swap_in(self, out: SchedulerOutput) -> None:
        while self.can_swap_in_next():
            request = self.swapped.popleft()
            out.swap_in += self.kv.swap_in([s.seq_id for s in request.active_seqs()])
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def admit_waiting(self, out: SchedulerOutput, budget: int,
                      admissible: Callable[[Request], bool] | None = None) -> int:
        """Start waiting requests in arrival order with what is left of the step's budget,
        stopping at the first that does not fit (or that ``admissible`` refuses); returns the
        budget left."""
        # requests come back from swap before new ones start, to keep the order fair
        if self.swapped:
            return budget
        num_seqs = self.num_running_seqs()
        while self.waiting and budget > 0:
            request = self.waiting[0]
            seqs = request.active_seqs()
            if (num_seqs + len(seqs) > self.config.max_num_seqs
                    or (admissible is not None and not admissible(request))):
                break
            for seq in seqs:
                if seq.num_computed_tokens == 0:
                    # Every sequence is registered, even one the budget leaves for a later
                    # step (a readmitted n > 1 request): a swap preemption moves them all.
                    # Prompt logprobs need every position computed, so they skip the cache.
                    seq.num_computed_tokens = self.kv.match_prefix(
                        seq.seq_id, seq.token_ids, use_cache=request.prompt_logprobs is None)
                    if request.metrics.first_token_time is None:
                        request.metrics.num_cached_tokens = seq.num_computed_tokens
            chunks = self._chunks(request, budget)
            if chunks is None or not self._allocate(chunks):
                self.free_request(request)  # drop prefix references; nothing was computed
                for seq in seqs:
                    seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled += [ScheduledSeq(request, s, n) for s, n in chunks]
            budget -= sum(n for _, n in chunks)
            num_seqs += len(seqs)
        return budget

"""Async scheduling: launch step N+1 before step N's sampled tokens reach the host.

A synchronous engine leaves the GPU idle while the host reads step N's tokens, appends them,
checks stops, schedules and builds step N+1's inputs (about 0.35 ms a step at batch 1 on an
H100, several ms at batch 512, and the whole Python launch of an eager forward, ~37 ms for an
8B model, when step N+1 carries a prompt chunk). When step N is a plain continuation (nothing
the host does with its tokens changes what step N+1 computes), step N+1 is scheduled at once:
each sequence that sampled in step N advances one position with step N's sampled token as its
input, read on the device, and each prompt cut short by the token budget takes its next chunk.
Only then does the host wait for step N and apply it, while the GPU runs step N+1.

What only step N's tokens on the host can tell is handled one step late:

- a sequence that stopped at step N (EOS, a stop id or string, an abort) computed one more
  token in step N+1; its row is dropped when step N+1 is applied. The KV it wrote lands in a
  block freed meanwhile, which is safe because the GPU runs steps in order: a later owner of
  that block writes it afterwards. The same order covers the blocks step N+1's allocation gives
  back out of every sliding window (kiln/cache/window.py) while step N, still running, may read
  them.
- a sequence whose length limit step N reaches is known on the host and left out of step N+1.

Waiting requests are admitted into step N+1 with the budget the continuations leave, as the
scheduler would admit them (a new prompt depends on no token of step N), so a stream of arrivals
(the first 8192-token steps of a 512-request batch, a busy server) keeps the host's scheduling,
input building and updates under the GPU's work instead of between steps. Blocks freed by
sequences that stop at step N are known only when it is applied: an admission they would have
made room for waits a step.

Sampling that reads the host's outputs (a grammar's mask comes from the matcher step N's token
advances, penalties count the tokens, min_tokens bans EOS until enough are out, a bad word of
several tokens is banned after its prefix) chains with the wait moved inside the step: a
chained step holding such a row (``samples_from_host``) launches its forward, then waits for
step N and applies it, and only then builds its sampling inputs and launches the sampling. The
GPU runs the forward meanwhile, where the synchronous path would leave it idle for the host's
whole update, scheduling and input building.

Logprobs travel with the tokens: pinned copies queued behind the step.

Everything else takes the synchronous path: a waiting request the chain cannot start (see
``_admissible``), a swapped request with room to come back, prompt logprobs, the fork of n > 1
samples, and KV blocks running out (preemption).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kiln.cache.kv_cache_manager import KVCacheManager
from kiln.engine.model_runner import StepResult
from kiln.engine.request import Request
from kiln.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from kiln.engine.sequence import Sequence
from kiln.sampling.sampler import LogprobsTensors
from kiln.upload import take_rows, upload


@dataclass
class InFlightStep:
    """A launched step whose sampled tokens the host has not applied yet."""

    out: SchedulerOutput
    result: StepResult
    host_token_ids: torch.Tensor  # [rows] int64; on CUDA a pinned copy, valid once `done` fired
    host_logprobs: LogprobsTensors | None  # likewise, when a row asked for logprobs
    done: torch.cuda.Event | None
    # off CUDA the step ran inside execute(): when its tokens were there (time.monotonic)
    finished_at: float | None = None

    @classmethod
    def launch(cls, out: SchedulerOutput, result: StepResult) -> InFlightStep:
        """Queue the copy of the step's tokens (and logprobs) to the host right behind the step
        itself, so that waiting for them later does not also wait for a step launched after
        it."""
        ids, logprobs = result.token_ids, result.logprobs
        if ids.device.type != "cuda":
            return cls(out, result, ids, logprobs, None, time.monotonic())
        if logprobs is not None:
            logprobs = logprobs.map(_to_host)
        host = _to_host(ids)
        done = torch.cuda.Event()
        done.record()
        return cls(out, result, host, logprobs, done)

    def wait(self) -> tuple[SchedulerOutput, StepResult, float]:
        """The step once finished, without the rows of sequences that stopped meanwhile, and
        when its tokens reached the host: the token times. (Off CUDA the step after it has run
        too by now, inside its execute(): the time of this call would give each token the next
        step's finish, and the last one a gap of ~0.)"""
        if self.done is not None:
            self.done.synchronize()
        finished_at = time.monotonic() if self.finished_at is None else self.finished_at
        result = self.result
        live = [row for row, seq in enumerate(result.seqs) if not seq.finished]
        ids, logprobs = self.host_token_ids, self.host_logprobs
        if len(live) < len(result.seqs):
            rows = torch.tensor(live, dtype=torch.int64)
            ids = ids[rows]
            if logprobs is not None:
                logprobs = logprobs.map(lambda t: t[rows])
        out = SchedulerOutput(scheduled=[item for item in self.out.scheduled
                                         if not item.seq.finished])
        return out, StepResult([result.seqs[r] for r in live],
                               [result.requests[r] for r in live], ids, logprobs, []), finished_at


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of ``tensor``, queued on the current stream."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _chains(seq: Sequence, request: Request) -> bool:
    """Whether what the sequence computes after this step is fixed before the host sees this
    step's token: no fork to come, no prompt logprobs to score. (What its sampling reads from
    the host's outputs is read after the step is applied: ``samples_from_host``.)"""
    return request.forked and request.prompt_logprobs is None


def samples_from_host(seq: Sequence) -> bool:
    """Whether the sequence's sampling reads what the host holds of its outputs: its grammar's
    matcher, the tokens penalties count, the EOS ban of min_tokens, bad words of several tokens.
    A chained step holding such a row applies the step in flight before it samples."""
    params = seq.params
    return (seq.grammar is not None or params.has_penalties
            or len(seq.output_token_ids) < params.min_tokens
            or any(len(word) > 1 for word in params.bad_words_token_ids))


def _admissible(request: Request) -> bool:
    """Whether a waiting request may start in a chained step: every step of it chains."""
    return all(_chains(seq, request) for seq in request.seqs)


def chainable(out: SchedulerOutput, result: StepResult) -> bool:
    """Whether a next step could start from this one's tokens before the host sees them."""
    if result.prompt_logprobs:
        return False
    return bool(out.scheduled) and all(_chains(item.seq, item.request) for item in out.scheduled)


def chain_step(prev: InFlightStep, scheduler: Scheduler,
               kv: KVCacheManager) -> tuple[SchedulerOutput, torch.Tensor] | None:
    """The step that continues ``prev``, with the input ids of all its tokens on the device:
    a decode row for each sequence ``prev`` samples, the next chunk of each prompt it cut.

    None when the scheduler has to decide the next step (see the module docstring).
    """
    config = scheduler.config
    if scheduler.can_swap_in_next() or (
            not scheduler.swapped and scheduler.waiting and not _admissible(scheduler.waiting[0])
            and scheduler.num_running_seqs() < config.max_num_seqs):
        return None  # the scheduler starts it: a chain would leave it waiting
    sampled = {id(seq) for seq in prev.result.seqs}
    rows = [(row, seq, request) for row, (seq, request)
            in enumerate(zip(prev.result.seqs, prev.result.requests, strict=True))
            if not seq.finished]
    cut = [item for item in prev.out.scheduled
           if id(item.seq) not in sampled and not item.seq.finished]
    running = {id(seq) for request in scheduler.running for seq in request.active_seqs()}
    if running != {id(seq) for _, seq, _ in rows} | {id(item.seq) for item in cut}:
        return None  # someone the last step did not advance
    # prev's tokens are not applied on the host yet; every step before it is
    pending = {id(item.seq): item.num_new_tokens for item in prev.out.scheduled}
    decodes, index = [], []
    for row, seq, request in rows:
        params, num_out = seq.params, len(seq.output_token_ids) + 1
        if ((params.max_tokens is not None and num_out >= params.max_tokens)
                or seq.num_tokens + 1 >= seq.max_model_len):
            continue  # prev's token is its last
        item = ScheduledSeq(request, seq, 1, pending=pending[id(seq)])
        if not kv.allocate_slots(seq.seq_id, item.start + 1, item.start):
            return None  # out of blocks: the scheduler preempts
        decodes.append(item)
        index.append(row)
    budget = config.max_num_batched_tokens - len(decodes)
    chunks = []
    for prev_item in cut:
        seq = prev_item.seq
        start = seq.num_computed_tokens + pending[id(seq)]
        take = min(seq.num_tokens - start, budget)
        if take <= 0 or not kv.allocate_slots(seq.seq_id, start + take, start):
            return None
        chunks.append(ScheduledSeq(prev_item.request, seq, take, pending=pending[id(seq)]))
        budget -= take
    if budget < 0:
        return None
    admitted = SchedulerOutput()
    scheduler.admit_waiting(admitted, budget, _admissible)
    chunks += admitted.scheduled
    if not decodes and not chunks:
        return None
    ids = prev.result.token_ids
    if index != list(range(ids.shape[0])):
        ids = take_rows(ids, index)  # the sampled tokens of the sequences that go on
    if chunks:  # laid out as the runner orders rows: single-token rows first
        chunks.sort(key=lambda item: item.num_new_tokens != 1)
        prompt = [t for item in chunks
                  for t in item.seq.token_slice(item.start, item.start + item.num_new_tokens)]
        ids = _append(ids, prompt)
    return SchedulerOutput(scheduled=decodes + chunks, copies=kv.take_pending_copies()), ids


def _append(ids: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """``ids`` followed by ``tokens`` (prompt chunks' ids, from the host)."""
    return torch.cat([ids, upload(torch.tensor(tokens, dtype=ids.dtype), ids.device)])


def warm_up(device: torch.device) -> None:
    """Run once, at start-up, the device ops a chained step launches besides the model's.

    A chained step is launched while the step before it still runs, and on CUDA the first
    launch of a kernel loads it (lazy module loading, PyTorch's default), which waits for the
    device: the first gather of ``take_rows`` (the first step after some sequences reached their
    length limit) then held that launch until the step in flight had finished, and the GPU sat
    idle (the step where the first 16 requests of the 64 x 512/256 benchmark finish: 15 ms
    instead of 8, 6.8 ms of it idle, on the H100; 7.6 ms with this warm-up).
    """
    ids = torch.zeros(2, dtype=torch.int64, device=device)  # sampled token ids are int64
    _append(take_rows(ids, [1]), [0])
    if device.type == "cuda":
        torch.cuda.synchronize(device)

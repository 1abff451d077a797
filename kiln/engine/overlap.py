"""Async scheduling: launch decode step N+1 before step N's sampled tokens reach the host.

A synchronous engine leaves the GPU idle while the host reads step N's tokens, appends them,
checks stops, schedules and builds step N+1's inputs (about 0.35 ms a step at batch 1 on an
H100, several ms at batch 512). When step N is a plain continuation (every running sequence
samples in it, and nothing the host does with its token changes what step N+1 computes), step
N+1 is scheduled at once: each sequence advances one position and its input token is step N's
sampled token, read on the device. Only then does the host wait for step N and apply it, while
the GPU runs step N+1.

What only step N's tokens on the host can tell is handled one step late:

- a sequence that stopped at step N (EOS, a stop id or string, an abort) computed one more
  token in step N+1; its row is dropped when step N+1 is applied. The KV it wrote lands in a
  block freed meanwhile, which is safe because the GPU runs steps in order: a later owner of
  that block writes it afterwards.
- a sequence whose length limit step N reaches is known on the host and left out of step N+1.

Everything else takes the synchronous path: waiting requests that could be admitted, swapped
requests, prompt chunks, penalties and min_tokens (the sampler reads the outputs on the host),
logprobs, the fork of n > 1 samples, and KV blocks running out (preemption).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.cache.kv_cache_manager import KVCacheManager
from kiln.engine.model_runner import StepResult
from kiln.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput


@dataclass
class InFlightStep:
    """A launched step whose sampled tokens the host has not applied yet."""

    out: SchedulerOutput
    result: StepResult
    host_token_ids: torch.Tensor  # [rows] int64; on CUDA a pinned copy, valid once `done` fired
    done: torch.cuda.Event | None

    @classmethod
    def launch(cls, out: SchedulerOutput, result: StepResult) -> InFlightStep:
        """Queue the copy of the step's tokens to the host right behind the step itself, so
        that waiting for them later does not also wait for a step launched after it."""
        ids = result.token_ids
        if ids.device.type != "cuda":
            return cls(out, result, ids, None)
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(out, result, host, done)

    def wait(self) -> tuple[SchedulerOutput, StepResult]:
        """The step once finished, without the rows of sequences that stopped meanwhile."""
        if self.done is not None:
            self.done.synchronize()
        result = self.result
        live = [row for row, seq in enumerate(result.seqs) if not seq.finished]
        ids = self.host_token_ids
        if len(live) < len(result.seqs):
            ids = ids[torch.tensor(live, dtype=torch.int64)]
        out = SchedulerOutput(scheduled=[item for item in self.out.scheduled
                                         if not item.seq.finished])
        return out, StepResult([result.seqs[r] for r in live],
                               [result.requests[r] for r in live], ids, None, [])


def chainable(out: SchedulerOutput, result: StepResult) -> bool:
    """Whether a next step could start from this one's tokens before the host sees them."""
    if result.logprobs is not None or result.prompt_logprobs or not result.seqs:
        return False
    if len(result.seqs) != len(out.scheduled):  # a prompt chunk that does not sample, a fork
        return False
    for seq, request in zip(result.seqs, result.requests, strict=True):
        params = seq.params
        if (not request.forked or params.has_penalties
                or len(seq.output_token_ids) < params.min_tokens):
            return False
    return True


def chain_decode(prev: InFlightStep, scheduler: Scheduler,
                 kv: KVCacheManager) -> tuple[SchedulerOutput, torch.Tensor] | None:
    """The decode step that continues ``prev``, with its input token ids on the device.

    None when the scheduler has to decide the next step (see the module docstring).
    """
    config = scheduler.config
    if scheduler.swapped or (scheduler.waiting
                             and scheduler.num_running_seqs() < config.max_num_seqs):
        return None
    rows = [(row, seq, request) for row, (seq, request)
            in enumerate(zip(prev.result.seqs, prev.result.requests, strict=True))
            if not seq.finished]
    running = {id(seq) for request in scheduler.running for seq in request.active_seqs()}
    if running != {id(seq) for _, seq, _ in rows}:  # someone the last step did not advance
        return None
    pending = {id(item.seq): item.num_new_tokens for item in prev.out.scheduled}
    scheduled, index = [], []
    for row, seq, request in rows:
        params, num_out = seq.params, len(seq.output_token_ids) + 1
        if ((params.max_tokens is not None and num_out >= params.max_tokens)
                or seq.num_tokens + 1 >= seq.max_model_len):
            continue  # prev's token is its last
        item = ScheduledSeq(request, seq, 1, pending=pending[id(seq)])
        if not kv.allocate_slots(seq.seq_id, item.start + 1, item.start):
            return None  # out of blocks: the scheduler preempts
        scheduled.append(item)
        index.append(row)
    if not scheduled or len(scheduled) > config.max_num_batched_tokens:
        return None
    ids = prev.result.token_ids
    if index != list(range(ids.shape[0])):
        ids = ids[torch.tensor(index, dtype=torch.int64).to(ids.device, non_blocking=True)]
    return SchedulerOutput(scheduled=scheduled, copies=kv.take_pending_copies()), ids

"""Scheduler preemption paths driven directly, without a model."""

from __future__ import annotations

import kiln
from kiln.cache import KVCacheManager
from kiln.config import SchedulerConfig
from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduler import Scheduler


def test_swap_preempts_readmitted_prompt_logprobs_samples_the_budget_left_unscheduled():
    """A forked prompt-logprobs request readmitted after a recompute preemption, with a budget
    that covers its first sample only, swaps out whole when it runs out of blocks (it raised
    KeyError: the second sample, never scheduled, had no block table)."""
    kv = KVCacheManager(2, 4, enable_prefix_caching=True, num_cpu_blocks=8)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=5, preemption_mode="swap",
                                      async_scheduling=False), kv)
    params = kiln.SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=1, ignore_eos=True,
                                 prompt_logprobs=1)
    request = Request("r", [3, 4, 5, 6], params, (), 64, None, "cpu")
    request.forked = True
    for seq in request.seqs:  # as a recompute preemption leaves it: one output, nothing computed
        seq.append_token(7)
    sched.add(request)

    out = sched.schedule()  # the budget admits the first sample's 5 tokens, not the second's
    assert [(s.seq.index, s.num_new_tokens) for s in out.scheduled] == [(0, 5)]
    seq0 = request.seqs[0]
    seq0.num_computed_tokens = 5
    seq0.append_token(8)
    kv.check_integrity()

    out = sched.schedule()  # sample 1 needs a third block: the request swaps itself out
    assert out.num_preempted == 1 and not out.scheduled
    assert request.status == RequestStatus.SWAPPED and sched.swapped[0] is request
    assert all(kv.is_swapped(s.seq_id) for s in request.seqs)
    kv.check_integrity()

    sched.remove(request)
    assert kv.num_free_blocks == 2 and kv.num_free_cpu_blocks == 8
    kv.check_integrity()

"""Async scheduling (kiln/engine/overlap.py) must change when the host works, never what it
produces: every workload below runs with it on and off and the outputs must be identical (the
logprobs to float32 rounding: where blocks run short a chained step may admit a request a step
later, and a row's float32 math varies in the last bits with the rows batched beside it)."""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass

import pytest
from engine_helpers import DeviceOps, make_engine

import kiln
from kiln.engine import llm_engine, overlap
from kiln.engine.scheduler import SchedulerOutput


@dataclass
class ChainedStep:
    out: SchedulerOutput
    started: list[str]  # ids of the requests it schedules for the first time


@pytest.fixture
def chained(monkeypatch) -> list[ChainedStep]:
    """Every step launched from the step in flight (proves the path ran), checked for one
    input id per token."""
    steps = []
    real = overlap.chain_step

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        if result is not None:
            out, ids = result
            assert ids.shape[0] == out.num_tokens
            steps.append(ChainedStep(out, [item.request.request_id for item in out.scheduled
                                           if item.request.metrics.first_scheduled_time is None]))
        return result

    monkeypatch.setattr("kiln.engine.llm_engine.chain_step", spy)
    return steps


def _outputs(engine, prompts, params):
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done = engine.run_to_completion()
    assert engine.kv.num_free_blocks == engine.kv_cache.num_blocks
    engine.kv.check_integrity()
    return {o.request_id: [(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs)
                           for c in o.outputs] for o in done}


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for rid, samples in want.items():
        assert len(got[rid]) == len(samples), rid
        for (ids, reason, stop, lps), (want_ids, *want_rest, want_lps) in zip(
                got[rid], samples, strict=True):
            assert (ids, reason, stop) == (want_ids, *want_rest), rid
            assert (lps is None) == (want_lps is None), rid
            for step, want_step in zip(lps or [], want_lps or [], strict=True):
                assert step == pytest.approx(want_step, abs=1e-5), rid


def _mixed_workload(seed: int, num: int = 24):
    """Greedy and seeded sampling, stop ids that really fire, length limits, penalties and
    min_tokens (chained, sampled after the step before is applied), and the features that force
    the synchronous path (logprobs, n > 1), which finish early so that the rest runs chained."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(num):
        prompts.append([rng.randrange(3, 300) for _ in range(rng.randint(1, 60))])
        kind = i % 6
        extra = {}
        if kind == 1:
            extra = {"temperature": 0.8, "seed": i, "top_p": 0.9}
        elif kind == 2:  # a frequent token of this random model stops most of these early
            extra = {"stop_token_ids": list(range(3, 300, 7))}
        elif kind == 3:
            extra = {"repetition_penalty": 1.2, "min_tokens": 3}
        elif kind == 4:
            extra = {"logprobs": 2}
        elif kind == 5:
            extra = {"n": 2, "temperature": 1.0, "seed": i}
        max_tokens = rng.randint(3, 5) if kind >= 3 else rng.randint(8, 20)
        params.append(kiln.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                          **({"temperature": 0.0} | extra)))
    return prompts, params


@pytest.mark.parametrize("options", [
    {},
    {"block_size": 4, "max_num_batched_tokens": 64},  # chunked prompts between decodes
    {"num_kv_blocks": 40, "block_size": 4, "max_model_len": 160},  # preemption by recompute
    {"enable_prefix_caching": True, "block_size": 4},
])
def test_async_scheduling_changes_no_output(tiny_llama, chained, options):
    prompts, params = _mixed_workload(seed=3)
    sync = _outputs(make_engine(tiny_llama, async_scheduling=False, **options), prompts, params)
    assert chained == []
    overlapped = _outputs(make_engine(tiny_llama, **options), prompts, params)
    _assert_same(overlapped, sync)
    assert chained


def test_steps_chain_beside_a_swapped_request_without_room(tiny_llama, chained, monkeypatch):
    """A swapped request that has no room to come back yet does not send every step through
    the scheduler: steps go on chaining beside it, with the outputs of synchronous steps."""
    options = {"num_kv_blocks": 40, "block_size": 4, "max_model_len": 160,
               "preemption_mode": "swap", "swap_space": 0.01}
    prompts, params = _mixed_workload(seed=3)
    sync = _outputs(make_engine(tiny_llama, async_scheduling=False, **options), prompts, params)
    beside_swapped = []
    spy = llm_engine.chain_step

    def record(prev, scheduler, kv):
        result = spy(prev, scheduler, kv)
        if result is not None and scheduler.swapped:
            beside_swapped.append(len(scheduler.swapped))
        return result

    monkeypatch.setattr(llm_engine, "chain_step", record)
    engine = make_engine(tiny_llama, **options)
    _assert_same(_outputs(engine, prompts, params), sync)
    assert engine.scheduler.num_swap_outs > 0
    assert beside_swapped


def test_stop_found_late_drops_the_extra_token(tiny_llama, chained):
    """A sequence that stops on a token has already computed one more step; none of it shows."""
    engine = make_engine(tiny_llama, block_size=4)
    free = engine.kv.num_free_blocks
    prompt = list(range(3, 20))
    greedy = kiln.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = _outputs(engine, [prompt], [greedy])["0"][0][0]
    stop_at = tokens[5]
    stopping = kiln.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                   stop_token_ids=[stop_at])
    out = _outputs(engine, [prompt], [stopping])["0"][0]
    assert out[0] == tokens[:tokens.index(stop_at) + 1]
    assert out[1:3] == ("stop", stop_at)
    assert chained
    assert engine.kv.num_free_blocks == free
    assert not engine.has_unfinished_requests()


def test_abort_while_a_step_is_in_flight(tiny_llama, chained):
    engine = make_engine(tiny_llama, block_size=4)
    greedy = kiln.SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("x", list(range(3, 40)), greedy)
    engine.add_request("y", list(range(5, 30)), greedy)
    for _ in range(6):
        engine.step()
    assert engine._in_flight is not None
    aborted = engine.abort_request("x")
    seen = len(aborted.outputs[0].token_ids)
    finished = {o.request_id: o for o in engine.run_to_completion()}
    assert set(finished) == {"y"}  # x's rows in flight were dropped, not reported
    assert len(aborted.outputs[0].token_ids) == seen
    assert len(finished["y"].outputs[0].token_ids) == 30
    assert chained
    assert engine.kv.num_free_blocks == engine.kv_cache.num_blocks
    engine.kv.check_integrity()


@pytest.mark.parametrize("options", [
    {},
    {"num_kv_blocks": 70, "max_model_len": 260},  # too few blocks: chains refused, preemption
    {"enable_prefix_caching": True},
])
def test_prompt_chunks_are_chained_too(tiny_llama, chained, options):
    """A prompt the token budget cuts takes its next chunk in a step launched while the step
    before it is in flight (next to the decodes of the others), with the same outputs."""
    rng = random.Random(5)
    # under a 48-token budget: short prompts that decode while the last, long one is prefilled
    # in chunks
    lengths = [20, 35, 12, 40, 230]
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]
    params = [kiln.SamplingParams(max_tokens=rng.randint(4, 12), temperature=0.0,
                                  ignore_eos=True) for _ in prompts]
    options = {"block_size": 4, "max_num_batched_tokens": 48} | options
    sync = _outputs(make_engine(tiny_llama, async_scheduling=False, **options), prompts, params)
    assert chained == []
    engine = make_engine(tiny_llama, **options)
    _assert_same(_outputs(engine, prompts, params), sync)
    chunk_steps = [sum(item.num_new_tokens > 1 for item in step.out.scheduled) for step in chained]
    assert sum(n > 0 for n in chunk_steps) >= 2, chunk_steps
    assert engine.scheduler.num_preemptions > 0 or "num_kv_blocks" not in options


@pytest.mark.parametrize("options", [
    {"max_num_batched_tokens": 64},  # more prompts than one step's budget: admitted step by step
    {"max_num_seqs": 3},  # a waiting request starts when a running one ends
    {"num_kv_blocks": 40, "block_size": 4, "max_model_len": 160},  # admissions wait for blocks
    {"enable_prefix_caching": True, "block_size": 4, "max_num_batched_tokens": 64},
])
def test_waiting_requests_are_admitted_into_chained_steps(tiny_llama, chained, options):
    """Requests that could not start at once start in steps launched while the step before
    is in flight, with the outputs of the synchronous engine."""
    rng = random.Random(11)
    shared = [rng.randrange(3, 300) for _ in range(12)]  # a prefix the cache can reuse
    prompts = [shared * (i % 2) + [rng.randrange(3, 300) for _ in range(rng.randint(5, 40))]
               for i in range(12)]
    params = [kiln.SamplingParams(max_tokens=rng.randint(3, 10), temperature=0.0,
                                  ignore_eos=True) for _ in prompts]
    sync = _outputs(make_engine(tiny_llama, async_scheduling=False, **options), prompts, params)
    assert chained == []
    _assert_same(_outputs(make_engine(tiny_llama, **options), prompts, params), sync)
    started = [rid for step in chained for rid in step.started]
    assert len(started) >= 3, started
    assert len(set(started)) == len(started)


def test_a_request_the_chain_cannot_start_is_not_starved(tiny_llama, chained):
    """A waiting request that needs the synchronous path (n > 1: its samples fork after its
    first step) starts in the next step even though the running ones would chain for ever."""
    engine = make_engine(tiny_llama, block_size=4)
    greedy = kiln.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"long{i}", list(range(3 + i, 30)), greedy)
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    engine.add_request("plain", list(range(7, 19)), greedy)
    engine.step()
    assert chained[-1].started == ["plain"]  # an admissible arrival rides the chain
    engine.add_request("n2", list(range(9, 21)),
                       kiln.SamplingParams(max_tokens=3, temperature=1.0, seed=1, n=2))
    engine.step()
    assert engine.requests["n2"].metrics.first_scheduled_time is not None
    assert all("n2" not in step.started for step in chained)
    finished = {o.request_id: o for o in engine.run_to_completion()}
    assert [len(c.token_ids) for c in finished["n2"].outputs] == [3, 3]
    assert engine.kv.num_free_blocks == engine.kv_cache.num_blocks


def test_abort_of_a_request_admitted_into_the_step_in_flight(tiny_llama, chained):
    """A request aborted while its first chunk is in flight loses nothing of the others, and
    its blocks come back."""
    engine = make_engine(tiny_llama, block_size=4, max_num_batched_tokens=32)
    greedy = kiln.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = _outputs(make_engine(tiny_llama, block_size=4), [list(range(3, 20))], [greedy])
    engine.add_request("x", list(range(3, 20)), greedy)
    for _ in range(3):
        engine.step()
    engine.add_request("y", list(range(40, 90)), greedy)  # 50 tokens: cut by the budget
    engine.step()
    assert chained[-1].started == ["y"] and engine._in_flight is not None
    assert engine.abort_request("y") is not None
    finished = {o.request_id: o for o in engine.run_to_completion()}
    assert set(finished) == {"x"}
    assert finished["x"].outputs[0].token_ids == alone["0"][0][0]
    assert engine.kv.num_free_blocks == engine.kv_cache.num_blocks
    engine.kv.check_integrity()


def test_a_request_admitted_next_reuses_the_prompt_blocks_in_flight(tiny_llama, chained):
    """The blocks a launched step fills are hashed before the next step is scheduled, so a
    request admitted into the chained step reuses a prefix that step is still computing."""
    rng = random.Random(3)
    shared = [rng.randrange(3, 300) for _ in range(40)]
    greedy = kiln.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = {}
    for async_scheduling in (True, False):
        engine = make_engine(tiny_llama, block_size=4, enable_prefix_caching=True,
                             async_scheduling=async_scheduling)
        engine.add_request("a", shared + [7, 8], greedy)
        engine.step()  # a's prompt: in flight (async) or applied (sync)
        engine.add_request("b", shared + [9, 10, 11], greedy)
        engine.step()
        assert engine.requests["b"].metrics.num_cached_tokens == 40
        outputs[async_scheduling] = {o.request_id: o.outputs[0].token_ids
                                     for o in engine.run_to_completion()}
    assert chained and chained[0].started == ["b"]
    assert outputs[True] == outputs[False]


def test_a_chained_step_runs_no_device_op_the_engine_did_not_run_at_start_up(tiny_llama,
                                                                             monkeypatch):
    """A chained step is launched while the step before it still runs. On CUDA the first
    launch of a kernel loads it (lazy module loading), and the load waits for the device: a
    device op that a chained step runs outside the model for the first time (the gather of the
    rows whose sequences go on, once some stop; the prompt chunks appended) stalls the pipeline
    once. On the H100 the step where the first 16 requests of the 64 x 512/256 benchmark
    finished took 15 ms instead of 8 (GPU idle 6.8 ms): the process's first gather. So
    start-up runs each of them once."""
    at_start_up = DeviceOps()
    with at_start_up:
        engine = make_engine(tiny_llama, block_size=4, max_num_batched_tokens=48)
    in_chain = DeviceOps()
    monkeypatch.setattr("kiln.engine.llm_engine.chain_step", in_chain.around(overlap.chain_step))
    rng = random.Random(7)
    # lengths that stop in different steps (rows leave chained steps), and prompts the
    # 48-token budget cuts (chunks chained beside the decodes)
    for i, n in enumerate([10, 14, 90, 20, 120]):
        engine.add_request(str(i), [rng.randrange(3, 300) for _ in range(n)],
                           kiln.SamplingParams(max_tokens=4 + 3 * i, temperature=0.0,
                                               ignore_eos=True))
    engine.run_to_completion()
    ran = {op for op, _ in in_chain.ops}
    assert {"aten.index.Tensor", "aten.cat.default"} <= ran, ran  # the workload reached both
    assert in_chain.ops <= at_start_up.ops, in_chain.ops - at_start_up.ops


def test_token_times_are_when_each_step_finished(tiny_llama, chained, monkeypatch):
    """Off CUDA a chained step runs inside its launch, before the host applies the step before
    it: timing a token when it is applied gave it the next step's finish, and the last token a
    gap of ~0 (a benchmark's TPOT and decode tok/s then came out high). Every step here takes
    at least STEP_S, so every gap between tokens must too."""
    step_s = 0.02
    engine = make_engine(tiny_llama, async_scheduling=True)
    execute = engine.runner.execute

    def slow_execute(*args, **kwargs):
        result = execute(*args, **kwargs)
        time.sleep(step_s)
        return result

    monkeypatch.setattr(engine.runner, "execute", slow_execute)
    engine.add_request("r", [5, 6, 7], kiln.SamplingParams(max_tokens=8, ignore_eos=True))
    (done,) = engine.run_to_completion()
    assert chained  # the chained path ran
    times = done.metrics.token_times
    assert len(times) == 8
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0.9 * step_s, gaps
    assert done.metrics.finished_time == times[-1]


def test_sampling_that_reads_the_outputs_chains_after_the_step_before(tiny_llama, chained,
                                                                       monkeypatch):
    """Penalties count the output tokens, min_tokens bans EOS until enough are out, a bad word of
    two tokens is banned after its first: a chained step holding such rows applies the step in
    flight between its forward and its sampling, and the tokens are the synchronous ones."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(2, 30))] for _ in range(8)]
    kinds = [{"repetition_penalty": 1.3}, {"presence_penalty": 0.8, "frequency_penalty": 0.5},
             {"min_tokens": 12}, {"bad_words": None}]
    params = []
    for i, prompt in enumerate(prompts):
        extra = dict(kinds[i % len(kinds)])
        if "bad_words" in extra:  # the pair the prompt's last two tokens make, as token ids
            del extra["bad_words"]
            extra["bad_words_token_ids"] = [[prompt[-1], prompt[0]]]
        params.append(kiln.SamplingParams(
            max_tokens=24, **({"temperature": 0.0} if i % 2 else {"temperature": 0.9, "seed": i}),
            **extra))
    sync = _outputs(make_engine(tiny_llama, async_scheduling=False), prompts, params)
    engine = make_engine(tiny_llama)
    deferred = []
    real = engine.runner.execute

    def spy(out, lookahead_ids=None, before_sampling=None):
        deferred.append((lookahead_ids is not None, before_sampling is not None))
        return real(out, lookahead_ids, before_sampling)

    monkeypatch.setattr(engine.runner, "execute", spy)
    _assert_same(_outputs(engine, prompts, params), sync)
    assert chained and sum(step_chained and late for step_chained, late in deferred) >= 10
    assert not any(late and not step_chained for step_chained, late in deferred)


def test_logprobs_travel_with_the_chained_tokens(tiny_llama, chained):
    """Rows asking for logprobs chain: their logprobs come to the host with the tokens, and
    rows of sequences that stopped meanwhile are dropped from both."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(2, 40))] for _ in range(10)]
    params = [kiln.SamplingParams(
        max_tokens=20, logprobs=i % 4, ignore_eos=True,
        **({"temperature": 0.0} if i % 2 else {"temperature": 0.8, "seed": i}),
        **({"stop_token_ids": list(range(3, 300, 7))} if i % 3 == 0 else {}))
        for i in range(len(prompts))]
    sync = _outputs(make_engine(tiny_llama, async_scheduling=False), prompts, params)
    _assert_same(_outputs(make_engine(tiny_llama), prompts, params), sync)
    assert any(item.seq.params.logprobs for step in chained for item in step.out.scheduled)
    assert any(reason == "stop" for samples in sync.values() for _, reason, _, _ in samples)

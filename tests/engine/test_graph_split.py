"""Which steps the model runner replays as a decode graph plus a prefill graph, and what it makes
of their outputs. CUDA graphs run on the GPU only: here stand-in graphs answer the runner's
questions, and compute what a replay would, eagerly, so that the split, the merge of the two
replays and their sampling are checked against the one eager step (the replays themselves in
tests/gpu/test_engine_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import make_engine

import kiln
from kiln.layers.attention import AttentionMetadata


class StandInGraphs:
    """The two questions the runner asks the captured graphs."""

    def __init__(self, max_batch: int = 8, max_tokens: int = 64, max_prompts: int = 3) -> None:
        self.max_batch, self.max_tokens, self.max_prompts = max_batch, max_tokens, max_prompts

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    def fits_prefill(self, num_new_tokens: list[int]) -> bool:
        return len(num_new_tokens) <= self.max_prompts and sum(num_new_tokens) <= self.max_tokens


class EagerGraphs(StandInGraphs):
    """Stand-in graphs that compute what a replay would, eagerly (the torch backend over the
    runner's pages): the runner's split, its merge of the two replays and their sampling
    together are then checked on CPU against the one eager step."""

    def __init__(self, runner, **limits) -> None:
        super().__init__(**limits)
        self.runner = runner

    def run(self, tokens, positions: list[int], tables: list[list[int]]):
        ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(tokens)
        return self._forward(ids, [(p, 1, t) for p, t in zip(positions, tables, strict=True)])

    def run_prefill(self, chunks: list[tuple[list[int], int, list[int]]]):
        ids = torch.tensor([t for tokens, _, _ in chunks for t in tokens])
        return self._forward(ids, [(start, len(tokens), table) for tokens, start, table in chunks])

    def _forward(self, ids: torch.Tensor, seqs: list[tuple[int, int, list[int]]]):
        """seqs: (start, new tokens, block table) each -> (logits, argmax) at their last rows."""
        page = self.runner.block_size
        positions = [p for start, n, _ in seqs for p in range(start, start + n)]
        slots = [table[p // page] * page + p % page
                 for start, n, table in seqs for p in range(start, start + n)]
        cu = np.cumsum([0] + [n for _, n, _ in seqs])
        width = max(len(table) for _, _, table in seqs)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor([s + n for s, n, _ in seqs], dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for _, _, t in seqs],
                                      dtype=torch.int32),
            max_seqlen_q=max(n for _, n, _ in seqs), max_seqlen_k=max(s + n for s, n, _ in seqs),
            kv_caches=self.runner.kv_caches)
        hidden = self.runner.model(ids, torch.tensor(positions), meta)
        logits = self.runner.model.compute_logits(hidden[torch.tensor(cu[1:] - 1)])
        return logits, logits.argmax(-1)


def _greedy(**extra) -> kiln.SamplingParams:
    return kiln.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **extra)


def _admission(tiny_llama, new_prompts: list[list[int]], new_params: list, graphs=None,
               num_running: int = 2, max_num_batched_tokens: int = 512, steps_between: int = 0):
    """The scheduled items of the step that admits ``new_prompts`` while ``num_running``
    requests decode (``steps_between`` steps after they arrive), and the runner (with
    ``graphs`` standing in for the captured ones)."""
    engine = make_engine(tiny_llama, async_scheduling=False,
                         max_num_batched_tokens=max_num_batched_tokens)
    for i in range(num_running):
        engine.add_request(f"running{i}", [5 + i] * 20, _greedy())
    engine.step()  # their prompts: they decode from now on
    for i, (prompt, params) in enumerate(zip(new_prompts, new_params, strict=True)):
        engine.add_request(f"new{i}", prompt, params)
    for _ in range(steps_between):
        engine.step()
    scheduled = engine.scheduler.schedule().scheduled
    engine.runner.graphs = graphs if graphs is not None else StandInGraphs()
    return engine.runner, scheduled


@pytest.mark.parametrize("num_running", [0, 2])
@pytest.mark.parametrize("lengths", [[30], [30, 10], [30, 10, 20]])
def test_prompts_one_prefill_graph_holds_split(tiny_llama, lengths, num_running):
    """Alone or beside decodes, whole prompts that one prefill graph holds (64 tokens and three
    prompts here) replay it."""
    prompts = [[7 + i] * n for i, n in enumerate(lengths)]
    runner, scheduled = _admission(tiny_llama, prompts, [_greedy() for _ in prompts],
                                   num_running=num_running)
    decodes, admitted = runner._graph_split(scheduled)
    assert [item.request.request_id for item in decodes] == [
        f"running{i}" for i in range(num_running)]
    assert [item.num_new_tokens for item in admitted] == lengths


@pytest.mark.parametrize("num_running", [0, 2])
def test_prompts_asking_for_logprobs_split(tiny_llama, num_running):
    """Logprobs come from sampling the replays' logits together, so they split like greedy."""
    runner, scheduled = _admission(tiny_llama, [[7] * 30], [_greedy(logprobs=2)],
                                   num_running=num_running)
    decodes, prompts = runner._graph_split(scheduled)
    assert (len(decodes), len(prompts)) == (num_running, 1)


def test_rest_of_a_cut_prompt_splits(tiny_llama):
    """The budget takes 40 of a 60-token prompt's tokens (that chunk samples nothing, so its
    step runs as one); the next step's last 20, after the 40 in the cache, ride with the decodes
    in a prefill graph."""
    runner, scheduled = _admission(tiny_llama, [[7] * 60], [_greedy()],
                                   max_num_batched_tokens=42, steps_between=1)
    decodes, admitted = runner._graph_split(scheduled)
    assert len(decodes) == 2
    assert [(item.start, item.num_new_tokens) for item in admitted] == [(40, 20)]


def test_prefix_cache_hit_alone_replays_a_prefill_graph(tiny_llama):
    """A prompt whose first blocks are cached computes only its tail: alone in its step, that
    tail replays a prefill graph (a whole prompt alone does too: the batch-1 first token)."""
    engine = make_engine(tiny_llama, async_scheduling=False, enable_prefix_caching=True)
    shared = [9] * 48
    engine.add_request("first", shared + [3] * 8, _greedy())
    engine.run_to_completion()
    engine.add_request("hit", shared + [4] * 8, _greedy())
    scheduled = engine.scheduler.schedule().scheduled
    engine.runner.graphs = StandInGraphs()
    assert scheduled[0].start > 0
    assert engine.runner._graph_split(scheduled) == ([], scheduled)


@pytest.mark.parametrize("case", ["four prompts", "too many tokens", "long prompt", "cut prompt",
                                  "prompt logprobs", "batch too large"])
def test_other_steps_do_not_split(tiny_llama, case):
    """Anything but prompts' last chunks that one prefill graph holds (none asking for prompt
    logprobs), beside decodes that a decode graph holds, runs as one step."""
    prompts, params, options = [[7] * 30], [_greedy()], {}
    if case == "four prompts":
        prompts, params = [[7] * 10, [8] * 10, [9] * 5, [10] * 5], [_greedy()] * 4
    elif case == "too many tokens":  # 65 in all, a graph of 64
        prompts, params = [[7] * 30, [8] * 35], [_greedy()] * 2
    elif case == "long prompt":
        prompts = [[7] * 65]
    elif case == "cut prompt":  # the budget takes 40 of its 60 tokens
        prompts, options = [[7] * 60], {"max_num_batched_tokens": 42}
    elif case == "prompt logprobs":
        params = [_greedy(prompt_logprobs=1)]
    elif case == "batch too large":
        options = {"graphs": StandInGraphs(max_batch=1)}
    runner, scheduled = _admission(tiny_llama, prompts, params, **options)
    assert runner._graph_split(scheduled) is None


def test_no_graphs_no_split(tiny_llama):
    runner, scheduled = _admission(tiny_llama, [[7] * 30], [_greedy()])
    runner.graphs = None
    assert runner._graph_split(scheduled) is None


@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_split_steps_give_the_eager_steps_outputs(tiny_llama, async_scheduling, mixed):
    """Requests admitted one to three at a time while others decode, asking for greedy tokens,
    logprobs, penalties or two seeded samples, their prompts cut by the token budget: with
    (eager stand-in) graphs the steps split, and every token and logprob is the one eager
    step's. Plain greedy requests (not ``mixed``) let async scheduling chain the steps."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 200, size=int(n)).tolist() for n in rng.integers(2, 40, size=9)]
    variants = [{}, {"logprobs": 2}, {"presence_penalty": 0.5, "repetition_penalty": 1.2},
                {"n": 2, "temperature": 0.8, "seed": 7}]
    params = [kiln.SamplingParams(**{"max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
                                     **(variants[i % 4] if mixed else {})}) for i in range(9)]
    gaps = [2, 0, 2, 0, 0, 2, 2, 2, 2]  # admitted together: {0}, {1, 2}, {3, 4, 5}, ...

    def outputs(with_graphs: bool) -> tuple[dict, int]:
        # 24 tokens a step: prompts of up to 40 are cut, and with async scheduling their rest
        # comes in a step chained to the one in flight (decodes' ids on the device)
        engine = make_engine(tiny_llama, async_scheduling=async_scheduling,
                             max_num_batched_tokens=24)
        splits = 0
        if with_graphs:
            runner = engine.runner
            runner.graphs = EagerGraphs(runner, max_batch=16, max_tokens=128)
            real_split = runner._graph_split

            def counting_split(scheduled):
                nonlocal splits
                split = real_split(scheduled)
                splits += split is not None and len(split[0]) > 0
                return split

            runner._graph_split = counting_split
        done = {}
        for i, (prompt, sp, gap) in enumerate(zip(prompts, params, gaps, strict=True)):
            engine.add_request(str(i), prompt, sp)
            for _ in range(gap):
                done |= {o.request_id: o for o in engine.step() if o.finished}
        done |= {o.request_id: o for o in engine.run_to_completion()}
        return ({rid: [(c.token_ids, c.logprobs) for c in o.outputs] for rid, o in done.items()},
                splits)

    eager, _ = outputs(with_graphs=False)
    split, num_splits = outputs(with_graphs=True)
    assert num_splits >= 3
    assert {rid: [ids for ids, _ in seqs] for rid, seqs in split.items()} == \
        {rid: [ids for ids, _ in seqs] for rid, seqs in eager.items()}
    for rid, seqs in eager.items():
        for (_, want), (_, got) in zip(seqs, split[rid], strict=True):
            assert (got is None) == (want is None)
            for got_step, want_step in zip(got or [], want or [], strict=True):
                assert got_step.keys() == want_step.keys()
                assert all(abs(got_step[t] - want_step[t]) < 1e-4 for t in want_step)

"""Which steps the model runner replays as a decode graph plus prefill graphs (CUDA graphs run
on the GPU only: the decision is checked here against stand-in graphs, the replay in
tests/gpu/test_engine_gpu.py)."""

from __future__ import annotations

import pytest
from engine_helpers import make_engine

import kiln


class StandInGraphs:
    """The two questions the runner asks the captured graphs."""

    def __init__(self, max_batch: int = 8, max_tokens: int = 64, max_prompts: int = 3) -> None:
        self.max_batch, self.max_tokens, self.max_prompts = max_batch, max_tokens, max_prompts

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    def fits_prefill(self, num_new_tokens: list[int]) -> bool:
        return len(num_new_tokens) <= self.max_prompts and sum(num_new_tokens) <= self.max_tokens


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

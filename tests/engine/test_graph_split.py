"""Which steps the model runner replays as a decode graph plus prefill graphs (CUDA graphs run
on the GPU only: the decision is checked here against stand-in graphs, the replay in
tests/gpu/test_engine_gpu.py)."""

from __future__ import annotations

import pytest
from engine_helpers import make_engine

import kiln


class StandInGraphs:
    """The two questions the runner asks the captured graphs."""

    def __init__(self, max_batch: int = 8, max_prompt: int = 64) -> None:
        self.max_batch, self.max_prompt = max_batch, max_prompt

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    def fits_prefill(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_prompt


def _greedy(**extra) -> kiln.SamplingParams:
    return kiln.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **extra)


def _admission(tiny_llama, new_prompts: list[list[int]], new_params: list, graphs=None,
               num_running: int = 2, max_num_batched_tokens: int = 512):
    """The scheduled items of the step that admits ``new_prompts`` while ``num_running``
    requests decode, and the runner (with ``graphs`` standing in for the captured ones)."""
    engine = make_engine(tiny_llama, async_scheduling=False,
                         max_num_batched_tokens=max_num_batched_tokens)
    for i in range(num_running):
        engine.add_request(f"running{i}", [5 + i] * 20, _greedy())
    engine.step()  # their prompts: they decode from now on
    for i, (prompt, params) in enumerate(zip(new_prompts, new_params, strict=True)):
        engine.add_request(f"new{i}", prompt, params)
    scheduled = engine.scheduler.schedule().scheduled
    engine.runner.graphs = graphs if graphs is not None else StandInGraphs()
    return engine.runner, scheduled


@pytest.mark.parametrize("lengths", [[30], [30, 10]])
def test_decodes_beside_one_or_two_short_prompts_split(tiny_llama, lengths):
    prompts = [[7 + i] * n for i, n in enumerate(lengths)]
    runner, scheduled = _admission(tiny_llama, prompts, [_greedy() for _ in prompts])
    decodes, admitted = runner._graph_split(scheduled)
    assert [item.request.request_id for item in decodes] == ["running0", "running1"]
    assert [item.num_new_tokens for item in admitted] == lengths


@pytest.mark.parametrize("case", ["three prompts", "long prompt", "cut prompt", "logprobs",
                                  "prompt logprobs", "batch too large", "no decodes"])
def test_other_steps_do_not_split(tiny_llama, case):
    """Anything but decodes beside one or two whole prompts that prefill graphs hold, none
    asking for logprobs, runs as one step."""
    prompts, params, options = [[7] * 30], [_greedy()], {}
    if case == "three prompts":
        prompts, params = [[7] * 30, [8] * 10, [9] * 5], [_greedy()] * 3
    elif case == "long prompt":
        prompts = [[7] * 65]
    elif case == "cut prompt":  # the budget takes 40 of its 60 tokens
        prompts, options = [[7] * 60], {"max_num_batched_tokens": 42}
    elif case == "logprobs":
        params = [_greedy(logprobs=2)]
    elif case == "prompt logprobs":
        params = [_greedy(prompt_logprobs=1)]
    elif case == "batch too large":
        options = {"graphs": StandInGraphs(max_batch=1)}
    elif case == "no decodes":
        options = {"num_running": 0}
    runner, scheduled = _admission(tiny_llama, prompts, params, **options)
    assert runner._graph_split(scheduled) is None


def test_no_graphs_no_split(tiny_llama):
    runner, scheduled = _admission(tiny_llama, [[7] * 30], [_greedy()])
    runner.graphs = None
    assert runner._graph_split(scheduled) is None

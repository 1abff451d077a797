"""On CUDA with graphs: a greedy request whose logits the sampler changes (logit_bias,
allowed_token_ids, bad words) is sampled from the replayed logits, never handed the argmax
the graphs compute for plain greedy batches."""

from __future__ import annotations

import random

import pytest
import torch

import kiln
from kiln.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU")]


def _tokens(prompts, params, **options) -> list[list[int]]:
    # float32: the eager and graph paths then agree token for token, no bf16 near-tie flips
    engine = LLMEngine.from_kwargs("kiln-tiny", dtype="float32", device="cuda",
                                   num_kv_blocks=1024, **options)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done = {o.request_id: o.outputs[0].token_ids for o in engine.run_to_completion()}
    return [done[str(i)] for i in range(len(prompts))]


def test_greedy_logit_changes_hold_in_graph_steps():
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(5, 40))] for _ in range(3)]
    greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    free = _tokens(prompts, [kiln.SamplingParams(**greedy)] * 3)
    allowed = sorted({t + 1 for t in free[1]})  # none of the free answer's tokens
    params = [kiln.SamplingParams(logit_bias={t: -100 for t in free[0]}, **greedy),
              kiln.SamplingParams(allowed_token_ids=allowed, **greedy),
              kiln.SamplingParams(bad_words_token_ids=[[t] for t in free[2]], **greedy)]
    eager = _tokens(prompts, params, enforce_eager=True)
    assert not set(eager[0]) & set(free[0]) and set(eager[1]) <= set(allowed)
    assert not set(eager[2]) & set(free[2])
    for async_scheduling in (True, False):
        assert _tokens(prompts, params, async_scheduling=async_scheduling) == eager

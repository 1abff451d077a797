"""The engine runs its last layer on the sampled rows only (OutputRows) at prompt steps, on every
row where prompt logprobs read them, and on none (K/V writes only) for prompt chunks that sample
nothing: float32 on CPU, tokens and prompt logprobs against the reference generator (which runs
every row through every layer)."""

from __future__ import annotations

import torch
from engine_helpers import make_engine

import kiln
from kiln.engine.reference import reference_generate
from kiln.models.llama import LlamaForCausalLM


def test_engine_passes_the_sampled_rows_unless_prompt_logprobs_read_them_all(
        tiny_llama, monkeypatch):
    engine = make_engine(tiny_llama, max_num_batched_tokens=16)
    seen = []  # per forward: (rows in the batch, the kept rows) or None: every row kept
    real_forward = LlamaForCausalLM.forward

    def recording_forward(self, input_ids, positions, meta, rows=None):
        seen.append(None if rows is None else (input_ids.shape[0], rows.index.tolist()))
        return real_forward(self, input_ids, positions, meta, rows)

    monkeypatch.setattr(LlamaForCausalLM, "forward", recording_forward)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 21, 9, 40)]
    greedy = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    params = [kiln.SamplingParams(**greedy), kiln.SamplingParams(**greedy),
              kiln.SamplingParams(**greedy, prompt_logprobs=2), kiln.SamplingParams(**greedy)]
    engine.add_request("0", prompts[0], params[0])
    engine.add_request("1", prompts[1], params[1])
    outs = engine.run_to_completion()
    first = list(seen)
    engine.add_request("2", prompts[2], params[2])  # alone: its prompt step reads every row
    outs += engine.run_to_completion()
    second = len(seen)
    engine.add_request("3", prompts[3], params[3])  # alone, 40 tokens: chunks of 16, 16, 8
    outs += engine.run_to_completion()

    # prompt 0 whole (rows 0-4) with prompt 1's first 11 tokens, which sample nothing; then
    # prompt 0's first decode (row 0) first, with the rest of prompt 1 (rows 1-10)
    assert first[:2] == [(16, [4]), (11, [0, 10])]
    assert all(s is None for s in first[2:])  # decodes: every row samples
    assert seen[len(first)] is None  # the prompt-logprobs request's prompt
    # the chunks that sample nothing keep no row: the last layer only writes their K/V
    assert seen[second:second + 3] == [(16, []), (16, []), (8, [7])]
    ref = reference_generate(engine.loaded, prompts, params, engine.max_model_len)
    outs = sorted(outs, key=lambda o: o.request_id)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    got, want = outs[2].prompt_logprobs, ref[2].prompt_logprobs
    assert len(got) == len(want) == 9 and got[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.keys() == w.keys()
        assert all(abs(g[t] - w[t]) < 1e-4 for t in w)

"""Seeded reproducibility independent of the batch, generator streams, and logprobs."""

import torch

from kiln.sampling import (
    Sampler,
    SamplingMetadata,
    SamplingParams,
    compute_prompt_logprobs,
    generator_for,
)

VOCAB = 64


def run_request(params, steps, neighbours, seed_rng):
    """Sample `params` (seeded) for `steps` steps; each step it sits among `neighbours(step)`
    (a list of (params, generator) pairs) at a step-dependent position. Its own logits row
    depends only on the step; the neighbours' rows are fresh noise."""
    gen = generator_for(params.seed, 0, "cpu")
    outputs: list[int] = []
    sampler = Sampler()
    for step in range(steps):
        own_logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 + step)) * 2
        others = neighbours(step)
        pos = step % (len(others) + 1)
        rows = others[:pos] + [(params, gen)] + others[pos:]
        logits = torch.randn(len(rows), VOCAB, generator=seed_rng) * 3
        logits[pos] = own_logits
        meta = SamplingMetadata.build(
            [p for p, _ in rows],
            [g for _, g in rows],
            [outputs if i == pos else [5, 6] for i in range(len(rows))],
            [[1, 2, 3]] * len(rows),
            "cpu",
            eos_token_ids=[0],
        )
        outputs.append(int(sampler.sample(logits, meta).token_ids[pos]))
    return outputs


def test_seeded_tokens_do_not_depend_on_batch():
    params = SamplingParams(seed=1234, temperature=0.9, top_p=0.95, presence_penalty=0.4)
    alone = run_request(params, 60, lambda step: [], torch.Generator().manual_seed(1))

    def crowd(step):
        other_seeded = SamplingParams(seed=99, temperature=0.5, top_k=7, repetition_penalty=1.3)
        rows = [
            (SamplingParams(temperature=1.7, min_p=0.05), None),  # unseeded: shared draw
            (SamplingParams(temperature=0.0), None),  # greedy
            (other_seeded, generator_for(99, step % 3, "cpu")),
            (SamplingParams(top_k=3, top_p=0.5, min_tokens=4), None),
        ]
        return rows[: 1 + step % len(rows)]

    torch.manual_seed(7)  # the shared draw's state differs from the run alone
    in_batch = run_request(params, 60, crowd, torch.Generator().manual_seed(7))
    assert in_batch == alone
    assert len(set(alone)) > 10  # it is really sampling, not collapsing to one token


def test_generator_for_streams_are_reproducible_and_distinct():
    def stream(seed, index):
        return torch.rand(8, generator=generator_for(seed, index, "cpu"))

    assert torch.equal(stream(5, 0), stream(5, 0))
    assert torch.equal(stream(5, 0), torch.rand(8, generator=torch.Generator().manual_seed(5)))
    streams = [stream(5, i) for i in range(6)] + [stream(6, 0), stream(-5, 0)]
    assert all(not torch.equal(a, b) for i, a in enumerate(streams) for b in streams[i + 1 :])
    stream(2**70 + 3, 1)  # any Python int is accepted (folded to 64 bits)


def test_logprobs_are_raw_log_softmax_and_include_chosen_token():
    torch.manual_seed(3)
    logits = torch.randn(4, VOCAB) * 2
    params = [
        SamplingParams(logprobs=3, temperature=0.3, top_k=5, repetition_penalty=1.5),
        SamplingParams(logprobs=0, temperature=0.0, presence_penalty=1.0),
        SamplingParams(),  # no logprobs, still gets a row (the caller ignores it)
        SamplingParams(logprobs=5, seed=3),
    ]
    meta = SamplingMetadata.build(
        params,
        [None, None, None, generator_for(3, 0, "cpu")],
        [[1, 2]] * 4,
        [[3, 4]] * 4,
        "cpu",
    )
    out = Sampler().sample(logits, meta)
    lp = out.logprobs
    assert lp is not None
    raw = torch.log_softmax(logits, dim=-1)  # before penalties and temperature
    rows = torch.arange(4)
    torch.testing.assert_close(lp.token_logprobs, raw[rows, out.token_ids])
    expected_ranks = (raw > raw[rows, out.token_ids].unsqueeze(1)).sum(dim=-1) + 1
    assert torch.equal(lp.token_ranks, expected_ranks)
    top = raw.topk(5, dim=-1)
    assert lp.topk_token_ids.shape == (4, 5)  # the widest request sets the width
    assert torch.equal(lp.topk_token_ids, top.indices)
    torch.testing.assert_close(lp.topk_logprobs, top.values)


def test_logprobs_width_zero_when_only_chosen_requested():
    logits = torch.randn(2, VOCAB)
    params = [SamplingParams(logprobs=0, temperature=0)] * 2
    meta = SamplingMetadata.build(params, [None] * 2, [[]] * 2, [[1]] * 2, "cpu")
    lp = Sampler().sample(logits, meta).logprobs
    assert lp.topk_token_ids.shape == (2, 0)
    assert torch.equal(lp.token_ranks, torch.ones(2, dtype=torch.int64))  # greedy = rank 1


def test_prompt_logprobs_score_each_next_prompt_token():
    torch.manual_seed(4)
    prompt = [5, 9, 2, 2, 40]
    logits = torch.randn(len(prompt), VOCAB)  # one row per prompt position
    lp = compute_prompt_logprobs(logits, prompt, 2)
    raw = torch.log_softmax(logits[:-1], dim=-1)
    assert lp.token_logprobs.shape == (len(prompt) - 1,)
    torch.testing.assert_close(lp.token_logprobs, raw[torch.arange(4), torch.tensor(prompt[1:])])
    assert torch.equal(lp.topk_token_ids, raw.topk(2, dim=-1).indices)
    # A prefill chunk covering positions [1, 3) scores prompt[2:4] with its own logits.
    chunk = compute_prompt_logprobs(logits[1:3], prompt[1:4], 2)
    torch.testing.assert_close(chunk.token_logprobs, lp.token_logprobs[1:3])


def test_unseeded_rows_draw_from_the_samplers_stream_and_warm_up_keeps_it():
    params = [SamplingParams(temperature=1.0)] * 3
    meta = SamplingMetadata.build(params, [None] * 3, [[]] * 3, [[1]] * 3, "cpu")
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))

    def draws(seed: int) -> list[int]:
        sampler = Sampler(torch.Generator().manual_seed(seed))
        state = sampler.generator.get_state()
        sampler.warm_up(VOCAB, "cpu")
        assert torch.equal(sampler.generator.get_state(), state)
        return [t for _ in range(8) for t in sampler.sample(logits, meta).token_ids.tolist()]

    torch.manual_seed(1)
    first = draws(5)
    torch.manual_seed(2)  # torch's default stream plays no part
    assert draws(5) == first
    assert draws(6) != first

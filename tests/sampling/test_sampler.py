"""Sampler pipeline on CPU: greedy, filters, temperature statistics, penalties, min_tokens,
logit_bias, allowed_token_ids, bad words."""

import pytest
import torch

from kiln.sampling import SAMPLING_EPS, Sampler, SamplingMetadata, SamplingParams
from kiln.sampling.sampler import apply_penalties, bad_words_banned

VOCAB = 12


def build(params, outputs=None, prompts=None, generators=None, eos=()):
    n = len(params)
    return SamplingMetadata.build(
        params,
        generators or [None] * n,
        outputs or [[] for _ in range(n)],
        prompts or [[1] for _ in range(n)],
        "cpu",
        eos_token_ids=eos,
    )


def distinct_logits(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    # Distinct values keep the top-k / nucleus sets free of ties.
    g = torch.Generator().manual_seed(seed)
    base = torch.randperm(vocab, generator=g).float() * 0.37
    return (base + 0.01 * torch.rand(vocab, generator=g)).expand(num_rows, vocab).contiguous()


def draw(params: SamplingParams, logits_row: torch.Tensor, num_draws: int) -> torch.Tensor:
    """num_draws independent samples: the same row repeated num_draws times in one batch."""
    logits = logits_row.expand(num_draws, -1).contiguous()
    return Sampler().sample(logits, build([params] * num_draws)).token_ids


def test_greedy_is_argmax_and_ignores_filters():
    torch.manual_seed(0)
    logits = torch.randn(7, 50)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.3)] * 7
    out = Sampler().sample(logits, build(params))
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None


def test_mixed_batch_greedy_rows_take_argmax():
    torch.manual_seed(1)
    logits = torch.randn(6, 40)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.3, top_k=5) for i in range(6)]
    before = logits.clone()
    tokens = Sampler().sample(logits, build(params)).token_ids
    assert torch.equal(logits, before)  # the caller's logits are not modified
    assert torch.equal(tokens[1::2], logits[1::2].argmax(dim=-1))
    top5 = logits.topk(5, dim=-1).indices
    assert all(tokens[i] in top5[i] for i in range(0, 6, 2))


def test_top_k_never_leaves_allowed_set():
    row = distinct_logits(1, VOCAB, seed=2)[0]
    allowed = set(row.topk(4).indices.tolist())
    torch.manual_seed(3)
    seen = set(draw(SamplingParams(top_k=4, temperature=2.0), row, 4000).tolist())
    assert seen == allowed  # never outside, and every allowed token does come up


def nucleus(probs: torch.Tensor, p: float) -> set[int]:
    """Smallest top set whose mass reaches p (float64 reference)."""
    order = probs.double().argsort(descending=True)
    kept, mass = set(), 0.0
    for t in order.tolist():
        if mass >= p:
            break
        kept.add(t)
        mass += probs[t].item()
    return kept


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.6), (0, 0.9), (6, 0.7)])
def test_top_p_never_leaves_nucleus(top_k, top_p):
    row = distinct_logits(1, VOCAB, seed=4)[0] / 1.5
    probs = torch.softmax(row.double(), dim=-1)
    if top_k:  # top-p applies to the renormalized top-k distribution
        keep = row.topk(top_k).indices
        probs = torch.zeros_like(probs).index_copy_(0, keep, probs[keep])
        probs /= probs.sum()
    allowed = nucleus(probs, top_p)
    assert 1 < len(allowed) < VOCAB  # the filter is doing something
    torch.manual_seed(5)
    seen = set(draw(SamplingParams(top_k=top_k, top_p=top_p), row, 4000).tolist())
    assert seen == allowed


def test_min_p_never_leaves_allowed_set():
    row = distinct_logits(1, VOCAB, seed=6)[0]
    probs = torch.softmax(row, dim=-1)
    allowed = set((probs >= 0.1 * probs.max()).nonzero().flatten().tolist())
    assert 1 < len(allowed) < VOCAB
    torch.manual_seed(7)
    seen = set(draw(SamplingParams(min_p=0.1), row, 4000).tolist())
    assert seen == allowed


def test_min_p_applies_before_top_p_as_in_vllm():
    # probs 0.4, 0.3, 0.1 x 3. min_p 0.3 keeps {0, 1} (>= 0.12), renormalized to 4/7, 3/7;
    # top_p 0.5 over those keeps {0} alone (vLLM v1's order). Top-p first (transformers'
    # order) would keep {0, 1} (0.4 < 0.5) and min-p would then keep both.
    row = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1]).log()
    torch.manual_seed(13)
    tokens = draw(SamplingParams(top_p=0.5, min_p=0.3), row, 2000)
    assert set(tokens.tolist()) == {0}
    # top_p 0.6: token 1 crosses p over min-p's set and is kept, as vLLM keeps it.
    tokens = draw(SamplingParams(top_p=0.6, min_p=0.3), row, 2000)
    assert set(tokens.tolist()) == {0, 1}


def test_rows_without_filters_unaffected_by_filtered_neighbours():
    row = distinct_logits(1, VOCAB, seed=8)[0] / 3.0
    logits = row.expand(2000, -1).contiguous()
    params = [SamplingParams(top_k=2, top_p=0.5, min_p=0.2), SamplingParams()] * 1000
    torch.manual_seed(9)
    tokens = Sampler().sample(logits, build(params)).token_ids
    assert set(tokens[1::2].tolist()) == set(range(VOCAB))
    assert set(tokens[0::2].tolist()) <= set(row.topk(2).indices.tolist())


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.5])
def test_temperature_frequencies_match_softmax(temperature):
    logits = torch.tensor([1.0, 0.2, -0.5, 0.8, -1.2])
    target = torch.softmax(logits / temperature, dim=-1)
    torch.manual_seed(10)
    tokens = draw(SamplingParams(temperature=temperature), logits, 40000)
    # df = 4: P(chi2 > 30) < 1e-5, so a correct sampler passes with a wide margin; a sampler
    # using the wrong temperature (checked below) lands in the hundreds.
    assert chi_square(tokens, target) < 30
    other = torch.softmax(logits / (temperature * 1.5), dim=-1)
    assert chi_square(tokens, other) > 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smallest_sampled_temperature_stays_finite(dtype):
    # vLLM raises temperatures below 0.01 to 0.01 against NaNs; Kiln keeps them (params.py),
    # which is safe only while 1e-5 over large and masked logits draws cleanly.
    torch.manual_seed(14)
    logits = torch.randn(8, 1000) * 50
    logits[:, :100] = float("-inf")
    params = SamplingParams(temperature=SAMPLING_EPS, top_p=0.9, min_p=0.1, logprobs=2)
    assert not params.greedy
    out = Sampler().sample(logits.to(dtype), build([params] * 8))
    assert torch.equal(out.token_ids, logits.to(dtype).float().argmax(dim=-1))
    assert torch.isfinite(out.logprobs.token_logprobs).all()


def test_penalties_match_hand_computed_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.9]] * 2)
    penalized = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    meta = build(
        [penalized, SamplingParams()],
        outputs=[[3, 3, 2], [3, 3, 2]],
        prompts=[[0, 4], [0, 4]],
    )
    out = apply_penalties(logits.clone(), meta)
    # Repetition over prompt+output {0, 2, 3, 4}: positive / 2, negative * 2:
    #   0: 2 -> 1, 2: 0.5 -> 0.25, 3: 3 -> 1.5, 4: -2 -> -4.
    # Then output counts {3: 2, 2: 1}: minus 0.25 * count, minus 0.5 if present:
    #   3: 1.5 - 0.5 - 0.5 = 0.5, 2: 0.25 - 0.25 - 0.5 = -0.5.
    expected = torch.tensor([1.0, -1.0, -0.5, 0.5, -4.0, 0.9])
    torch.testing.assert_close(out[0], expected, rtol=0, atol=1e-6)
    assert torch.equal(out[1], logits[1])  # the neighbour has no penalties
    greedy = [
        SamplingParams(
            temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25
        )
    ]
    meta = build(greedy, outputs=[[3, 3, 2]], prompts=[[0, 4]])
    assert Sampler().sample(logits[:1], meta).token_ids.item() == 0  # was 3 before penalties


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    sample = lambda p, outputs: (
        Sampler().sample(logits, build([p], outputs=[outputs], eos=[0])).token_ids.item()
    )
    assert sample(params, [3]) == 2  # EOS (0) and stop id 1 masked
    assert sample(params, [3, 3]) == 0  # min_tokens reached


def test_min_tokens_masks_eos_even_with_ignore_eos():
    # vLLM masks every EOS id during min_tokens whatever ignore_eos says (ignore_eos only keeps
    # EOS from ending the output), so the first min_tokens tokens are never EOS.
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0]])
    ignore = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1], ignore_eos=True)
    sample = lambda outputs: (
        Sampler().sample(logits, build([ignore], outputs=[outputs], eos=[0])).token_ids.item()
    )
    assert sample([3]) == 2
    assert sample([3, 3]) == 0  # past min_tokens EOS is an ordinary token


def test_logit_bias_adds_to_the_logits_of_its_row_only():
    logits = distinct_logits(3, VOCAB, seed=4)
    first, second = logits[0].topk(2).indices.tolist()
    gap = float(logits[0, first] - logits[0, second])
    params = [SamplingParams(temperature=0.0, logit_bias={second: gap + 0.05}),
              SamplingParams(temperature=0.0, logit_bias={second: gap - 0.05}),
              SamplingParams(temperature=0.0)]
    tokens = Sampler().sample(logits, build(params)).token_ids.tolist()
    assert tokens == [second, first, first]
    banned = SamplingParams(temperature=0.0, logit_bias={first: -100})
    assert Sampler().sample(logits[:1], build([banned])).token_ids.tolist() == [second]


def test_logit_bias_comes_before_the_repetition_penalty_as_in_vllm():
    # token 0 (seen in the prompt) at 2.0 +2 bias, then / 2: 2.0, under token 1's 2.5; the
    # other order (2.0 / 2 + 2 = 3.0) would pick token 0
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 0], logits[0, 1] = 2.0, 2.5
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={0: 2.0})
    meta = build([params], prompts=[[0]])
    assert Sampler().sample(logits, meta).token_ids.tolist() == [1]


def test_allowed_token_ids_nothing_outside_is_sampled_even_at_high_temperature():
    num_draws, vocab, allowed = 2000, 50, [3, 17, 29, 41]
    row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5))
    logits = row.expand(num_draws, vocab).contiguous()
    # at temperature 5 the 50 tokens are near uniform: 1000 draws hit every allowed id
    params = [SamplingParams(temperature=5.0, allowed_token_ids=allowed),
              SamplingParams(temperature=5.0)] * (num_draws // 2)
    sampler = Sampler(torch.Generator().manual_seed(0))
    tokens = sampler.sample(logits, build(params)).token_ids
    assert set(tokens[0::2].tolist()) == set(allowed)
    assert not set(tokens[1::2].tolist()) <= set(allowed)  # the rows beside them: unmasked


def test_allowed_token_ids_greedy_takes_the_best_allowed_and_a_bias_cannot_bring_back_others():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(6)).expand(4, VOCAB)
    order = logits[0].argsort(descending=True).tolist()
    allowed = order[3:6]
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed),
              # masked first, as in vLLM: -inf + 100 is still -inf
              SamplingParams(temperature=0.0, allowed_token_ids=allowed,
                             logit_bias={order[0]: 100}),
              SamplingParams(temperature=0.0, allowed_token_ids=allowed,
                             logit_bias={order[5]: 100}),
              SamplingParams(temperature=0.0)]
    tokens = Sampler().sample(logits.contiguous(), build(params)).token_ids.tolist()
    assert tokens == [order[3], order[3], order[5], order[0]]


@pytest.mark.parametrize(("output", "banned"), [
    ([], {5}), ([1], {5, 3}), ([2, 1], {5, 3}), ([1, 2], {5, 7}), ([1, 2, 6], {5})])
def test_bad_words_ban_a_words_last_token_where_the_output_ends_with_the_rest(output, banned):
    # vLLM v1's rule (vllm/v1/sample/ops/bad_words.py): a one-token word always
    assert bad_words_banned([[5], [1, 3], [1, 2, 7]], output) == banned


def test_bad_words_in_the_sampler_follow_the_output_not_the_prompt():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(7))
    first, second, third = logits[0].topk(3).indices.tolist()
    other = next(t for t in range(VOCAB) if t not in (first, second, third))

    def greedy(params, output, prompt=(1,)):
        meta = build([params], outputs=[output], prompts=[list(prompt)])
        return Sampler().sample(logits, meta).token_ids.item()

    word = SamplingParams(temperature=0.0, bad_words_token_ids=[[other, first]])
    assert greedy(word, [second, other]) == second  # the word would end here: first banned
    assert greedy(word, [other, second]) == first
    assert greedy(word, [], prompt=[other]) == first  # as in vLLM: the prompt does not count
    both = SamplingParams(temperature=0.0, bad_words_token_ids=[[first]], min_tokens=1,
                          stop_token_ids=[second])
    assert greedy(both, []) == third  # min_tokens' ban and the word's together
    assert greedy(both, [third]) == second


def test_a_bad_word_never_completes_even_at_high_temperature():
    num_draws, vocab = 2000, 20
    row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(8))
    params = SamplingParams(temperature=5.0, bad_words_token_ids=[[4, 9]])
    outputs = [[1, 4], [4, 1]] * (num_draws // 2)  # the prefix at the end, then not
    meta = build([params] * num_draws, outputs=outputs)
    sampler = Sampler(torch.Generator().manual_seed(0))
    tokens = sampler.sample(row.expand(num_draws, vocab).contiguous(), meta).token_ids
    assert 9 not in tokens[0::2].tolist()
    assert 9 in tokens[1::2].tolist()


def test_build_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="one row per sequence"):
        SamplingMetadata.build([SamplingParams()], [None, None], [[]], [[1]], "cpu")

"""allowed_token_ids, bad words and prompt logprob ranks through the paged engine and kiln.LLM,
against the reference generator (which tokenizes bad words as the engine does)."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import generate_in_order, make_engine

import kiln
from kiln.engine.reference import reference_generate

P = kiln.SamplingParams
GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=12)
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Unicode: café"]


def reference(engine, prompts, params) -> list[kiln.RequestOutput]:
    with torch.inference_mode():
        return reference_generate(engine.loaded, prompts, params, engine.max_model_len)


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> kiln.LLM:
    return kiln.LLM(str(tiny_llama), device="cpu", dtype="float32", max_model_len=128,
                    num_kv_blocks=64)


def test_allowed_token_ids_confine_every_token_greedy_or_sampled(tiny_llama):
    engine = make_engine(tiny_llama)
    prompts = [[10, 20, 30, 40], [50, 60]]
    allowed = [5, 19, 230, 267, 302]
    params = [P(allowed_token_ids=allowed, **GREEDY),
              P(allowed_token_ids=allowed, n=2, temperature=1.5, seed=3, ignore_eos=True,
                max_tokens=12)]
    free = token_ids(generate_in_order(engine, prompts[:1], [P(**GREEDY)]))
    assert not set(free[0]) <= set(allowed)  # unconfined, the model picks others
    got = token_ids(generate_in_order(engine, prompts, params))
    assert all(set(ids) <= set(allowed) for ids in got), got
    assert len({tuple(ids) for ids in got}) > 1
    assert got == token_ids(reference(engine, prompts, params))


def test_allowed_token_ids_outside_the_vocabulary_are_refused_by_name(tiny_llama):
    engine = make_engine(tiny_llama)
    vocab_size = engine.loaded.arch.vocab_size
    with pytest.raises(ValueError, match=rf"SamplingParams.allowed_token_ids \[{vocab_size}\] "
                                         rf"are outside the vocabulary \[0, {vocab_size}\)"):
        engine.add_request("a", [5, 6], P(allowed_token_ids=[3, vocab_size]))
    assert not engine.requests


def test_a_one_token_bad_word_is_never_generated(llm):
    """kiln.LLM tokenizes the word (as vLLM: stripped, and after a space) once per request."""
    tok = llm.tokenizer
    [free] = llm.generate(PROMPTS[0], P(**GREEDY))
    ids = free.outputs[0].token_ids
    # the first output token after the first that the tokenizer writes alone for its text
    at, word = next((i, w) for i, t in enumerate(ids) if i and (w := tok.decode([t])).strip()
                    and tok.encode(w.lstrip(), add_special_tokens=False) == [t])
    [out] = llm.generate(PROMPTS[0], P(bad_words=[word], **GREEDY))
    got = out.outputs[0].token_ids
    assert got[:at] == ids[:at] and ids[at] not in got


def completes(words: list[list[int]], ids: list[int]) -> list[int]:
    """The positions in ``ids`` where one of the words ends (after its other tokens)."""
    return [i for i in range(len(ids)) for w in words
            if i + 1 >= len(w) and ids[i + 1 - len(w):i + 1] == w]


@pytest.mark.parametrize("as_text", [False, True])
def test_a_bad_word_bans_its_last_token_right_after_the_rest(tiny_llama, as_text):
    """A two-token word from the greedy output: banned, the output follows the free one up to
    where the word would end and differs there. A chained step (async scheduling, on by default)
    is built before the host holds the token before it, so such a request is not chained."""
    engine = make_engine(tiny_llama)
    tok = engine.tokenizer
    [free] = generate_in_order(engine, PROMPTS[:1], [P(**GREEDY)])
    ids = free.outputs[0].token_ids
    if as_text:  # two output tokens the tokenizer writes that way from their text
        pair = next(ids[j - 1:j + 1] for j in range(1, len(ids))
                    if tok.encode(tok.decode(ids[j - 1:j + 1]).lstrip(),
                                  add_special_tokens=False) == ids[j - 1:j + 1])
        params = P(bad_words=[tok.decode(pair)], **GREEDY)
    else:
        params = P(bad_words_token_ids=[ids[:2]], **GREEDY)
    words = params.with_bad_words_tokenized(tok).bad_words_token_ids
    at = completes(words, ids)[0]
    [got] = generate_in_order(engine, PROMPTS[:1], [params])
    out = got.outputs[0].token_ids
    assert out[:at] == ids[:at] and out[at] != ids[at]
    assert not completes(words, out)
    assert out == token_ids(reference(engine, [free.prompt_token_ids], [params]))[0]


def test_prompt_logprob_ranks_match_the_reference_and_the_logprobs(tiny_llama):
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 300) for _ in range(100)] for _ in range(2)]
    params = [P(max_tokens=4, temperature=0.0, prompt_logprobs=2)] * 2
    engine = make_engine(tiny_llama, max_num_batched_tokens=32)  # scored over four chunks
    got = generate_in_order(engine, prompts, params)
    for prompt, out, ref in zip(prompts, got, reference(engine, prompts, params), strict=True):
        ranks = out.prompt_logprob_ranks
        assert ranks[0] is None and ranks == ref.prompt_logprob_ranks
        for token, entry, rank in zip(prompt[1:], out.prompt_logprobs[1:], ranks[1:],
                                      strict=True):
            above = sum(lp > entry[token] for lp in entry.values())
            # in the top 2: its place among them; else below both, ranked past them
            assert rank == 1 + above if token in sorted(entry, key=entry.get)[-2:] else (
                above == 2 and rank > 2), (token, entry, rank)
    assert any(rank > 3 for rank in got[0].prompt_logprob_ranks[1:])

"""Sliding-window models through the engine paths that move or reuse KV: preemption (recompute and
swap), prefix caching of a prefix longer than the window, chunked prefill with chunks that start
past the window, n > 1 forks, and an fp8 KV cache. float32 on CPU, transformers as the oracle.

A tiny random Mistral (every layer slides, window 8) and Qwen2 (use_sliding_window, layers 1 and 2
of 3 slide with window 12, layer 0 attends to everything), blocks of 4 tokens, prompts several
windows long, and budgets small enough that each path really runs (asserted).
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import assert_greedy_matches, hf_greedy, hf_model, random_prompts
from tiny_models import build_model

import kiln

CASES = {
    "mistral": ("mistral", dict(sliding_window=8)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=12, max_window_layers=1,
                            num_hidden_layers=3)),
}
GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=5)
# KV pools (blocks) small enough for the preemption tests to preempt: every Mistral layer slides,
# so its sequences give back the blocks out of the window (kiln/cache/window.py) and hold fewer
PREEMPTING_POOL = {"mistral": 16, "qwen2": 32}
SWAPPING_FP8_POOL = {"mistral": 9, "qwen2": 24}


@pytest.fixture(scope="module")
def sliding_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sliding-engine")
    return {name: build_model(variant, root / name, seed=7, tokenizer=False, **fields)
            for name, (variant, fields) in CASES.items()}


@pytest.fixture(scope="module")
def hf_refs(sliding_dirs) -> dict:
    return {name: hf_model(path) for name, path in sliding_dirs.items()}


def make_llm(path, **options) -> kiln.LLM:
    options = {"dtype": "float32", "device": "cpu", "block_size": 4, "num_kv_blocks": 256,
               **options}
    return kiln.LLM(str(path), **options)


def window_of(llm: kiln.LLM) -> int:
    return max(w for w in llm.engine.loaded.arch.layer_windows if w is not None)


def hf_prompt_logprobs(ref, prompt: list[int]) -> torch.Tensor:
    """log p(prompt[i] | prompt[:i]) for i >= 1, from one full forward (the sliding mask)."""
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def kiln_prompt_logprobs(out) -> torch.Tensor:
    assert out.prompt_logprobs[0] is None
    return torch.tensor([lp[t] for lp, t in zip(out.prompt_logprobs[1:],
                                                out.prompt_token_ids[1:], strict=True)])


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_past_the_window_matches_transformers(name, mode, sliding_dirs, hf_refs):
    """Eight requests of 3-5 windows, two of them n = 2, in 16 or 32 blocks of 4 tokens with
    16-token steps: they preempt each other mid-decode (recomputed or swapped back in past the
    window) and still decode transformers' greedy tokens."""
    llm = make_llm(sliding_dirs[name], num_kv_blocks=PREEMPTING_POOL[name], max_model_len=128,
                   max_num_batched_tokens=16, preemption_mode=mode, swap_space=0.01)
    window = window_of(llm)
    prompts = random_prompts([3 * window, 4 * window + 1, 5 * window - 2, 3 * window + 3] * 2,
                             llm.engine.loaded.arch.vocab_size, seed=1)
    params = ([kiln.SamplingParams(max_tokens=20, **GREEDY)] * 3
              + [kiln.SamplingParams(n=2, max_tokens=20, **GREEDY)]) * 2
    outputs = llm.generate(prompts, params)
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0
    if mode == "swap":
        assert sched.num_swap_outs > 0
    assert_greedy_matches(hf_refs[name], prompts, outputs, 20, f"{name} {mode}")
    for forked in (outputs[3].outputs, outputs[-1].outputs):
        assert len(forked) == 2 and forked[0].token_ids == forked[1].token_ids


@pytest.mark.parametrize("name", CASES)
def test_prefix_cache_hit_longer_than_the_window_matches_transformers(name, sliding_dirs,
                                                                      hf_refs):
    """A second round of prompts reuses 5 windows' worth of cached blocks: the same prompt, and
    one that branches off 2 tokens before its end. Their continuations attend to cached keys
    inside the window only, and equal transformers'."""
    llm = make_llm(sliding_dirs[name])
    window = window_of(llm)
    first = random_prompts([5 * window + 2], llm.engine.loaded.arch.vocab_size, seed=2)[0]
    params = kiln.SamplingParams(max_tokens=16, **GREEDY)
    llm.generate([first], params)
    hits_before = llm.engine.kv.stats.prefix_cache_hits
    branch = first[:-2] + random_prompts([6], llm.engine.loaded.arch.vocab_size, seed=3)[0]
    prompts = [first, branch]
    outputs = llm.generate(prompts, params)
    # both reuse every full block of the shared part: more than the window, for each
    assert llm.engine.kv.stats.prefix_cache_hits - hits_before >= 2 * 5 * window
    assert all(o.metrics.num_cached_tokens >= 5 * window for o in outputs)
    assert_greedy_matches(hf_refs[name], prompts, outputs, 16, f"{name} prefix")


@pytest.mark.parametrize("name", CASES)
def test_chunked_prompt_logprobs_past_the_window_match_transformers(name, sliding_dirs,
                                                                    hf_refs):
    """Prompts of 6 windows scored in 12-token steps beside a decoding request: their later
    chunks start windows past the first key. Each prompt token's logprob, and the greedy
    continuation, equal transformers'."""
    llm = make_llm(sliding_dirs[name], max_num_batched_tokens=12)
    window = window_of(llm)
    vocab = llm.engine.loaded.arch.vocab_size
    short, *prompts = random_prompts([5, 6 * window, 6 * window + 3], vocab, seed=4)
    engine = llm.engine
    engine.add_request("short", short, kiln.SamplingParams(max_tokens=40, **GREEDY))
    for _ in range(2):  # the short request is decoding when the long prompts arrive
        engine.step()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt,
                           kiln.SamplingParams(max_tokens=4, prompt_logprobs=1, **GREEDY))
    done, steps, mixed = {}, 0, 0
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
        mixed += engine.num_scheduled_last_step > 1
    # the long prompts went in chunks, beside the decoding request
    assert steps >= (len(prompts[0]) + len(prompts[1])) // 12 and mixed > 0
    outputs = [done[str(i)] for i in range(len(prompts))]
    for prompt, out in zip(prompts, outputs, strict=True):
        diff = (kiln_prompt_logprobs(out) - hf_prompt_logprobs(hf_refs[name], prompt)).abs()
        assert diff.max() <= 1e-4, f"{name}: {len(prompt)}-token prompt, worst at {diff.argmax()}"
    assert_greedy_matches(hf_refs[name], prompts, outputs, 4, f"{name} chunked")


@pytest.mark.parametrize("name", CASES)
def test_forks_share_a_prompt_past_the_window(name, sliding_dirs, hf_refs):
    """n = 3 greedy samples of a prompt of 4 windows + 2 tokens (it ends inside a block: copy on
    write) each decode transformers' tokens; seeded samples equal a rerun."""
    llm = make_llm(sliding_dirs[name], max_num_batched_tokens=16)
    window = window_of(llm)
    prompt = random_prompts([4 * window + 2], llm.engine.loaded.arch.vocab_size, seed=5)[0]
    out = llm.generate([prompt], kiln.SamplingParams(n=3, max_tokens=16, **GREEDY))[0]
    expected, _ = hf_greedy(hf_refs[name], prompt, 16)
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    sampled = kiln.SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=9, ignore_eos=True)
    again = [llm.generate([prompt], sampled)[0] for _ in range(2)]
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in again[1].outputs]


def teacher_forced_logprobs(llm: kiln.LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    outs = llm.generate(prompts, kiln.SamplingParams(max_tokens=1, prompt_logprobs=1, **GREEDY))
    return [kiln_prompt_logprobs(o) for o in outs]


@pytest.mark.parametrize("name", CASES)
def test_fp8_kv_cache_windows_like_full_precision(name, sliding_dirs):
    """With an fp8 cache (scales 1.0) the windowed model's prompt logprobs stay within fp8
    rounding of the float32 cache's, chunked over 16-token steps; dropping the window moves them
    far more, so the fp8 run did slide. Swap preemption moves the fp8 blocks bit for bit."""
    path = sliding_dirs[name]
    dense = make_llm(path, max_num_batched_tokens=16)
    fp8 = make_llm(path, max_num_batched_tokens=16, kv_cache_dtype="fp8")
    window = window_of(dense)
    prompts = random_prompts([6 * window, 4 * window + 1], dense.engine.loaded.arch.vocab_size,
                             seed=6)
    want, got = teacher_forced_logprobs(dense, prompts), teacher_forced_logprobs(fp8, prompts)
    for layer in dense.engine.loaded.model.layers:
        layer.self_attn.attn.window = None
    unwindowed = teacher_forced_logprobs(dense, prompts)
    for w, g, u in zip(want, got, unwindowed, strict=True):
        fp8_err = (g - w).abs().max().item()
        window_effect = (u - w)[window:].abs().max().item()
        # e4m3 keeps 3 mantissa bits (2^-4 relative per K/V element); in logprobs of this tiny
        # random model that is a few hundredths
        assert fp8_err <= 0.05, f"{name}: fp8 vs float32 cache {fp8_err:.3g}"
        assert window_effect > 5 * fp8_err, (name, window_effect, fp8_err)

    params = [kiln.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 2
    roomy = fp8.generate(prompts, params)
    tight = make_llm(path, num_kv_blocks=SWAPPING_FP8_POOL[name], max_model_len=96,
                     max_num_batched_tokens=16, kv_cache_dtype="fp8", preemption_mode="swap",
                     swap_space=0.01)
    swapped = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_swap_outs > 0
    assert [o.outputs[0].token_ids for o in swapped] == [o.outputs[0].token_ids for o in roomy]

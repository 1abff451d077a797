"""KV blocks out of every layer's sliding window given back while a sequence runs
(kiln/cache/window.py), through the engine, against transformers (float32 on CPU).

A tiny random Mistral (window 8) and Qwen3 (use_sliding_window from layer 0: every layer slides,
window 12), blocks of 4 tokens, generations many windows long. The torch backend's lookback is
window - 1, so every block before the one holding a query's first visible key is given back:
an off-by-one shows at once. The null block the freed entries name is filled with NaN, so any
read of it would show in the logits.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import assert_greedy_matches, hf_greedy, hf_model, random_prompts
from tiny_models import build_model

import kiln
from kiln.cache import hash_block_tokens, max_blocks_held
from kiln.engine import overlap

BS = 4
CASES = {
    "mistral": ("mistral", dict(sliding_window=8)),
    "qwen3": ("qwen3", dict(use_sliding_window=True, sliding_window=12, max_window_layers=0)),
}
GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("window-freeing")
    dirs = {name: build_model(variant, root / name, seed=7, tokenizer=False, **fields)
            for name, (variant, fields) in CASES.items()}
    # the same Mistral weights with every layer attending to everything
    dirs["mistral-full"] = build_model("mistral", root / "mistral-full", seed=7, tokenizer=False)
    return dirs


@pytest.fixture(scope="module")
def hf_refs(model_dirs) -> dict:
    return {name: hf_model(model_dirs[name]) for name in CASES}


def make_llm(path, **options) -> kiln.LLM:
    """An engine whose null block holds NaN (when every layer slides)."""
    options = {"dtype": "float32", "device": "cpu", "block_size": BS, "num_kv_blocks": 256,
               **options}
    llm = kiln.LLM(str(path), **options)
    null = llm.engine.kv.null_block
    if null is not None:
        llm.engine.kv_cache.kv[:, :, null] = float("nan")
    return llm


def window_of(llm: kiln.LLM) -> int:
    return max(llm.engine.loaded.arch.layer_windows)


def num_freed(llm: kiln.LLM, seq_id: str) -> int:
    kv = llm.engine.kv
    return kv.block_table(seq_id).count(kv.null_block)


def run(llm: kiln.LLM, prompts, params) -> tuple[list, int, int]:
    """Step to the end checking the cache's integrity: (outputs in prompt order, the most blocks
    held after a step, the most table entries any sequence had given back)."""
    engine = llm.engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    done, peak, most_freed = {}, 0, 0
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.kv.check_integrity()
        held = engine.kv.num_usable_blocks - engine.kv.num_free_blocks
        assert engine.stats.kv_usage == held / engine.kv.num_usable_blocks
        peak = max(peak, held)
        most_freed = max([most_freed] + [num_freed(llm, s.seq_id) for r in engine.scheduler.running
                                         for s in r.active_seqs()])
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks
    return [done[str(i)] for i in range(len(prompts))], peak, most_freed


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_decoding_many_windows_past_matches_transformers(name, prefix, model_dirs, hf_refs):
    """Prompts of 2-3 windows decode 8 windows further, one of them as n = 3 samples sharing
    their blocks: transformers' greedy tokens and logprobs, with each sequence holding the
    blocks of its window and no more."""
    llm = make_llm(model_dirs[name], enable_prefix_caching=prefix)
    window = window_of(llm)
    prompts = random_prompts([2 * window + 1, 3 * window + 2], 320, seed=11)
    max_tokens = 8 * window
    params = [kiln.SamplingParams(max_tokens=max_tokens, **GREEDY),
              kiln.SamplingParams(n=3, max_tokens=max_tokens, **GREEDY)]
    outputs, peak, most_freed = run(llm, prompts, params)
    assert_greedy_matches(hf_refs[name], prompts, outputs, max_tokens, name)
    assert len({tuple(c.token_ids) for c in outputs[1].outputs}) == 1
    # the prompts prefill in one step each, then decode one token a step
    lookback = llm.engine.kv.lookback
    bound = sum(n * max_blocks_held(len(p) + max_tokens, len(p), BS, lookback)
                for p, n in zip(prompts, (1, 3), strict=True))
    full = sum(n * -(-(len(p) + max_tokens) // BS) for p, n in zip(prompts, (1, 3), strict=True))
    assert peak <= bound < full / 2
    assert most_freed >= (len(prompts[1]) + max_tokens - window) // BS - 2


@pytest.mark.parametrize("name", CASES)
def test_chained_steps_give_back_blocks(name, model_dirs, hf_refs, monkeypatch):
    """With async scheduling the steps launched from the one in flight allocate and give back
    blocks themselves (at the position after the step in flight): transformers' tokens."""
    freed_in_chain = []
    real = overlap.chain_step

    def spy(prev, scheduler, kv):
        result = real(prev, scheduler, kv)
        if result is not None:
            freed_in_chain.append(max(kv.block_table(item.seq.seq_id).count(kv.null_block)
                                      for item in result[0].scheduled))
        return result

    monkeypatch.setattr("kiln.engine.llm_engine.chain_step", spy)
    llm = make_llm(model_dirs[name], async_scheduling=True)
    window = window_of(llm)
    prompts = random_prompts([2 * window, 3 * window + 1, 1], 320, seed=12)
    max_tokens = 6 * window
    outputs, _, _ = run(llm, prompts, kiln.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                          ignore_eos=True))
    assert max(freed_in_chain) > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_refs[name], prompt, max_tokens)[0]


def test_a_pool_smaller_than_the_generations_needs_no_preemption(model_dirs, hf_refs):
    """Three requests of ~200 tokens in a pool of 64 blocks (256 tokens): with every layer
    sliding they run side by side to the end; the same weights attending to everything must
    preempt. One request of 316 tokens runs in 32 blocks (128 tokens), where a full-attention
    model cannot even start."""
    options = dict(num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=16)
    windowed, full = make_llm(model_dirs["mistral"], **options), make_llm(
        model_dirs["mistral-full"], **options)
    window = window_of(windowed)
    prompts = random_prompts([2 * window, 3 * window + 1, 5 * window - 2], 320, seed=13)
    params = [kiln.SamplingParams(max_tokens=200 - len(p), **GREEDY) for p in prompts]
    outputs, peak, _ = run(windowed, prompts, params)
    assert windowed.engine.scheduler.num_preemptions == 0 and peak < 64 // 2
    for prompt, out, p in zip(prompts, outputs, params, strict=True):
        assert_greedy_matches(hf_refs["mistral"], [prompt], [out], p.max_tokens, "side by side")
    run(full, prompts, params)
    assert full.engine.scheduler.num_preemptions > 0

    long = make_llm(model_dirs["mistral"], num_kv_blocks=32, max_model_len=512,
                    max_num_batched_tokens=16)
    prompt = random_prompts([2 * window], 320, seed=14)
    outputs, peak, _ = run(long, prompt, kiln.SamplingParams(max_tokens=300, **GREEDY))
    assert long.engine.scheduler.num_preemptions == 0 and peak < 31
    assert_greedy_matches(hf_refs["mistral"], prompt, outputs, 300, "longer than the pool")
    with pytest.raises(ValueError, match="needs 128 blocks"):
        make_llm(model_dirs["mistral-full"], num_kv_blocks=32, max_model_len=512,
                 max_num_batched_tokens=16)


@pytest.mark.parametrize("name", CASES)
def test_prefix_hit_after_the_first_blocks_were_evicted(name, model_dirs, hf_refs):
    """A conversation's next turn (its prompt, the reply, a new message) hits the cache up to
    its last full block although the blocks it began with, given back first while it was
    generated, were evicted by the request after it: the hit needs only the blocks the next
    token's attention reaches."""
    llm = make_llm(model_dirs[name], num_kv_blocks=40, max_model_len=256,
                   max_num_batched_tokens=128)
    engine = llm.engine
    window = window_of(llm)
    first = random_prompts([5 * window + 2], 320, seed=15)[0]
    (reply,), _, _ = run(llm, [first], kiln.SamplingParams(max_tokens=3 * window, **GREEDY))
    conversation = first + reply.outputs[0].token_ids
    # blocks never used stand first in the free queue, then the conversation's in the order it
    # gave them back: a prompt of that many blocks and 3 more evicts its first 3
    num_unused = engine.kv.num_usable_blocks - -(-len(conversation) // BS)
    filler = random_prompts([(num_unused + 3) * BS], 320, seed=16)
    run(llm, filler, kiln.SamplingParams(max_tokens=1, temperature=0.0))
    assert engine.kv.gpu_pool.get_cached_block(hash_block_tokens(None, first[:BS])) is None
    turn = conversation + random_prompts([5], 320, seed=17)[0]
    outputs, _, _ = run(llm, [turn], kiln.SamplingParams(max_tokens=2 * window, **GREEDY))
    # the conversation's last token was sampled, never computed: its block is not full
    assert outputs[0].metrics.num_cached_tokens == (len(conversation) - 1) // BS * BS
    assert_greedy_matches(hf_refs[name], [turn], outputs, 2 * window, f"{name} next turn")


def hf_prompt_logprobs(ref, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


@pytest.mark.parametrize("name", CASES)
def test_chunked_prefill_gives_back_blocks_between_chunks(name, model_dirs, hf_refs):
    """A prompt of 10 windows in 12-token chunks beside a decoding request: the blocks behind a
    chunk's window are given back before the prompt is done, and every prompt logprob and the
    continuation equal transformers'."""
    llm = make_llm(model_dirs[name], max_num_batched_tokens=12)
    engine = llm.engine
    window = window_of(llm)
    short, prompt = random_prompts([5, 10 * window], 320, seed=18)
    engine.add_request("short", short, kiln.SamplingParams(max_tokens=12 * window, **GREEDY))
    engine.step()
    engine.add_request("long", prompt,
                       kiln.SamplingParams(max_tokens=2 * window, prompt_logprobs=1, **GREEDY))
    done, freed_mid_prompt = {}, 0
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        engine.kv.check_integrity()
        long = engine.requests.get("long")
        if long is not None and long.seqs[0].num_computed_tokens < len(prompt):
            freed_mid_prompt = max(freed_mid_prompt, num_freed(llm, long.seqs[0].seq_id))
    # seen after each step, when the last chunk given back for started 2-3 chunks before the end
    assert freed_mid_prompt >= (len(prompt) - 3 * 12 - window) // BS
    out = done["long"]
    got = torch.tensor([lp[t] for lp, t in zip(out.prompt_logprobs[1:], prompt[1:],
                                               strict=True)])
    assert (got - hf_prompt_logprobs(hf_refs[name], prompt)).abs().max() <= 1e-4
    assert_greedy_matches(hf_refs[name], [prompt], [out], 2 * window, f"{name} chunked")
    assert_greedy_matches(hf_refs[name], [short], [done["short"]], 12 * window, f"{name} short")


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_many_windows_past_matches_transformers(name, mode, model_dirs, hf_refs,
                                                         monkeypatch):
    """Eight requests (two of them n = 2) decoding 6 windows in 20 blocks preempt each other:
    recomputed, or swapped out and back in with only the blocks they still hold (never the null
    block), and still decode transformers' tokens."""
    llm = make_llm(model_dirs[name], num_kv_blocks=20, max_model_len=256,
                   max_num_batched_tokens=16, preemption_mode=mode, swap_space=0.01)
    gpu_moved = []  # the GPU side of every swapped block

    def recording(real, gpu_side: int):
        def swap(pairs):
            gpu_moved.extend(pair[gpu_side] for pair in pairs)
            real(pairs)
        return swap

    kv_cache = llm.engine.kv_cache
    monkeypatch.setattr(kv_cache, "swap_out", recording(kv_cache.swap_out, 0))
    monkeypatch.setattr(kv_cache, "swap_in", recording(kv_cache.swap_in, 1))
    window = window_of(llm)
    prompts = random_prompts([2 * window, 3 * window + 1, 4 * window - 2, 2 * window + 3] * 2,
                             320, seed=19)
    max_tokens = 6 * window
    params = ([kiln.SamplingParams(max_tokens=max_tokens, **GREEDY)] * 3
              + [kiln.SamplingParams(n=2, max_tokens=max_tokens, **GREEDY)]) * 2
    outputs, _, most_freed = run(llm, prompts, params)
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and most_freed > 0
    if mode == "swap":
        assert sched.num_swap_outs > 0
        assert gpu_moved and llm.engine.kv.null_block not in gpu_moved
    assert_greedy_matches(hf_refs[name], prompts, outputs, max_tokens, f"{name} {mode}")
    for i in (3, 7):
        assert len({tuple(c.token_ids) for c in outputs[i].outputs}) == 1

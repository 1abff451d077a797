"""Sliding-window attention against transformers, float32 on CPU.

Tiny random Mistral (every layer slides, window 8) and Qwen2 (use_sliding_window with
max_window_layers=1 of 3 layers: layers 1 and 2 slide, window 12), with prompts several windows
long: one flat varlen prefill, a prefill continued in chunks over its cached prefix, and the
engine's greedy decode (prefix caching, chunked prompts, paged blocks of 4) run past the window.
Kiln used to cap these models' context at the window.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_reference import assert_greedy_matches, hf_model, random_prompts
from tiny_models import build_model

import kiln
from kiln.layers.attention import contiguous_kv_caches, contiguous_metadata
from kiln.models import load_model

# name -> (tiny_models variant, config fields)
CASES = {
    "mistral": ("mistral", dict(sliding_window=8)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=12, max_window_layers=1,
                            num_hidden_layers=3)),
}
PROMPT_LENS = [1, 7, 8, 9, 13, 30, 70]  # under, at and past each window, in one flat batch


@pytest.fixture(scope="module")
def sliding_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sliding")
    return {name: build_model(variant, root / name, seed=3, tokenizer=False, **fields)
            for name, (variant, fields) in CASES.items()}


def forward(model, caches, prompts: list[list[int]], start: list[int],
            stop: list[int]) -> torch.Tensor:
    """Logits of tokens start[b]:stop[b] of each prompt, its earlier tokens already cached."""
    new = [e - s for s, e in zip(start, stop, strict=True)]
    meta = contiguous_metadata(start, new, max(PROMPT_LENS), caches, torch.device("cpu"))
    ids = torch.tensor([t for p, s, e in zip(prompts, start, stop, strict=True) for t in p[s:e]])
    positions = torch.tensor([i for s, e in zip(start, stop, strict=True) for i in range(s, e)])
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, meta))


@pytest.mark.parametrize("name", CASES)
def test_each_layer_gets_its_window(name, sliding_dirs):
    """arch.py's per-layer windows reach the attention layers as transformers' layer_types say."""
    config = transformers.AutoConfig.from_pretrained(str(sliding_dirs[name]))
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * 2  # Mistral
    expected = [config.sliding_window if t == "sliding_attention" else None for t in layer_types]
    model = load_model(str(sliding_dirs[name]), dtype="float32", device="cpu").model
    assert [layer.self_attn.attn.window for layer in model.layers] == expected
    assert any(w is None for w in expected) == (name == "qwen2")


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("chunks", [1, 3], ids=["whole", "3-chunks"])
def test_prefill_logits_match_transformers(name, chunks, sliding_dirs):
    """All prompts in one flat forward, or each in 3 chunks over its cached prefix (a chunk's
    queries then see keys of earlier chunks only through the window)."""
    path = sliding_dirs[name]
    model = load_model(str(path), dtype="float32", device="cpu").model
    prompts = random_prompts(PROMPT_LENS, model.cfg.vocab_size, seed=len(name))
    caches = contiguous_kv_caches(model.cfg.num_layers, len(prompts), max(PROMPT_LENS),
                                  model.num_kv_heads, model.cfg.head_dim, torch.float32,
                                  torch.device("cpu"))
    bounds = [[n * i // chunks for n in PROMPT_LENS] for i in range(chunks + 1)]
    logits = [forward(model, caches, prompts, start, stop)
              for start, stop in zip(bounds, bounds[1:], strict=False)]
    ref = hf_model(path)
    offsets = [0] * chunks
    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0]
        got = []
        for i in range(chunks):
            n = bounds[i + 1][b] - bounds[i][b]
            got.append(logits[i][offsets[i]:offsets[i] + n])
            offsets[i] += n
        diff = (torch.cat(got) - expected).abs().max().item()
        assert diff <= 1e-4, f"{name}: max |logit diff| {diff:.2e}, {len(prompt)}-token prompt"


@pytest.mark.parametrize("name", CASES)
def test_engine_greedy_decode_past_the_window_matches_transformers(name, sliding_dirs):
    """Greedy decode 24 tokens past prompts shorter than, as long as and 3x the window, in
    blocks of 4 with 16-token steps (the long prompts arrive in chunks); a second request
    repeats a prompt, so prefix caching serves its start. Tokens equal transformers' and the
    top-5 logprobs agree."""
    path = sliding_dirs[name]
    llm = kiln.LLM(str(path), dtype="float32", device="cpu", block_size=4,
                   max_num_batched_tokens=16, num_kv_blocks=256)
    window = max(w for w in llm.engine.loaded.arch.layer_windows if w is not None)
    assert llm.max_model_len == 512  # max_position_embeddings, no longer the window
    prompts = random_prompts([5, window, 3 * window], llm.engine.loaded.arch.vocab_size, seed=11)
    prompts.append(prompts[-1][:-2])
    params = kiln.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)
    outputs = llm.generate(prompts, params)
    assert_greedy_matches(hf_model(path), prompts, outputs, 24, name)


@pytest.mark.parametrize("name", CASES)
def test_engine_matches_transformers_generate_with_its_sliding_cache(name, sliding_dirs):
    """transformers' own generate keeps only window - 1 past keys a sliding layer (its
    DynamicSlidingWindowLayer): the same continuation."""
    path = sliding_dirs[name]
    llm = kiln.LLM(str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=256)
    prompt = random_prompts([40], llm.engine.loaded.arch.vocab_size, seed=5)[0]
    out = llm.generate([prompt], kiln.SamplingParams(max_tokens=20, temperature=0.0,
                                                     ignore_eos=True))
    expected = hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=20,
                                       do_sample=False, min_new_tokens=20, pad_token_id=0,
                                       eos_token_id=None)
    assert out[0].outputs[0].token_ids == expected[0, len(prompt):].tolist()

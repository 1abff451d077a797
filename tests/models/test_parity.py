"""Kiln's Llama-family implementation against Hugging Face transformers, float32 on CPU."""

from __future__ import annotations

import pytest
import torch
from hf_reference import assert_greedy_matches, hf_model, random_prompts

import kiln
from kiln.layers.attention import contiguous_kv_caches, contiguous_metadata
from kiln.models import load_model

VARIANT_NAMES = ["llama2", "llama3.1", "mistral", "qwen2", "qwen3"]
PROMPT_LENS = [1, 7, 33, 70]  # different lengths in one flat batch


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_logits_match_transformers(variant, tiny_model_dirs):
    path = tiny_model_dirs[variant]
    loaded = load_model(str(path), dtype="float32", device="cpu")
    model, cfg = loaded.model, loaded.arch
    prompts = random_prompts(PROMPT_LENS, cfg.vocab_size, seed=hash(variant) % 1000)
    # all prompts in one flat varlen forward, as the engine runs them
    max_len = max(PROMPT_LENS)
    caches = contiguous_kv_caches(cfg.num_layers, len(prompts), max_len, model.num_kv_heads,
                                  cfg.head_dim, torch.float32, torch.device("cpu"))
    meta = contiguous_metadata([0] * len(prompts), PROMPT_LENS, max_len, caches,
                               torch.device("cpu"))
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for n in PROMPT_LENS for i in range(n)])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions, meta))
    ref = hf_model(path)
    offset = 0
    for prompt in prompts:
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0]
        got = logits[offset:offset + len(prompt)]
        offset += len(prompt)
        diff = (got - expected).abs().max().item()
        assert diff <= 1e-4, f"{variant}: max |logit diff| {diff:.2e}, {len(prompt)}-token prompt"


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_greedy_and_logprobs_match_transformers(variant, tiny_model_dirs):
    path = tiny_model_dirs[variant]
    llm = kiln.LLM(str(path), dtype="float32", device="cpu")
    prompts = random_prompts(PROMPT_LENS, llm.engine.loaded.arch.vocab_size, seed=7)[1:]
    params = kiln.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)
    outputs = llm.generate(prompts, params)
    assert all(out.outputs[0].finish_reason == "length" for out in outputs)
    assert_greedy_matches(hf_model(path), prompts, outputs, 32, variant)

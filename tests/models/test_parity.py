"""Kiln's Llama-family implementation against Hugging Face transformers, float32 on CPU."""

from __future__ import annotations

import pytest
import torch
import transformers

import kiln
from kiln.layers.attention import contiguous_kv_caches, contiguous_metadata
from kiln.models import load_model

VARIANT_NAMES = ["llama2", "llama3.1", "mistral", "qwen2", "qwen3"]
PROMPT_LENS = [1, 7, 33, 70]  # different lengths in one flat batch


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def random_prompts(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_logits_match_transformers(variant, tiny_model_dirs):
    path = tiny_model_dirs[variant]
    loaded = load_model(str(path), dtype="float32", device="cpu")
    model, cfg = loaded.model, loaded.arch
    prompts = random_prompts(cfg.vocab_size, seed=hash(variant) % 1000)
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


def hf_greedy(ref, prompt: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation by full recomputation, plus each step's log-softmax."""
    ids, logprobs = list(prompt), []
    for _ in range(num_tokens):
        with torch.no_grad():
            last = ref(torch.tensor([ids])).logits[0, -1].float()
        logprobs.append(last.log_softmax(-1))
        ids.append(int(last.argmax()))
    return ids[len(prompt):], logprobs


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_greedy_and_logprobs_match_transformers(variant, tiny_model_dirs):
    path = tiny_model_dirs[variant]
    llm = kiln.LLM(str(path), dtype="float32", device="cpu")
    prompts = random_prompts(llm.engine.loaded.arch.vocab_size, seed=7)[1:]
    params = kiln.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)
    outputs = llm.generate(prompts, params)
    ref = hf_model(path)
    for prompt, out in zip(prompts, outputs, strict=True):
        expected_ids, expected_lps = hf_greedy(ref, prompt, 32)
        completion = out.outputs[0]
        assert completion.token_ids == expected_ids, f"{variant}: greedy continuation differs"
        assert completion.finish_reason == "length"
        for step, (entry, lp) in enumerate(zip(completion.logprobs, expected_lps, strict=True)):
            top = lp.topk(5)
            assert set(top.indices.tolist()) <= set(entry), f"{variant}: step {step} top-5 ids"
            for token, value in entry.items():
                assert abs(value - lp[token].item()) <= 1e-4, f"{variant}: step {step}, {token}"

"""Sliding-window models on the GPU (`pytest -m gpu`): the engine's Triton attention (prefill,
decode and the k_new path) and CUDA graphs against transformers, float32, on tiny random Mistral
and Qwen2 checkpoints of head dim 64 whose prompts and outputs run several windows long; with
an fp8 KV cache, against the torch backend reading the same codes (both backends write
bit-identical fp8 codes, tests/kernels/test_kernel_rotary_kv_cache.py, so the runs differ only in
attention arithmetic: 1e-3 in a logprob is plenty).

float32 so that rounding does not flip near-ties: Triton's float32 dots run in IEEE precision,
cuBLAS' without TF32. Each generated token is checked against transformers' distribution on
Kiln's own sequence (one forward each), so a late token is judged in its own context.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import TRITON_GEOMETRY, build_model

import kiln

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU")]

# name -> (tiny_models variant, config fields): windows off the 32- and 64-key tiles
CASES = {
    "mistral": ("mistral", dict(sliding_window=40)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=24, max_window_layers=1,
                            num_hidden_layers=3)),
}


@pytest.fixture(scope="module")
def sliding_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sliding-gpu")
    return {name: build_model(variant, root / name, seed=3, tokenizer=False,
                              **{**TRITON_GEOMETRY, **fields})
            for name, (variant, fields) in CASES.items()}


@pytest.mark.parametrize("name", CASES)
def test_triton_engine_with_graphs_follows_transformers_past_the_window(name, sliding_dirs):
    """Prompts of 5 tokens to 7 windows (the longest arrives in 64-token chunks), one repeating
    another's start (a prefix-cache hit, then a chunk over it), 48 greedy tokens each: at every
    step Kiln's top-5 logprobs are transformers' to 1e-3 and its token is transformers' argmax
    or within 1e-3 of it."""
    path = sliding_dirs[name]
    llm = kiln.LLM(str(path), dtype="float32", device="cuda", attention_backend="triton",
                   max_num_batched_tokens=64, num_kv_blocks=1024)
    window = CASES[name][1]["sliding_window"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist()
               for n in (5, window, 3 * window, 7 * window)]
    prompts.append(prompts[-1][: 5 * window] + [7, 8, 9])
    params = kiln.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=5)
    outputs = llm.generate(prompts, params)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ref = ref.cuda().eval()
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + tokens], device="cuda")).logits[0].float()
        expected = logits[len(prompt) - 1:-1].log_softmax(-1).cpu()  # [48, vocab]
        for step, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs,
                                                  strict=True)):
            what = f"{name}: {len(prompt)}-token prompt, step {step}"
            assert expected[step, token] >= expected[step].max() - 1e-3, what
            for t, value in entry.items():
                assert abs(value - expected[step, t].item()) <= 1e-3, f"{what}, token {t}"


@pytest.mark.parametrize("name", CASES)
def test_triton_fp8_engine_matches_torch_fp8_engine_past_the_window(name, sliding_dirs):
    """Triton greedy-decodes 48 tokens after prompts of up to 7 windows (64-token chunks); the
    torch backend then scores prompt + completion in one teacher-forced pass. Every prompt
    token's and generated token's logprob agree to 1e-3."""
    path = sliding_dirs[name]
    options = dict(dtype="float32", device="cuda", kv_cache_dtype="fp8",
                   max_num_batched_tokens=64, num_kv_blocks=1024)
    triton = kiln.LLM(str(path), attention_backend="triton", **options)
    window = CASES[name][1]["sliding_window"]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist()
               for n in (5, window, 3 * window, 7 * window)]
    params = kiln.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=1,
                                 prompt_logprobs=1)
    outputs = triton.generate(prompts, params)
    del triton
    torch_llm = kiln.LLM(str(path), attention_backend="torch", **options)
    full = [p + o.outputs[0].token_ids for p, o in zip(prompts, outputs, strict=True)]
    scored = torch_llm.generate(full, kiln.SamplingParams(max_tokens=1, prompt_logprobs=1))
    for prompt, out, ref in zip(prompts, outputs, scored, strict=True):
        tokens = out.outputs[0].token_ids
        got = [lp[t] for lp, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
        got += [lp[t] for lp, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        seq = prompt + tokens
        want = [lp[t] for lp, t in zip(ref.prompt_logprobs[1:], seq[1:], strict=True)]
        diff = (torch.tensor(got) - torch.tensor(want)).abs()
        assert diff.max() <= 1e-3, (f"{name}: {len(prompt)}-token prompt, worst at position "
                                    f"{int(diff.argmax()) + 1} of {len(seq)}: {diff.max():.3g}")

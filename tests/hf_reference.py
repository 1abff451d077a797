"""Transformers as the oracle for Kiln's model tests (float32 on CPU): the reference model, random
prompts, and greedy decoding by full recomputation to compare the engine's tokens and logprobs
against."""

from __future__ import annotations

import torch
import transformers

from kiln.outputs import RequestOutput


def hf_model(path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def random_prompts(lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]


def hf_greedy(ref, prompt: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation by full recomputation (for a sliding model: transformers' sliding mask
    over the whole sequence, no sliding cache), plus each step's log-softmax."""
    ids, logprobs = list(prompt), []
    for _ in range(num_tokens):
        with torch.no_grad():
            last = ref(torch.tensor([ids])).logits[0, -1].float()
        logprobs.append(last.log_softmax(-1))
        ids.append(int(last.argmax()))
    return ids[len(prompt):], logprobs


def assert_greedy_matches(ref, prompts: list[list[int]], outputs: list[RequestOutput],
                          num_tokens: int, label: str) -> None:
    """Each output's greedy tokens equal transformers', its top-5 logprobs hold transformers'
    top 5, and every logprob it returns is transformers' within 1e-4."""
    for prompt, out in zip(prompts, outputs, strict=True):
        expected_ids, expected_lps = hf_greedy(ref, prompt, num_tokens)
        completion = out.outputs[0]
        assert completion.token_ids == expected_ids, f"{label}: {len(prompt)}-token prompt"
        for step, (entry, lp) in enumerate(zip(completion.logprobs, expected_lps, strict=True)):
            assert set(lp.topk(5).indices.tolist()) <= set(entry), f"{label}: step {step}"
            for token, value in entry.items():
                assert abs(value - lp[token].item()) <= 1e-4, f"{label}: step {step}, {token}"

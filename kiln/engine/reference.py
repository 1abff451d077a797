"""The reference generator: a plain contiguous-KV prefill + decode loop.

It is the oracle the paged engine is tested against and needs nothing but the model: every
sequence (each of the n samples of each prompt) owns one row of a contiguous KV cache, the whole
batch is prefilled in one forward, then decoded one token per step until every row stops.
"""

from __future__ import annotations

import torch

from kiln.engine.sequence import Sequence, apply_sampler_output, prompt_logprobs_to_dicts
from kiln.layers.attention import contiguous_kv_caches, contiguous_metadata
from kiln.models.loader import LoadedModel
from kiln.outputs import RequestOutput
from kiln.sampling.params import SamplingParams
from kiln.sampling.sampler import Sampler, SamplingMetadata, compute_prompt_logprobs, generator_for


@torch.inference_mode()
def reference_generate(loaded: LoadedModel, prompts: list[list[int]],
                       params: list[SamplingParams], max_model_len: int,
                       attention_backend: str = "torch") -> list[RequestOutput]:
    if any(p.structured_outputs is not None for p in params):
        raise ValueError("reference_generate does not implement structured_outputs; generate "
                         "them with the paged engine")
    model, device = loaded.model, loaded.device
    params = [p.with_bad_words_tokenized(loaded.tokenizer) for p in params]  # as the engine
    seqs: list[Sequence] = []
    owners: list[int] = []  # request index of each sequence
    for r, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        for i in range(p.n):
            gen = generator_for(p.seed, i, device) if p.seed is not None else None
            seqs.append(Sequence(f"{r}-{i}", i, prompt, p, loaded.eos_token_ids, max_model_len,
                                 loaded.tokenizer, gen))
            owners.append(r)
    budget = [min(max_model_len, s.num_tokens + (s.params.max_tokens or max_model_len))
              for s in seqs]
    max_len = max(budget)
    caches = contiguous_kv_caches(model.cfg.num_layers, len(seqs), max_len, model.num_kv_heads,
                                  model.cfg.head_dim, loaded.dtype, device)
    sampler = Sampler()
    prompt_lps: dict[int, list] = {}
    first_step = True
    feeds = [list(s.prompt_token_ids) for s in seqs]
    while True:
        rows = [i for i, s in enumerate(seqs) if not s.finished]
        if not rows:
            break
        starts = [seqs[i].num_tokens - len(feeds[i]) for i in rows]
        new_lens = [len(feeds[i]) for i in rows]
        meta = contiguous_metadata(starts, new_lens, max_len, caches, device,
                                   backend=attention_backend, rows=rows)
        input_ids = torch.tensor([t for i in rows for t in feeds[i]], device=device)
        positions = torch.tensor([p for s, n in zip(starts, new_lens, strict=True)
                                  for p in range(s, s + n)], device=device)
        hidden = model(input_ids, positions, meta)
        last = meta.cu_seqlens_q[1:].long() - 1
        logits = model.compute_logits(hidden[last])
        if first_step:  # the first step is every prompt's prefill
            prompt_lps = _prompt_logprobs(model, hidden, meta, seqs, owners, rows)
            first_step = False
        active = [seqs[i] for i in rows]
        sampling = SamplingMetadata.build(
            [s.params for s in active], [s.generator for s in active],
            [s.output_token_ids for s in active], [s.prompt_token_ids for s in active],
            device, loaded.eos_token_ids)
        out = sampler.sample(logits, sampling)
        apply_sampler_output(active, out.token_ids, out.logprobs)
        for i in rows:
            feeds[i] = [seqs[i].output_token_ids[-1]]
    return _collect(prompts, owners, seqs, prompt_lps, loaded)


def _prompt_logprobs(model, hidden, meta, seqs, owners, rows) -> dict[int, tuple[list, list]]:
    """Request index -> (its prompt logprobs, its prompt tokens' ranks)."""
    result: dict[int, tuple[list, list]] = {}
    cu = meta.cu_seqlens_q.tolist()
    for j, i in enumerate(rows):
        k = seqs[i].params.prompt_logprobs
        if k is None or owners[i] in result:
            continue
        logits = model.compute_logits(hidden[cu[j]:cu[j + 1]])
        lps = compute_prompt_logprobs(logits, seqs[i].prompt_token_ids, k)
        result[owners[i]] = (prompt_logprobs_to_dicts(lps, seqs[i].prompt_token_ids, k),
                             [None, *lps.token_ranks.tolist()])
    return result


def _collect(prompts, owners, seqs, prompt_lps, loaded) -> list[RequestOutput]:
    outputs = []
    for r, prompt in enumerate(prompts):
        mine = [s for s, o in zip(seqs, owners, strict=True) if o == r]
        logprobs, ranks = prompt_lps.get(r, (None, None))
        outputs.append(RequestOutput(
            request_id=str(r), prompt=None, prompt_token_ids=list(prompt),
            outputs=[s.to_output() for s in mine], finished=True,
            prompt_logprobs=logprobs, prompt_logprob_ranks=ranks))
    return outputs

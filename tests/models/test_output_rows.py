"""The last layer on the sampled rows only (OutputRows), float32 on CPU.

A mixed step (a decode, a prompt's first chunk that samples nothing, the tail of a prompt after
its cached tokens) through a tiny Llama (GQA), a Mistral whose layers slide (window 8, shorter
than the sequences) and a Qwen3 (per-head q/k norms): the kept rows' hidden states are the full
forward's rows, and every layer's KV cache is bit for bit the full forward's. Through the torch
backend and the Triton backend's plumbing (whose kernels fall back to the reference on CPU).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_model

from kiln.layers.attention import contiguous_kv_caches, contiguous_metadata, last_rows
from kiln.models import load_model

MAX_LEN = 40
VARIANTS = {"llama3.1": {}, "mistral": dict(sliding_window=8), "qwen3": {}}
# (cached tokens, new tokens) per sequence; rows sorted as the runner sorts them: decode first
CACHED, NEW = [12, 0, 4], [1, 7, 9]
SAMPLED = [0, 2]  # sequence 1's chunk is not the prompt's last: it samples nothing


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("output_rows")
    return {name: build_model(name, root / name, seed=5, tokenizer=False, **fields)
            for name, fields in VARIANTS.items()}


def run_step(model, backend: str, pruned: bool, sampled: list[int] = SAMPLED
             ) -> tuple[torch.Tensor, list, torch.Tensor]:
    """(hidden states of the ``sampled`` sequences' last rows, every layer's caches, the rows'
    index)."""
    gen = torch.Generator().manual_seed(11)
    vocab = model.cfg.vocab_size
    prompts = [torch.randint(3, vocab, (c + n,), generator=gen).tolist()
               for c, n in zip(CACHED, NEW, strict=True)]
    caches = contiguous_kv_caches(model.cfg.num_layers, 3, MAX_LEN, model.num_kv_heads,
                                  model.cfg.head_dim, torch.float32, torch.device("cpu"),
                                  page_size=4)
    for cache in (c for layer in caches for c in layer):  # the same noise in unwritten slots
        cache.copy_(torch.randn(cache.shape, generator=gen))

    def forward(start: list[int], new: list[int], rows: bool):
        meta = contiguous_metadata(start, new, MAX_LEN, caches, torch.device("cpu"),
                                   backend=backend)
        ids = torch.tensor([t for p, s, n in zip(prompts, start, new, strict=True)
                            for t in p[s:s + n]])
        positions = torch.tensor([i for s, n in zip(start, new, strict=True)
                                  for i in range(s, s + n)])
        kept = last_rows(meta, torch.tensor(sampled, dtype=torch.int64)) if rows else None
        with torch.inference_mode():
            return model(ids, positions, meta, kept), kept

    forward([0, 0, 0], CACHED, rows=False)  # the cached tokens (sequence 1 has none)
    hidden, kept = forward(CACHED, NEW, rows=pruned)
    ends = torch.tensor(NEW).cumsum(0) - 1
    index = ends[sampled]
    return (hidden if pruned else hidden[index]), caches, (kept.index if pruned else index)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", VARIANTS)
def test_last_layer_on_sampled_rows_matches_the_full_forward(name, backend, model_dirs):
    model = load_model(str(model_dirs[name]), dtype="float32", device="cpu").model
    hidden, caches, index = run_step(model, backend, pruned=True)
    ref_hidden, ref_caches, ref_index = run_step(model, backend, pruned=False)
    assert index.tolist() == ref_index.tolist() == [0, 1 + 7 + 9 - 1]
    assert hidden.shape == (len(SAMPLED), model.cfg.hidden_size)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)
    assert hidden.abs().max() > 0.1  # real activations, not an empty comparison
    for (k, v), (ref_k, ref_v) in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(k, ref_k, rtol=0, atol=0)
        torch.testing.assert_close(v, ref_v, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", VARIANTS)
def test_a_step_that_reads_no_row_still_writes_every_row_of_kv(name, backend, model_dirs):
    """Prompt chunks that sample nothing: the last layer only writes its K/V, bit for bit the
    full forward's, and no hidden state comes out."""
    model = load_model(str(model_dirs[name]), dtype="float32", device="cpu").model
    hidden, caches, index = run_step(model, backend, pruned=True, sampled=[])
    _, ref_caches, _ = run_step(model, backend, pruned=False, sampled=[])
    assert hidden.shape == (0, model.cfg.hidden_size) and index.numel() == 0
    for (k, v), (ref_k, ref_v) in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(k, ref_k, rtol=0, atol=0)
        torch.testing.assert_close(v, ref_v, rtol=0, atol=0)

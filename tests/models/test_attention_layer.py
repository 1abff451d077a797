"""The attention layer's Triton-backend plumbing on CPU (where every kernel call falls back to the
reference): a mixed batch, decode rows first and a prompt after them, split the way the model
runner splits it, gives what the torch backend gives, with a 16-bit or an fp8 cache."""

import pytest
import torch

from kiln.kernels.kv_cache import FP8_DTYPE
from kiln.layers.attention import Attention, contiguous_kv_caches, contiguous_metadata

HEADS, KV_HEADS, HEAD_DIM, MAX_LEN = 4, 2, 32, 16


def run_layer(backend: str, cache_dtype: torch.dtype,
              page_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    caches = contiguous_kv_caches(1, 2, MAX_LEN, KV_HEADS, HEAD_DIM, cache_dtype, "cpu",
                                  page_size=page_size)
    for cache in caches[0]:  # sequence 0's 10 cached tokens (and noise elsewhere)
        cache.copy_(torch.randn(cache.shape, generator=gen).to(cache_dtype))
    # sequence 0 decodes its 11th token, sequence 1 prefills 5
    meta = contiguous_metadata([10, 0], [1, 5], MAX_LEN, caches, "cpu", backend=backend)
    if backend == "triton":  # what ModelRunner.prepare does for a mixed batch
        meta.num_decode_seqs = 1
        meta.prefill = contiguous_metadata([0], [5], MAX_LEN, caches, "cpu", backend=backend,
                                           rows=[1])
        meta.prefill.slot_mapping = None
    angles = torch.rand(MAX_LEN, HEAD_DIM // 2, generator=gen) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    q = torch.randn(6, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(6, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(6, KV_HEADS, HEAD_DIM, generator=gen)
    positions = torch.tensor([10, 0, 1, 2, 3, 4])
    layer = Attention(0, HEADS, KV_HEADS, HEAD_DIM)
    if cache_dtype == FP8_DTYPE:
        layer.k_scale, layer.v_scale = 0.05, 0.04
    out = layer(q, k, v, meta, positions, cos_sin)
    return out, caches[0][0].reshape(2, MAX_LEN, KV_HEADS, HEAD_DIM)


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8_DTYPE], ids=["f32", "fp8"])
def test_triton_backend_mixed_batch_matches_torch_backend(cache_dtype):
    out, k_cache = run_layer("triton", cache_dtype)
    ref_out, ref_k_cache = run_layer("torch", cache_dtype)
    assert out.shape == (6, HEADS * HEAD_DIM)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(k_cache.view(torch.uint8), ref_k_cache.view(torch.uint8),
                               rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_contiguous_cache_in_pages_of_the_engine_block_size_is_the_same_cache(backend):
    """A row split into blocks of page_size slots (what start-up's memory probe uses, so that
    the kernels the engine will run are compiled then) holds and attends the same values."""
    out, k_cache = run_layer(backend, torch.float32, page_size=4)
    ref_out, ref_k_cache = run_layer(backend, torch.float32)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(k_cache, ref_k_cache, rtol=0, atol=0)

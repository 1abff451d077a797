"""FP8 KV cache helpers: round trip, and attention over raw fp8 pages with folded scales equals
attention over the dequantized cache (the contract the attention backends rely on)."""

import pytest
import torch

from kiln.kernels.attention import paged_attention_ref
from kiln.kernels.kv_cache import write_kv_cache_ref
from kiln.quant.kv_cache import (
    FP8_DTYPE,
    attention_scales,
    dequantize_kv,
    kv_cache_torch_dtype,
    quantize_kv,
    set_kv_scales,
)


def test_round_trip_error_is_fp8_precision():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(37, 2, 64, generator=gen) * 5
    scale = float(k.abs().max()) / 448
    q = quantize_kv(k, scale)
    assert q.dtype == FP8_DTYPE
    back = dequantize_kv(q, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values
    normal = k.abs() > 2**-6 * scale
    assert ((back - k).abs()[normal] <= k.abs()[normal] * 2**-4 + 1e-7).all()
    # a too-small scale saturates at +-448 * scale instead of producing inf/nan
    saturated = dequantize_kv(quantize_kv(k, scale / 10), scale / 10, torch.float32)
    assert torch.isfinite(saturated).all() and saturated.abs().max() == pytest.approx(44.8 * scale)


def test_dtype_choice():
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == FP8_DTYPE
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'"):
        kv_cache_torch_dtype("int4", torch.float16)


@pytest.mark.parametrize("k_scale,v_scale", [(0.01, 0.02), (1.0, 1.0)])
def test_folded_scales_equal_dequantized_attention(k_scale, v_scale):
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 8
    seq_lens, q_lens = [13, 21], [5, 1]
    num_tokens = sum(seq_lens)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 2
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 2
    shape = (8, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=FP8_DTYPE)
    v_cache = torch.zeros(shape, dtype=FP8_DTYPE)
    block_tables = torch.tensor([[5, 1, 0], [2, 7, 3]], dtype=torch.int32)
    slots = torch.cat([block_tables[b].long().repeat_interleave(block_size)[:n] * block_size
                       + torch.arange(n) % block_size for b, n in enumerate(seq_lens)])
    # the write path: quantize, then the unchanged cache write
    write_kv_cache_ref(quantize_kv(k, k_scale), quantize_kv(v, v_scale), k_cache, v_cache, slots)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    sm_scale = head_dim**-0.5
    args = (cu, lens, block_tables, max(q_lens), max(seq_lens))
    expected = paged_attention_ref(q, dequantize_kv(k_cache, k_scale, torch.float32),
                                   dequantize_kv(v_cache, v_scale, torch.float32), *args,
                                   sm_scale)
    score_scale, out_scale = attention_scales(sm_scale, k_scale, v_scale)
    folded = paged_attention_ref(q, k_cache, v_cache, *args,  # raw fp8 pages
                                 score_scale) * out_scale
    torch.testing.assert_close(folded, expected, rtol=1e-5, atol=1e-6)


def test_set_kv_scales_per_layer():
    from kiln.layers.attention import Attention

    model = torch.nn.ModuleList([Attention(i, 2, 1, 8) for i in (1, 0)])
    set_kv_scales(model, [[0.5, 0.25], [2.0, 4.0]])
    assert (model[0].k_scale, model[0].v_scale) == (2.0, 4.0)  # by layer_idx, not order
    set_kv_scales(model, None)
    assert model[1].k_scale == model[1].v_scale == 1.0
    with pytest.raises(ValueError, match="1 KV-cache scale pairs for 2 attention layers"):
        set_kv_scales(model, [[1.0, 1.0]])

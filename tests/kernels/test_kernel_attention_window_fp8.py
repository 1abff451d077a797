"""Sliding-window attention over an fp8 (e4m3) KV cache: the Triton prefill and decode kernels
(interpreted on CPU) against the PyTorch reference reading the same raw fp8 pages.

The pages hold the codes the engine writes (x / scale); the scales fold into the score scale as
the attention layer folds them (attention_scales), so both sides see identical keys and values
and differ only in their arithmetic. The cached keys of the tiles wholly before each window are
NaN: a kernel must skip them, not mask them.
"""

import pytest
import torch
from kernel_testing import (
    INTERPRET_DTYPES,
    assert_rel_close,
    gpu,
    make_paged_kv,
    needs_triton,
    poison_outside_window,
)

from kiln.kernels.attention import paged_attention, paged_attention_ref
from kiln.kernels.attention_decode import paged_attention_decode_triton
from kiln.kernels.attention_prefill import paged_attention_prefill_triton
from kiln.kernels.kv_cache import FP8_DTYPE, attention_scales, quantize_kv

# Both sides widen the same e4m3 codes exactly (e4m3 fits fp16), keep fp32 softmax and
# accumulators: the tolerances of the full-precision kernel tests (test_kernel_attention.py).
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}
K_SCALE, V_SCALE = 0.02, 0.05  # a calibrated checkpoint's per-layer scales, not 1.0

# (q_lens, seq_lens): a 70-token prompt, a 37-token chunk after 63 cached tokens, a decode row
# at 90, a 5-token chunk after 35 cached, a 1-token prompt
PREFILL = ([70, 37, 1, 5, 1], [70, 100, 90, 40, 1])
DECODE = ([1, 1, 1, 1, 1], [1, 17, 33, 64, 100])
# 1: a query sees only itself; 5 and 33: window edges inside 16-key tiles; 16: on a tile and
# page boundary; 128: longer than every context
WINDOWS = [1, 5, 16, 33, 128]


def run_fp8_case(fn, q_lens, seq_lens, num_heads, num_kv_heads, dtype, window, seed,
                 head_dim=64, device="cpu", skip_tile=16):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    block_size = 16
    _, _, k_cache, v_cache, block_tables = make_paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, torch.float32, device, gen
    )
    # values as a layer's K/V (a few units), stored as codes of x / scale like the cache write
    k_cache = quantize_kv(k_cache * 3, K_SCALE)
    v_cache = quantize_kv(v_cache * 3, V_SCALE)
    assert k_cache.dtype == FP8_DTYPE
    poison_outside_window(k_cache, v_cache, block_tables, q_lens, seq_lens, window, skip_tile)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    score_scale, out_scale = attention_scales(head_dim**-0.5, K_SCALE, V_SCALE)
    args = (q, k_cache, v_cache, cu, lens, block_tables, max(q_lens), max(seq_lens), score_scale)
    out = fn(*args, window=window) * out_scale
    ref = paged_attention_ref(*args, window=window) * out_scale
    assert out.dtype == dtype
    assert torch.isfinite(ref).all(), "the reference read a key before its window"
    what = f"fp8 q_lens={q_lens} seq_lens={seq_lens} H={num_heads}/{num_kv_heads} {dtype} " \
           f"window={window}"
    assert_rel_close(out, ref, TOL[dtype], what)


@needs_triton
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=lambda h: f"H{h[0]}-{h[1]}")
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
def test_prefill_triton_fp8_window(window, heads, dtype):
    """Every key from the fp8 pages (the layer passes no k_new with an fp8 cache)."""
    def fn(*args, **kwargs):
        return paged_attention_prefill_triton(*args, **kwargs, config=(16, 16, 4, 1))

    run_fp8_case(fn, *PREFILL, *heads, dtype, window, seed=window)


@needs_triton
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=lambda h: f"H{h[0]}-{h[1]}")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_triton_fp8_window(window, heads, num_splits):
    def fn(*args, **kwargs):
        return paged_attention_decode_triton(*args, **kwargs, num_splits=num_splits,
                                             config=(16, 4, 1))

    run_fp8_case(fn, *DECODE, *heads, torch.float16, window, seed=40 + window)


@gpu
@pytest.mark.parametrize("window", [4096, 1000])
@pytest.mark.parametrize("kind", ["prefill", "chunk", "decode"])
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fp8_sliding_window(window, kind, heads, dtype):
    """The compiled kernels the engine picks (paged_attention: its tiles and split counts) over
    fp8 pages, contexts up to 8k past Mistral's window and a shorter one; the 128-key tiles wholly
    before each window are NaN."""
    seq_lens = [8192, 4096, 6000, 8192, 300]
    q_lens = {"prefill": seq_lens, "chunk": [2048, 1, 1500, 1, 300], "decode": [1] * 5}[kind]
    num_heads, num_kv_heads, head_dim = heads
    run_fp8_case(paged_attention, q_lens, seq_lens, num_heads, num_kv_heads, dtype, window,
                 seed=window, head_dim=head_dim, device="cuda", skip_tile=128)

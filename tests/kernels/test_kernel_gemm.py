"""The decode-batch GEMM (kiln/kernels/gemm.py) against its float32 reference.

Under the interpreter the FP8 inputs are e4m3 codes made by torch's own cast (the interpreter's
float -> e4m3 cast is wrong, its e4m3 loads are exact), so kernel and reference must agree to
float32 rounding; 16-bit operands are compared at their output rounding. On the GPU the whole
W8A8 path and the 16-bit kernel are compared in bf16.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_rel_close, gpu, needs_triton

from kiln.kernels.gemm import GemmTiles, gemm_config, gemm_ref, gemm_triton
from kiln.quant import w8a8

# tiny tiles for the interpreter: K in one, four and eight steps, ragged rows
CONFIGS = [GemmTiles(16, 16, 256, 4, 2), GemmTiles(32, 32, 64, 4, 2), GemmTiles(16, 32, 32, 4, 3)]


def _fp8_operands(m: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    wq, ws = w8a8.quantize_weight(torch.randn(n, k, generator=gen), "fp8", "channel")
    xq, xs = w8a8.quant_per_token_ref(torch.randn(m, k, generator=gen) * 3, "fp8")
    return xq, xs, wq, ws, torch.randn(n, generator=gen)


@needs_triton
@pytest.mark.parametrize("m", [1, 5, 17, 33])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_gemm_matches_reference(m, config, with_bias):
    xq, xs, wq, ws, bias = _fp8_operands(m, 48, 256, seed=m)  # 48 columns: a ragged column tile
    bias = bias if with_bias else None
    ref = gemm_ref(xq, wq, bias, torch.float32, xs, ws)
    out = gemm_triton(xq, wq, bias, torch.float32, xs, ws, config=config)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m, n", [(3, 40), (17, 40), (32, 64)])  # 32 x 64: every tile full
@pytest.mark.parametrize("config", CONFIGS)
def test_16_bit_gemm_matches_reference(dtype, m, n, config):
    gen = torch.Generator().manual_seed(m + config.block_k)
    x = torch.randn(m, 256, generator=gen).to(dtype)
    w = (torch.randn(n, 256, generator=gen) / 16).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    out = gemm_triton(x, w, bias, config=config)
    assert out.dtype == dtype
    assert_rel_close(out.float(), gemm_ref(x, w, bias, torch.float32), 2e-3, f"{dtype} {config}")


def test_config_narrow_layers_take_narrow_deep_tiles():
    for n, block_n in [(4096, 32), (6144, 64), (14336, 64), (28672, 64)]:
        for k in (4096, 14336, 128 * 37):
            for m in (16, 64):
                for element_bytes in (1, 2):
                    cfg = gemm_config(m, n, k, element_bytes, sms=132)
                    wide = element_bytes == 2 and n >= 128 * 132
                    assert cfg.block_n == (128 if wide else block_n), (n, k, cfg)
                    assert k % cfg.block_k == 0, (k, cfg)
                    if block_n == 32:  # one program per SM: a deep pipeline
                        assert cfg.num_stages >= 6 and cfg.block_k >= 128, cfg


def test_k_not_a_multiple_of_the_k_step_is_refused():
    xq, xs, wq, ws, _ = _fp8_operands(4, 32, 96, seed=0)
    with pytest.raises(AssertionError, match="multiple"):
        gemm_triton(xq, wq, None, None, xs, ws, config=GemmTiles(16, 16, 64, 4, 2))
    with pytest.raises(AssertionError, match="together"):
        gemm_triton(xq, wq, None, None, xs, None)


@gpu
@pytest.mark.parametrize("m", [5, 16, 33, 64])
def test_gpu_w8a8_through_the_triton_gemm(m):
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(1024, 4096, generator=gen)
    x = torch.randn(m, 4096, generator=gen).bfloat16()
    bias = torch.randn(1024, generator=gen).bfloat16()
    wq, ws = w8a8.quantize_weight(w, "fp8", "channel")
    ref = w8a8.w8a8_linear_ref(x, wq, ws, "fp8", bias=bias)
    out = w8a8.w8a8_linear(x.cuda(), wq.cuda(), ws.cuda(), "fp8", bias=bias.cuda(),
                           triton_gemm=True)
    assert_rel_close(out.cpu(), ref, 1e-2, f"fp8 triton gemm m={m}")


@gpu
@pytest.mark.parametrize("m", [7, 64, 100])
@pytest.mark.parametrize("fp8,config", [
    (False, GemmTiles(64, 64, 128, 4, 4)), (False, GemmTiles(64, 32, 128, 4, 7)),
    (True, GemmTiles(64, 64, 256, 4, 3)), (True, GemmTiles(64, 32, 256, 4, 6))])
@pytest.mark.parametrize("n", [4096, 1000])
def test_gpu_gemm_tiles(fp8, m, config, n):
    """Full tiles (M = 64, N = 4096) load without masks; ragged ones (M = 7, 100; N = 1000, an
    output row not a multiple of 16 wide) with them."""
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(n, 4096, generator=gen) / 64
    x = torch.randn(m, 4096, generator=gen)
    bias = torch.randn(n, generator=gen).bfloat16().cuda()
    if fp8:
        wq, ws = (t.cuda() for t in w8a8.quantize_weight(w, "fp8", "channel"))
        xq, xs = w8a8.quant_per_token_ref(x.cuda(), "fp8")
        args = (xq, wq, bias, torch.bfloat16, xs, ws)
    else:
        args = (x.bfloat16().cuda(), w.bfloat16().cuda(), bias, torch.bfloat16)
    out = gemm_triton(*args, config=config)
    assert_rel_close(out.float(), gemm_ref(*args).float(), 1e-2, f"fp8={fp8} {config}")


@needs_triton
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("config", CONFIGS)
def test_gated_gemm_is_gemm_then_silu_and_mul(fp8, config):
    """A merged [gate; up] projection (40 + 40 rows: ragged against every column tile)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 256, generator=gen)
    w = torch.randn(80, 256, generator=gen) / 16
    bias = torch.randn(80, generator=gen)
    if fp8:
        wq, ws = w8a8.quantize_weight(w, "fp8", "channel")
        xq, xs = w8a8.quant_per_token_ref(x, "fp8")
        args = (xq, wq, bias, torch.float32, xs, ws)
    else:
        args = (x.half(), w.half(), bias.half(), torch.float32)
    out = gemm_triton(*args, gated=True, config=config)
    assert out.shape == (9, 40)
    torch.testing.assert_close(out, gemm_ref(*args, gated=True), rtol=1e-5, atol=1e-4)

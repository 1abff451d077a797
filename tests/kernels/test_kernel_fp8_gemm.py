"""The FP8 W8A8 GEMM (kiln/kernels/fp8_gemm.py) against its float32 reference.

Under the interpreter the inputs are e4m3 codes made by torch's own cast (the interpreter's
float -> e4m3 cast is wrong, its e4m3 loads are exact), so kernel and reference must agree to
float32 rounding; on the GPU the whole W8A8 path is compared in bf16.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_rel_close, gpu, needs_triton

from kiln.kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm_config, fp8_gemm_ref, fp8_gemm_triton
from kiln.quant import w8a8


def _operands(m: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    wq, ws = w8a8.quantize_weight(torch.randn(n, k, generator=gen), "fp8", "channel")
    xq, xs = w8a8.quant_per_token_ref(torch.randn(m, k, generator=gen) * 3, "fp8")
    return xq, xs, wq, ws, torch.randn(n, generator=gen)


@needs_triton
@pytest.mark.parametrize("m", [1, 5, 17, 33])
@pytest.mark.parametrize("config", [Fp8GemmConfig(16, 16, 128, 4, 2),
                                    Fp8GemmConfig(32, 32, 64, 4, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_gemm_matches_reference(m, config, with_bias):
    xq, xs, wq, ws, bias = _operands(m, 48, 256, seed=m)  # 48 columns: a ragged column tile
    bias = bias if with_bias else None
    ref = fp8_gemm_ref(xq, xs, wq, ws, bias, torch.float32)
    out = fp8_gemm_triton(xq, xs, wq, ws, bias, torch.float32, config)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_config_narrow_layers_take_narrow_tiles():
    for n, block_n in [(4096, 32), (6144, 32), (14336, 64), (28672, 64)]:
        for k in (4096, 14336, 128 * 37):
            cfg = fp8_gemm_config(64, n, k, sms=132)
            assert (cfg.block_m, cfg.block_n) == (64, block_n), (n, cfg)
            assert k % cfg.block_k == 0, (k, cfg)


def test_k_not_a_multiple_of_the_tile_is_refused():
    xq, xs, wq, ws, _ = _operands(4, 32, 96, seed=0)
    with pytest.raises(AssertionError, match="multiple"):
        fp8_gemm_triton(xq, xs, wq, ws, config=Fp8GemmConfig(16, 16, 128, 4, 2))


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

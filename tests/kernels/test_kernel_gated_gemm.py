"""The gated prefill GEMM: Triton (interpreted on CPU, compiled on the GPU) against float64 math
and against the unfused cuBLAS + silu_and_mul path it replaces."""

import pytest
import torch
from kernel_testing import INTERPRET_DTYPES, assert_rel_close, gpu, needs_triton

from kiln.kernels.activation import silu_and_mul
from kiln.kernels.gated_gemm import (
    GATED_GEMM_MIN_M,
    GatedTiles,
    gated_gemm_applies,
    gated_gemm_ref,
    gated_gemm_triton,
)
from kiln.kernels.quant_gemm import linear

# fp32: accumulation order only. 16-bit: gate and up rounded to the dtype, silu rounded before the
# multiply and the product again, as the unfused path rounds them
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# tiny tiles for the interpreter: several row, column and K tiles, each ragged at the end
TINY = GatedTiles(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2)


def naive(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x.double() @ w.double().t()
    gate, up = y.chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


def operands(m: int, k: int, inter: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(2 * inter, k, generator=gen) / k ** 0.5).to(dtype).to(device)
    return x, w


@needs_triton
@pytest.mark.parametrize("m, k, inter", [(1, 64, 32), (17, 80, 40), (130, 96, 72)])
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
def test_triton(m, k, inter, dtype):
    """Ragged row, column and K tiles: gate tiles past I read up rows (clipped on store) and the
    up tiles past 2I and the K tail read TMA's zero fill."""
    x, w = operands(m, k, inter, dtype, seed=m)
    out = gated_gemm_triton(x, w, TINY)
    assert out.dtype == dtype
    assert_rel_close(out, naive(x, w), TOL[dtype], f"gated_gemm {m}x{k}x{inter} {dtype}")


@needs_triton
def test_no_rows():
    x, w = operands(0, 64, 32, torch.float32)
    assert gated_gemm_triton(x, w, TINY).shape == (0, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference(dtype):
    x, w = operands(9, 48, 24, dtype)
    assert_rel_close(gated_gemm_ref(x, w), naive(x, w), TOL[dtype], "gated_gemm_ref")


def test_cpu_linear_is_unfused_and_never_applies():
    x, w = operands(GATED_GEMM_MIN_M, 64, 32, torch.float32)
    assert not gated_gemm_applies(x, w, None)
    torch.testing.assert_close(linear(x, w, gated=True), gated_gemm_ref(x, w))


@gpu
@pytest.mark.parametrize("m, k, inter", [
    (GATED_GEMM_MIN_M, 4096, 14336),  # Llama-3.1-8B's gate_up at the smallest rows it takes
    (3000, 1024, 1000),  # ragged rows and columns
    (1025, 328, 264),  # a ragged K step
])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_against_unfused(m, k, inter, dtype):
    x, w = operands(m, k, inter, dtype, device="cuda", seed=m)
    assert gated_gemm_applies(x, w, None)
    out = linear(x, w, gated=True)
    unfused = silu_and_mul(torch.nn.functional.linear(x, w))
    assert_rel_close(out, naive(x, w), TOL[dtype], f"gated_gemm {m}x{k}x{inter} {dtype}")
    assert_rel_close(out, unfused, TOL[dtype], "against cuBLAS + silu_and_mul")


@gpu
def test_gpu_dispatch():
    """Prefill rows take the gated GEMM; decode rows, a bias or an unaligned view do not."""
    x, w = operands(GATED_GEMM_MIN_M + 1, 256, 128, torch.bfloat16, device="cuda")
    assert gated_gemm_applies(x, w, None)
    assert not gated_gemm_applies(x[:GATED_GEMM_MIN_M - 1], w, None)
    assert not gated_gemm_applies(x, w, torch.zeros(256, device="cuda", dtype=torch.bfloat16))
    unaligned = x.flatten()[1:1 + GATED_GEMM_MIN_M * 256].view(GATED_GEMM_MIN_M, 256)
    assert not gated_gemm_applies(unaligned, w, None)
    assert not gated_gemm_applies(x.float(), w.float(), None)

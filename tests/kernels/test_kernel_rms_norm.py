"""RMSNorm (+ fused residual add): Triton (interpreted on CPU) and reference vs float64 math."""

import pytest
import torch
from kernel_testing import INTERPRET_DTYPES, assert_rel_close, gpu, needs_triton

from kiln.kernels.rms_norm import rms_norm, rms_norm_ref, rms_norm_triton
from kiln.quant.w8a8 import quant_per_token_ref, quant_per_token_triton, row_quant

EPS = 1e-5
# fp32: only reduction order differs (~1e-7). fp16/bf16: the normalized value and the product
# are each rounded to the dtype (2^-11 / 2^-8 relative per element), as HF rounds them.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def naive(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None):
    """float64 RMSNorm; the residual sum is taken in x.dtype, as the model's add would be."""
    h = x if residual is None else x + residual
    h64 = h.double()
    out = h64 / torch.sqrt(h64.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    return out, h


def make(shape, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)
    residual = torch.randn(shape, generator=gen).to(dtype).to(device)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype).to(device)
    return x, residual, weight


def check(fn, shape, dtype, with_residual, device="cpu", seed=0):
    x, residual, weight = make(shape, dtype, device, seed)
    expected, expected_sum = naive(x, weight, residual if with_residual else None)
    if with_residual:
        out, new_residual = fn(x, weight, EPS, residual)
        assert new_residual.dtype == dtype
        torch.testing.assert_close(new_residual, expected_sum, rtol=0, atol=0)  # same rounding
    else:
        out = fn(x, weight, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    assert_rel_close(out, expected, TOL[dtype], f"rms_norm {shape} {dtype}")


SHAPES = [(1, 64), (17, 100), (2, 3, 128)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_reference(shape, dtype, with_residual):
    check(rms_norm_ref, shape, dtype, with_residual)


@needs_triton
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton(shape, dtype, with_residual):
    check(rms_norm_triton, shape, dtype, with_residual, seed=1)


def test_wrapper_on_cpu_is_reference():
    x, residual, weight = make((5, 64), torch.float32)
    torch.testing.assert_close(rms_norm(x, weight, EPS), rms_norm_ref(x, weight, EPS))


@gpu
@pytest.mark.parametrize("num_tokens", [1, 17, 1000])
@pytest.mark.parametrize("hidden", [4096, 5120])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu(num_tokens, hidden, dtype, with_residual):
    check(rms_norm, (num_tokens, hidden), dtype, with_residual, device="cuda", seed=num_tokens)


def _quantized_case(kind, variant, device="cpu"):
    x, residual, weight = make((9, 96), torch.float32, device, seed=4)
    gen = torch.Generator().manual_seed(9)
    smooth = (0.5 + torch.rand(96, generator=gen)).to(device) if variant == "smooth" else None
    static = torch.tensor(0.05, device=device) if variant == "static" else None
    return x, residual, weight, row_quant(kind, smooth, static), (smooth, static)


@needs_triton
@pytest.mark.parametrize("variant", ["dynamic", "smooth", "static"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_quantized_output_is_norm_then_quantizer(variant, with_residual):
    """INT8 codes under the interpreter (its float -> e4m3 cast is wrong; FP8 runs on the GPU):
    bit-equal to the RMSNorm kernel followed by the standalone per-token quantizer kernel."""
    x, residual, weight, quant, (smooth, static) = _quantized_case("int8", variant)
    res = residual if with_residual else None
    got = rms_norm_triton(x, weight, EPS, res, quant)
    normed = rms_norm_triton(x, weight, EPS, res)
    if with_residual:
        (got, got_sum), (normed, ref_sum) = got, normed
        torch.testing.assert_close(got_sum, ref_sum, rtol=0, atol=0)
    codes, scales = quant_per_token_triton(normed, "int8", smooth, static)
    assert got.codes.dtype == torch.int8 and got.codes.shape == x.shape
    assert torch.equal(got.scales, scales)
    assert torch.equal(got.codes, codes)


def test_reference_quantized_output_is_norm_then_quantizer():
    x, residual, weight, quant, (smooth, static) = _quantized_case("fp8", "smooth")
    got, _ = rms_norm(x, weight, EPS, residual, quant)
    codes, scales = quant_per_token_ref(rms_norm_ref(x, weight, EPS, residual)[0], "fp8",
                                        smooth)
    assert torch.equal(got.codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(got.scales, scales)


@gpu
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("variant", ["dynamic", "smooth", "static"])
def test_gpu_quantized_output_is_norm_then_quantizer(kind, variant):
    x, residual, weight, quant, (smooth, static) = _quantized_case(kind, variant, "cuda")
    x, residual, weight = x.bfloat16(), residual.bfloat16(), weight.bfloat16()
    got, got_sum = rms_norm_triton(x, weight, EPS, residual, quant)
    normed, ref_sum = rms_norm_triton(x, weight, EPS, residual)
    codes, scales = quant_per_token_triton(normed, kind, smooth, static)
    assert torch.equal(got_sum, ref_sum)
    assert torch.equal(got.scales, scales)
    assert torch.equal(got.codes.view(torch.uint8), codes.view(torch.uint8))

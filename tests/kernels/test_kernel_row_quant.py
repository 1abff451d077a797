"""The standalone per-token quantizer (kiln/kernels/row_quant.py) against its reference, and its
gated form (silu(gate) * up quantized in one pass) against the activation kernel + quantizer.

Under the interpreter INT8 codes are compared (its float -> e4m3 cast is wrong at binade
boundaries); FP8 and bf16 run on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import INTERPRET_DTYPES, gpu, needs_triton

from kiln.kernels import row_quant
from kiln.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kiln.kernels.row_quant import quantize_rows, quantize_rows_ref, quantize_rows_triton
from kiln.quant import w8a8
from kiln.quant.w8a8 import row_quant as w8a8_row_quant


def _case(kind: str, variant: str, width: int, device: str = "cpu", rows: int = 7):
    gen = torch.Generator().manual_seed(width + rows)
    x = torch.randn(rows, width, generator=gen) * 3
    x[min(2, rows - 1)] = 0.0  # an all-zero row still gets a finite scale
    k = width // 2 if variant.endswith("gated") else width
    smooth = torch.rand(k, generator=gen) + 0.5 if variant.startswith("smooth") else None
    static = torch.tensor(0.05) if variant.startswith("static") else None
    quant = w8a8_row_quant(kind, *(t if t is None else t.to(device) for t in (smooth, static)))
    return x.to(device), quant


@pytest.fixture(params=["one pass", "two passes"])
def passes(request, monkeypatch):
    """Rows held in registers, or (a 64-value block) read in chunks twice."""
    if request.param == "two passes":
        monkeypatch.setattr(row_quant, "ONE_PASS_MAX_K", 64)
    return request.param


@needs_triton
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
@pytest.mark.parametrize("variant", ["dynamic", "smooth", "static"])
def test_triton_rows_match_the_reference(dtype, variant, passes):
    x, quant = _case("int8", variant, 300)
    x = x.to(dtype)
    codes, scales = quantize_rows_triton(x, quant)
    ref_codes, ref_scales = quantize_rows_ref(x, quant)
    assert codes.dtype == torch.int8 and scales.shape == (7, 1)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    torch.testing.assert_close(codes, ref_codes, rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
@pytest.mark.parametrize("variant", ["dynamic gated", "smooth gated", "static gated"])
def test_gated_rows_are_silu_and_mul_then_quantizer(dtype, variant, passes):
    """Bit-equal to the activation kernel followed by the quantizer: silu(gate) * up is rounded
    to x's dtype before its amax and codes, as the stored activation is."""
    x, quant = _case("int8", variant, 2 * 150)
    x = x.to(dtype)
    got = quantize_rows_triton(x, quant, gated=True)
    codes, scales = quantize_rows_triton(silu_and_mul_triton(x), quant)
    assert got.codes.shape == (7, 150)
    assert torch.equal(got.scales, scales)
    assert torch.equal(got.codes, codes)
    # and close to the PyTorch path (silu rounded by torch: a code may move by one)
    ref_codes, ref_scales = quantize_rows_ref(silu_and_mul_ref(x), quant)
    torch.testing.assert_close(got.scales, ref_scales, rtol=2e-3, atol=0)
    assert (got.codes.int() - ref_codes.int()).abs().max() <= 1


def test_cpu_dispatch_takes_the_reference_and_any_leading_shape():
    x, quant = _case("fp8", "smooth gated", 2 * 32, rows=6)
    got = quantize_rows(x.reshape(2, 3, 64), quant, gated=True)
    ref = quantize_rows_ref(silu_and_mul_ref(x), quant)
    assert torch.equal(got.codes.view(torch.uint8), ref.codes.view(torch.uint8))
    assert torch.equal(got.scales, ref.scales)


def test_gated_rows_need_an_even_width():
    x, quant = _case("int8", "dynamic", 33)
    with pytest.raises(AssertionError, match="2 \\* I"):
        quantize_rows_triton(x, quant, gated=True)


@gpu
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("variant", ["dynamic gated", "smooth gated", "static gated"])
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_gpu_gated_rows_are_silu_and_mul_then_quantizer(kind, variant, rows, passes):
    """bf16, the Llama-3.1-8B intermediate size (14336: one pass, or 64-value chunks)."""
    x, quant = _case(kind, variant, 2 * 14336, "cuda", rows)
    x = x.bfloat16()
    got = quantize_rows_triton(x, quant, gated=True)
    codes, scales = quantize_rows_triton(silu_and_mul_triton(x), quant)
    assert torch.equal(got.scales, scales)
    assert torch.equal(got.codes.view(torch.uint8), codes.view(torch.uint8))
    ref_codes, ref_scales = quantize_rows_ref(silu_and_mul_triton(x), quant)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    torch.testing.assert_close(codes.float(), ref_codes.float(), rtol=0.07, atol=1.0)


@gpu
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("m", [16, 100])
def test_gpu_w8a8_gate_up_hands_down_proj_its_codes(kind, m):
    """A W8A8 gate_up with ``out_quant`` (the Triton GEMM's gated epilogue at 16 FP8 rows, cuBLAS
    + the gated quantizer otherwise): the codes of quantizing its activation on its own."""
    gen = torch.Generator().manual_seed(m)
    wq, ws = (t.cuda() for t in w8a8.quantize_weight(torch.randn(2 * 512, 1024, generator=gen),
                                                      kind, "channel"))
    x = torch.randn(m, 1024, generator=gen).bfloat16().cuda()
    quant = w8a8_row_quant(kind, (torch.rand(512, generator=gen) + 0.5).cuda())
    got = w8a8.w8a8_linear(x, wq, ws, kind, gated=True, out_quant=quant)
    codes, scales = quantize_rows_triton(w8a8.w8a8_linear(x, wq, ws, kind, gated=True), quant)
    assert got.codes.shape == (m, 512)
    assert torch.equal(got.scales, scales)
    assert torch.equal(got.codes.view(torch.uint8), codes.view(torch.uint8))

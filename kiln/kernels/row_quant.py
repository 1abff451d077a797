"""Per-token (row) activation quantization: what the W8A8 GEMMs take as input.

    scale[m] = max(absmax_k(x[m, k] s[k]), min_amax) / qmax    (or one static scale)
    q[m, k] = round(clamp(x[m, k] s[k] / scale[m], -qmax, qmax))    e4m3 or int8 codes

``s`` is SmoothQuant's per-channel migration (absent: 1). ``row_codes`` is shared by the
standalone quantizer here and RMSNorm's quantized output (rms_norm.py), which writes a decoder
layer's normalized activations straight as codes for the FP8 / INT8 GEMM after it.

The standalone quantizer also takes a merged [gate; up] projection (``gated``): it quantizes
silu(gate) * up, rounded to x's dtype first as ``silu_and_mul`` stores it, so the MLP's
activation and the down projection's quantizer are one pass over the gate/up rows instead of
a write and two reads of the activation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kiln.kernels._triton import next_power_of_2, pdl, tl, triton, use_triton, wait_for_inputs
from kiln.kernels.activation import silu_and_mul_ref, silu_mul

# widest row a program holds in registers (one read of x); wider rows take two passes
ONE_PASS_MAX_K = 16384


class RowQuant(NamedTuple):
    """How to quantize activation rows: codes of ``dtype`` in [-qmax, qmax]."""

    dtype: torch.dtype  # torch.float8_e4m3fn or torch.int8
    qmax: float
    min_amax: float  # an all-zero row still gets a finite scale
    smooth: torch.Tensor | None = None  # [K] float32
    static_scale: torch.Tensor | None = None  # [] float32: one scale for every row


class QuantizedRows(NamedTuple):
    """Activation rows as codes [..., K] and their float32 scales [M, 1]."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


@triton.jit
def row_codes(x, scale, QMAX_: tl.constexpr, IS_FP8: tl.constexpr, dtype: tl.constexpr):
    """x (float32, smoothed) / scale -> codes: e4m3 by the cast, int8 rounded half up."""
    v = tl.minimum(tl.maximum(x / scale, -QMAX_), QMAX_)
    return v.to(dtype) if IS_FP8 else tl.floor(v + 0.5).to(tl.int8)


def quantize_rows_ref(x: torch.Tensor, quant: RowQuant) -> QuantizedRows:
    """Plain PyTorch row quantization of x [M, K] (the CPU path and the test oracle)."""
    xf = x.float() if quant.smooth is None else x.float() * quant.smooth.float()
    if quant.static_scale is not None:
        scales = quant.static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    else:
        scales = xf.abs().amax(-1, keepdim=True).clamp_min(quant.min_amax) / quant.qmax
    v = (xf / scales).clamp(-quant.qmax, quant.qmax)
    codes = v.to(quant.dtype) if quant.dtype != torch.int8 else torch.floor(v + 0.5).to(torch.int8)
    return QuantizedRows(codes, scales.contiguous())


@triton.jit
def _row_values(x_row, smooth_ptr, cols, mask, K, HAS_SMOOTH: tl.constexpr,
                GATED: tl.constexpr):  # fmt: skip
    """x[m, cols] in float32 (GATED: silu(gate) * up rounded to x's dtype), smoothed."""
    if GATED:
        dt = x_row.dtype.element_ty
        gate = tl.load(x_row + cols, mask=mask, other=0.0)
        up = tl.load(x_row + K + cols, mask=mask, other=0.0)
        x = silu_mul(gate, up, dt).to(dt).to(tl.float32)
    else:
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SMOOTH:
        x *= tl.load(smooth_ptr + cols, mask=mask, other=0.0)
    return x


@triton.jit
def _quantize_rows_kernel(
    x_ptr, smooth_ptr, static_ptr, q_ptr, scale_ptr, K, stride_x, stride_q,
    QMAX_: tl.constexpr, MIN_AMAX_: tl.constexpr, IS_FP8: tl.constexpr, HAS_SMOOTH: tl.constexpr,
    STATIC: tl.constexpr, GATED: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """One program per row of K values (GATED: of 2 K gate / up values). ONE_PASS (K <= BLOCK_K):
    the row is read once and held in registers; a longer one is read twice (its amax, then its
    codes)."""
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    offs = tl.arange(0, BLOCK_K)
    dt = q_ptr.dtype.element_ty
    if ONE_PASS:
        x = _row_values(x_row, smooth_ptr, offs, offs < K, K, HAS_SMOOTH, GATED)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    elif ONE_PASS:
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX_) / QMAX_
    else:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xk = _row_values(x_row, smooth_ptr, k0 + offs, k0 + offs < K, K, HAS_SMOOTH, GATED)
            amax = tl.maximum(amax, tl.abs(xk))
        scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX_) / QMAX_
    tl.store(scale_ptr + row, scale)
    if ONE_PASS:
        tl.store(q_row + offs, row_codes(x, scale, QMAX_, IS_FP8, dt), mask=offs < K)
    else:
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs
            xk = _row_values(x_row, smooth_ptr, cols, cols < K, K, HAS_SMOOTH, GATED)
            tl.store(q_row + cols, row_codes(xk, scale, QMAX_, IS_FP8, dt), mask=cols < K)


def quantize_rows_triton(x: torch.Tensor, quant: RowQuant, gated: bool = False) -> QuantizedRows:
    """x [M, K] (gated: [M, 2 K], a merged gate / up projection) -> codes [M, K] and scales
    [M, 1]; one program per row."""
    m, width = x.shape
    assert x.stride(1) == 1
    assert not gated or width % 2 == 0, f"a gated row has 2 * I values, not {width}"
    k = width // 2 if gated else width
    codes = torch.empty(m, k, dtype=quant.dtype, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0:
        return QuantizedRows(codes, scales)
    block = min(next_power_of_2(k), ONE_PASS_MAX_K)
    _quantize_rows_kernel[(m,)](
        x, quant.smooth if quant.smooth is not None else scales,
        quant.static_scale if quant.static_scale is not None else scales, codes, scales, k,
        x.stride(0), codes.stride(0), QMAX_=quant.qmax, MIN_AMAX_=quant.min_amax,
        IS_FP8=quant.dtype != torch.int8, HAS_SMOOTH=quant.smooth is not None,
        STATIC=quant.static_scale is not None, GATED=gated, BLOCK_K=block, ONE_PASS=block >= k,
        num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16, **pdl(x.device),
    )  # fmt: skip
    return QuantizedRows(codes, scales)


def quantize_rows(x: torch.Tensor, quant: RowQuant, gated: bool = False) -> QuantizedRows:
    """x [..., K] (gated: [..., 2 K] -> silu(gate) * up) as codes [M, K] and scales [M, 1]."""
    x2 = x.reshape(-1, x.shape[-1])
    if use_triton(x2):
        return quantize_rows_triton(x2 if x2.stride(-1) == 1 else x2.contiguous(), quant, gated)
    return quantize_rows_ref(silu_and_mul_ref(x2) if gated else x2, quant)

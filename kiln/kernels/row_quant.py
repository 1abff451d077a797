"""Per-token (row) activation quantization: what the W8A8 GEMMs take as input.

    scale[m] = max(absmax_k(x[m, k] s[k]), min_amax) / qmax    (or one static scale)
    q[m, k] = round(clamp(x[m, k] s[k] / scale[m], -qmax, qmax))    e4m3 or int8 codes

``s`` is SmoothQuant's per-channel migration (absent: 1). The jit helper is shared by the
standalone quantizer (kiln/quant/w8a8.py) and RMSNorm's quantized output (rms_norm.py), which
writes a decoder layer's normalized activations straight as codes for the FP8 / INT8 GEMM after
it, so one kernel does the work of two.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kiln.kernels._triton import tl, triton


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

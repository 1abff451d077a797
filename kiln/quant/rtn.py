"""Integer weight grids: group-wise scales / zero points, round-to-nearest, int4 packing.

    symmetric:  s = clip * max|w_g| / (2^(b-1) - 1/2),  z = 2^(b-1)
    asymmetric: s = clip * (max(w_g, 0) - min(w_g, 0)) / (2^b - 1),  z = round(-clip min / s)
    u = clamp(round(w / s) + z, 0, 2^b - 1),   w_hat = (u - z) s

A group is ``group_size`` consecutive input channels of one output row (-1: the whole row).
``IntWeight`` is what every weight-only method (RTN, AWQ, GPTQ) hands to the Linear method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.kernels.quant_gemm import unpack_int4, wint_dequant_ref  # noqa: F401 (re-export)

MIN_SCALE = 1e-8


@dataclass
class IntWeight:
    codes: torch.Tensor  # uint8 [N, K], storage column order (permuted when perm is set)
    scales: torch.Tensor  # [N, num_groups]
    zeros: torch.Tensor | None  # uint8 [N, num_groups]; None: symmetric (z = 2^(bits-1))
    bits: int
    group_size: int  # -1: per output channel
    perm: torch.Tensor | None = None  # int32 [K]: storage column k holds input channel perm[k]
    smooth: torch.Tensor | None = None  # [K] in storage order: x is multiplied by it (AWQ 1/s)

    def qweight(self) -> torch.Tensor:
        return pack_int4(self.codes) if self.bits == 4 else self.codes.contiguous()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The effective dense weight [N, K] in input-channel order (smooth folded in)."""
        return wint_dequant_ref(self.qweight(), self.scales, self.zeros, self.bits,
                                self.group_size, dtype, self.perm, self.smooth)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in [0, 15] -> int32 [N, K / 8]; code k at bits 4 (k % 8) of word k / 8."""
    n, k = codes.shape
    if k % 8:
        raise ValueError(f"int4 packing needs K divisible by 8, got K={k}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("int4 codes must lie in [0, 15]")
    shifts = torch.arange(0, 32, 4, device=codes.device, dtype=torch.int64)
    words = (codes.reshape(n, k // 8, 8).to(torch.int64) << shifts).sum(-1)
    # two's complement: words >= 2^31 wrap to negative int32 with the same bits
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    gs = k if group_size <= 0 else group_size
    if k % gs:
        raise ValueError(f"group_size={group_size} does not divide in_features={k}")
    return w.reshape(n, k // gs, gs)


def _stored(scales: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """Scales rounded to ``scale_dtype`` (returned as float32), never 0: float16 holds nothing
    below 6e-8, so an all-zero group's scale (MIN_SCALE / 7.5) would round to 0 and w / s give
    NaN (GPTQ then spread it over the whole row); the smallest positive value takes its place."""
    info = torch.finfo(scale_dtype)
    return scales.to(scale_dtype).float().clamp_min(info.smallest_normal * info.eps)


def int_qparams(w: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                clip: float | torch.Tensor = 1.0, scale_dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales [N, G] (rounded to ``scale_dtype``, then float32) and zeros [N, G] or None.

    ``clip`` shrinks the range (a scalar or [N, G]); AWQ searches it per group.
    """
    wg = _grouped(w.float(), group_size)
    if symmetric:
        amax = wg.abs().amax(-1) * clip
        # all 2^b codes in use: -amax lands on code 0, +amax half a step above the top code
        # (clamped to it), so the step is 1/15 instead of 1/14 of the range at 4 bits
        scales = amax.clamp_min(MIN_SCALE) / (2 ** (bits - 1) - 0.5)
        return _stored(scales, scale_dtype), None
    wmax = wg.amax(-1).clamp_min(0) * clip
    wmin = wg.amin(-1).clamp_max(0) * clip
    scales = _stored((wmax - wmin).clamp_min(MIN_SCALE) / (2**bits - 1), scale_dtype)
    zeros = torch.round(-wmin / scales).clamp(0, 2**bits - 1)
    return scales, zeros


def quantize_codes(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   bits: int, group_size: int) -> torch.Tensor:
    """Round-to-nearest codes uint8 [N, K] on the given grid."""
    wg = _grouped(w.float(), group_size)
    z = zeros.float()[..., None] if zeros is not None else 2.0 ** (bits - 1)
    u = torch.round(wg / scales[..., None]) + z
    return u.clamp(0, 2**bits - 1).to(torch.uint8).reshape(w.shape)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                  clip: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Quantize-dequantize in float32 (the search objective of AWQ)."""
    scales, zeros = int_qparams(w, bits, group_size, symmetric, clip)
    u = _grouped(quantize_codes(w, scales, zeros, bits, group_size).float(), group_size)
    z = zeros[..., None] if zeros is not None else 2.0 ** (bits - 1)
    return ((u - z) * scales[..., None]).reshape(w.shape)


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                 scale_dtype: torch.dtype = torch.float32,
                 clip: float | torch.Tensor = 1.0) -> IntWeight:
    scales, zeros = int_qparams(w, bits, group_size, symmetric, clip, scale_dtype)
    codes = quantize_codes(w, scales, zeros, bits, group_size)
    return IntWeight(codes, scales.to(scale_dtype),
                     zeros.to(torch.uint8) if zeros is not None else None, bits, group_size)

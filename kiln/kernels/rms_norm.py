"""RMSNorm, optionally fused with the residual add that precedes it.

    y = weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)

The statistic and the scaling run in float32; the normalized value is rounded to x.dtype before
the weight multiply, exactly as Hugging Face's LlamaRMSNorm does. With a residual the kernel first
forms `residual = x + residual` (rounded to x.dtype, as an eager `x + residual` would) and returns
`(rms_norm(residual), residual)`: one pass reads x and residual once and writes both outputs,
instead of three eager kernels. Outputs are new tensors of x.dtype.

With a ``RowQuant`` the normalized rows come out as W8A8 activation codes and per-row scales
(``QuantizedRows``) for the FP8 / INT8 GEMM after the norm, computed from the row exactly as the
standalone quantizer would read it, so that kernel and its pass over memory disappear.
"""

from __future__ import annotations

import torch

from kiln.kernels._triton import (
    next_power_of_2,
    pdl,
    release_then_wait,
    tl,
    triton,
    use_triton,
    wait_for_inputs,
)
from kiln.kernels.row_quant import QuantizedRows, RowQuant, quantize_rows_ref, row_codes

# Rows up to which the norm releases the kernel after it before its own PDL wait: a decode step's
# norm is short and the GEMM after it gains the SMs the GEMM before it frees (decode steps of 1-64
# sequences 0.9-1.5% shorter, ab_runs.txt 44). A prefill step's norm of thousands of rows is not
# short, and cuBLAS follows it: no gain measured there, and slower prefill steps in one A/B
RELEASE_FIRST_MAX_ROWS = 1024


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, smooth_ptr, static_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr, IS_FP8: tl.constexpr, HAS_SMOOTH: tl.constexpr, STATIC: tl.constexpr,
    QMAX_: tl.constexpr, MIN_AMAX_: tl.constexpr,
    BLOCK: tl.constexpr, RELEASE_FIRST: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    if HAS_SMOOTH:
        smooth = tl.load(smooth_ptr + cols, mask=mask, other=0.0)
    if RELEASE_FIRST:  # the GEMM after the norm starts on its weights meanwhile
        release_then_wait(USE_PDL)
    else:
        wait_for_inputs(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    out = (normed * w).to(x_ptr.dtype.element_ty)
    if QUANT:  # the row as the unfused path stores it, then quantized
        v = out.to(tl.float32)
        if HAS_SMOOTH:
            v *= smooth
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            scale = tl.maximum(tl.max(tl.abs(v), axis=0), MIN_AMAX_) / QMAX_
        tl.store(scale_ptr + row, scale)
        out = row_codes(v, scale, QMAX_, IS_FP8, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quant: RowQuant | None = None,
    num_warps: int | None = None,
) -> torch.Tensor | QuantizedRows | tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """Launch the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1)."""
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), f"weight {tuple(weight.shape)} != ({hidden},)"
    assert weight.stride(-1) == 1
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype if quant is None else quant.dtype, device=x.device)
    out2 = out.view(-1, hidden)
    scales = (torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device)
              if quant is not None else weight)  # weight: a placeholder QUANT=False never reads
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        res2 = residual.reshape(-1, hidden)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = torch.empty_like(x)
        res_out2 = res_out.view(-1, hidden)
    else:
        res2 = res_out2 = x2  # unused: HAS_RESIDUAL=False prunes every access
    normed = out if quant is None else QuantizedRows(out, scales)
    num_rows = x2.shape[0]
    if num_rows == 0:
        return normed if residual is None else (normed, res_out)
    block = next_power_of_2(hidden)
    assert block <= 65536, f"hidden size {hidden} too large for one row per program"
    if num_warps is None:
        # ~16 elements per thread: 16-byte bf16 vectors with few registers per thread
        num_warps = min(max(block // 512, 1), 16)
    smooth = quant.smooth if quant is not None else None
    static = quant.static_scale if quant is not None else None
    _rms_norm_kernel[(num_rows,)](
        x2, res2, weight, out2, res_out2, scales,
        smooth if smooth is not None else scales, static if static is not None else scales,
        x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0),
        hidden, eps,
        HAS_RESIDUAL=residual is not None, QUANT=quant is not None,
        IS_FP8=quant is not None and quant.dtype != torch.int8, HAS_SMOOTH=smooth is not None,
        STATIC=static is not None, QMAX_=quant.qmax if quant else 0.0,
        MIN_AMAX_=quant.min_amax if quant else 0.0, BLOCK=block,
        RELEASE_FIRST=num_rows <= RELEASE_FIRST_MAX_ROWS, num_warps=num_warps,
        **pdl(x.device),
    )  # fmt: skip
    return normed if residual is None else (normed, res_out)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    quant: RowQuant | None = None,
) -> torch.Tensor | QuantizedRows | tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """Plain PyTorch RMSNorm (the CPU path and the test oracle)."""
    if residual is not None:
        residual = x + residual
        x = residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight.float() * normed.float()).to(x.dtype)
    if quant is not None:
        codes, scales = quantize_rows_ref(out.reshape(-1, out.shape[-1]), quant)
        out = QuantizedRows(codes.reshape(out.shape), scales)
    return out if residual is None else (out, residual)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    quant: RowQuant | None = None,
) -> torch.Tensor | QuantizedRows | tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """RMSNorm over the last dim of x [..., hidden]; with `residual`: (out, x + residual); with
    `quant`: the normalized rows as W8A8 activation codes (``QuantizedRows``)."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if use_triton(*tensors):
        return rms_norm_triton(x, weight, eps, residual, quant)
    return rms_norm_ref(x, weight, eps, residual, quant)

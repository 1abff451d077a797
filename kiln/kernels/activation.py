"""SiLU-and-multiply, the gated activation of Llama's MLP.

    out = silu(x[..., :I]) * x[..., I:],    silu(g) = g * sigmoid(g),    x: [..., 2 * I]

One pass reads the fused gate/up projection once and writes half of it. silu runs in float32 and
is rounded to x.dtype before the multiply, as the eager `F.silu(gate) * up` rounds it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels._triton import pdl, tl, triton, use_triton, wait_for_inputs


@triton.jit
def silu_mul(gate, up, dt: tl.constexpr):
    """silu(gate) * up in float32 with the unfused path's roundings: gate and up as stored in
    ``dt`` (the output dtype), silu rounded to it before the multiply as eager
    ``F.silu(gate) * up`` rounds it (the caller rounds the product). Shared by this kernel and
    the GEMV / GEMM epilogues that apply it to their float32 accumulators."""
    g = gate.to(dt).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
    return act * up.to(dt).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    dt = out_ptr.dtype.element_ty
    out = silu_mul(gate, up, dt).to(dt)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def silu_and_mul_triton(x: torch.Tensor, block: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """Launch the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1)."""
    assert x.shape[-1] % 2 == 0, f"last dim {x.shape[-1]} is not 2 * intermediate"
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    num_rows = x2.shape[0]
    if num_rows == 0 or inter == 0:
        return out
    grid = (num_rows, triton.cdiv(inter, block))
    assert grid[1] < 65536
    _silu_and_mul_kernel[grid](
        x2, out2, x2.stride(0), out2.stride(0), inter, BLOCK=block, num_warps=num_warps,
        **pdl(x.device),
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch silu(gate) * up (the CPU path and the test oracle)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2*I] -> [..., I] = silu(x[..., :I]) * x[..., I:]."""
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)

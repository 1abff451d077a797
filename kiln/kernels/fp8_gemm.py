"""FP8 W8A8 GEMM for decode batch sizes: y = (xq wq^T) * sx * sw (+ b), tensor cores, Triton.

    y[m, n] = sx[m] * sw[n] * sum_k xq[m, k] wq[n, k] + b[n]        xq, wq: float8 e4m3

At a few dozen rows an FP8 GEMM is bound by streaming the weights, and what matters is that
every SM streams: the grid is one program per BLOCK_N output columns (and per BLOCK_M rows),
BLOCK_N picked so that the grid covers the SMs, and each program walks K with a deep software
pipeline. torch._scaled_mm (cuBLASLt) reads an [N, K] e4m3 weight at 1100-2400 GB/s at M = 64 on
an H100 depending on the shape (benchmarks/results/h100/fp8_swap_ab.txt), the down projection
(N = 4096, K = 14336) being the worst: its few wide tiles leave SMs idle.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kiln.kernels._triton import num_sms, pdl, tl, triton, wait_for_inputs


class Fp8GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit(do_not_specialize=["M"])  # the batch size: no new variant per step shape
def _fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (checked by the launcher)
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    sx = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
    sw = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
    y = acc * sx[:, None] * sw[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_gemm_config(m: int, n: int, k: int, sms: int) -> Fp8GemmConfig:
    """Tiles from the H100 sweep (benchmarks/results/h100/fp8_gemm_sweep.txt, M = 8 ... 64).

    Rows: one 64-row tile (the wgmma shape; 16-row tiles were never faster). Columns: layers
    too narrow for one 64-column program per SM (o_proj and down_proj, N = 4096; qkv, 6144) take
    32 columns a program with 8 warps and a 6-deep pipeline; wide ones (gate_up) take 64 columns
    and 256-deep K steps (128 where K is not a multiple of 256). Every config needs K % 128 == 0.
    """
    if triton.cdiv(n, 64) < sms:
        return Fp8GemmConfig(64, 32, 128, 8, 6)
    return Fp8GemmConfig(64, 64, 256 if k % 256 == 0 else 128, 4, 3)


def fp8_gemm_triton(xq: torch.Tensor, x_scales: torch.Tensor, wq: torch.Tensor,
                    w_scales: torch.Tensor, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.bfloat16,
                    config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """xq [M, K] e4m3, x_scales [M, 1] fp32, wq [N, K] e4m3, w_scales [N] fp32 -> y [M, N]."""
    m, k = xq.shape
    n = wq.shape[0]
    cfg = config or fp8_gemm_config(m, n, k, num_sms(xq.device))
    assert wq.shape[1] == k and k % cfg.block_k == 0, f"K={k} must be a multiple of {cfg.block_k}"
    assert xq.stride(1) == 1 and wq.stride(1) == 1
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _fp8_gemm_kernel[grid](
        xq, x_scales, wq, w_scales, bias if bias is not None else w_scales, y, m, n, k,
        xq.stride(0), wq.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl(xq.device),
    )  # fmt: skip
    return y


def fp8_gemm_ref(xq: torch.Tensor, x_scales: torch.Tensor, wq: torch.Tensor,
                 w_scales: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The same product in float32 PyTorch (the test oracle)."""
    y = (xq.float() @ wq.float().t()) * x_scales.float() * w_scales.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)

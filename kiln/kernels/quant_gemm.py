"""Weight-only quantized GEMM with dequantization inside the kernel (W4A16, W8A16, FP8-weight).

    W[n, k] = (u[n, k] - z[n, k // G]) * s[n, k // G]        (FP8 weights: W = f8[n, k] * s[n])
    y[m, n] = sum_k xs[m, k] * W[n, k] + b[n],   xs[m, k] = x[m, perm[k]] * smooth[k]

u are 4-bit codes packed 8 per int32 along K (code k sits at bits 4 (k % 8) of word k // 8) or
8-bit codes (uint8); z is 2^(bits-1) when the format is symmetric; G = K for per-channel scales.
``perm`` (GPTQ act-order) and ``smooth`` (AWQ) are optional per-input-channel gathers/scales.

Two paths, picked by shape: the fused kernel (weights read once in their packed form: the
decode path, M small) and, for large M where the GEMM is compute bound, one dequantization
kernel into a dense weight followed by cuBLAS (the same math, ``W`` rounded to x.dtype). W8A8
(FP8 / INT8 activations through cuBLAS) lives in ``kiln/quant/w8a8.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.kernels._triton import next_power_of_2, num_sms, tl, triton, use_triton

FP8_DTYPE = torch.float8_e4m3fn
# above this many rows dequantize-then-cuBLAS beats the fused kernel (benchmarks/gpu_quant.py)
FUSED_MAX_M = {4: 128, 8: 64}


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # 1: GEMV (reduce with CUDA cores); >= 16: tensor-core tl.dot
    block_n: int
    block_k: int
    split_k: int = 1  # > 1: partial sums added atomically into a float32 output
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _wint_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, smooth_ptr, out_ptr,
    M, N, K, k_per_split, group_size,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
    BITS: tl.constexpr, W_FP8: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, GROUPS_PER_TILE: tl.constexpr, ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_g = tl.arange(0, GROUPS_PER_TILE)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_begin = pid_k * k_per_split
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        src_k = tl.load(perm_ptr + offs_k, mask=k_mask, other=0) if HAS_PERM else offs_k
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + src_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if HAS_SMOOTH:
            sm = tl.load(smooth_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * sm[None, :]).to(x_ptr.dtype.element_ty)
        wk_mask = n_mask[:, None] & k_mask[None, :]
        if BITS == 4:
            offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            packed = tl.load(
                w_rows + offs_w[None, :], mask=n_mask[:, None] & (offs_w < K // 8), other=0
            )
            shifts = tl.arange(0, 8) * 4
            u = tl.reshape((packed[:, :, None] >> shifts[None, None, :]) & 0xF, [BLOCK_N, BLOCK_K])
        elif W_FP8:  # no `other`: fp8 has no integer zero; masked lanes are zeroed below
            u = tl.load(w_rows + offs_k[None, :], mask=wk_mask)
        else:
            u = tl.load(w_rows + offs_k[None, :], mask=wk_mask, other=0)
        # per-(row, group) scales of this tile: [BLOCK_N, GROUPS_PER_TILE]
        groups = k0 // group_size + offs_g
        sg_mask = n_mask[:, None] & (groups[None, :] * group_size < K)
        s = tl.load(
            s_ptr + offs_n[:, None] * stride_sn + groups[None, :], mask=sg_mask, other=0.0
        ).to(tl.float32)
        w = tl.reshape(u.to(tl.float32), [BLOCK_N, GROUPS_PER_TILE, BLOCK_K // GROUPS_PER_TILE])
        if not W_FP8:
            if HAS_ZEROS:
                z = tl.load(
                    z_ptr + offs_n[:, None] * stride_zn + groups[None, :], mask=sg_mask, other=0
                ).to(tl.float32)
                w = w - z[:, :, None]
            else:
                w = w - (1 << (BITS - 1))
        w = tl.reshape(w * s[:, :, None], [BLOCK_N, BLOCK_K])
        if W_FP8:  # masked fp8 lanes are undefined (maybe NaN); masked codes loaded as 0 are finite
            w = tl.where(wk_mask, w, 0.0)
        if BLOCK_M == 1:  # GEMV: a dot would pad M to 16 and shuffle registers for nothing
            acc += tl.sum(w[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
        else:
            acc += tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)))
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _wint_dequant_kernel(
    w_ptr, s_ptr, z_ptr, perm_ptr, smooth_ptr, out_ptr,
    N, K, group_size, stride_wn, stride_sn, stride_zn, stride_on,
    BITS: tl.constexpr, W_FP8: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask, k_mask = offs_n < N, offs_k < K
    mask = n_mask[:, None] & k_mask[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    if BITS == 4:
        word = tl.load(w_ptr + rows * stride_wn + offs_k[None, :] // 8, mask=mask, other=0)
        u = (word >> ((offs_k[None, :] % 8) * 4)) & 0xF
    elif W_FP8:
        u = tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=mask)
    else:
        u = tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=mask, other=0)
    groups = offs_k[None, :] // group_size
    w = u.to(tl.float32)
    if not W_FP8:
        if HAS_ZEROS:
            w = w - tl.load(z_ptr + rows * stride_zn + groups, mask=mask, other=0).to(tl.float32)
        else:
            w = w - (1 << (BITS - 1))
    w = w * tl.load(s_ptr + rows * stride_sn + groups, mask=mask, other=0.0).to(tl.float32)
    w = w.to(out_ptr.dtype.element_ty)  # round W as the fused path does, then apply smooth
    if HAS_SMOOTH:
        sm = tl.load(smooth_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        w = (w.to(tl.float32) * sm[None, :]).to(out_ptr.dtype.element_ty)
    dst_k = tl.load(perm_ptr + offs_k, mask=k_mask, other=0) if HAS_PERM else offs_k
    tl.store(out_ptr + rows * stride_on + dst_k[None, :], w, mask=mask)


def _flags(
    qweight: torch.Tensor,
    zeros: torch.Tensor | None,
    perm: torch.Tensor | None,
    smooth: torch.Tensor | None,
) -> dict:
    return dict(
        W_FP8=qweight.dtype == FP8_DTYPE,
        HAS_ZEROS=zeros is not None,
        HAS_PERM=perm is not None,
        HAS_SMOOTH=smooth is not None,
    )


def _default_config(m: int, n: int, k: int, bits: int, device: torch.device) -> GemmConfig:
    """Heuristic tiles; benchmarks/gpu_quant.py sweeps alternatives at the Llama-8B shapes."""
    if m == 1:
        block_n, block_k, warps = (16, 512, 4) if bits == 4 else (16, 256, 4)
        cfg = GemmConfig(1, block_n, block_k, num_warps=warps, num_stages=3)
    elif m <= 16:
        cfg = GemmConfig(16, 64, 128 if bits == 4 else 128, num_warps=4, num_stages=4)
    elif m <= 64:
        cfg = GemmConfig(64, 64, 64, num_warps=4, num_stages=4)
    else:
        cfg = GemmConfig(128, 128, 64, num_warps=8, num_stages=3)
    block_k = min(cfg.block_k, next_power_of_2(k))
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    # enough programs to fill the GPU twice: a GEMV over 4096 rows is only 256 tiles
    split = 1
    while tiles * split < 2 * num_sms(device) and k // (block_k * split * 2) >= 2:
        split *= 2
    return GemmConfig(cfg.block_m, cfg.block_n, block_k, split, cfg.num_warps, cfg.num_stages)


def wint_gemm_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    perm: torch.Tensor | None = None,
    smooth: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Fused path: x [M, K] (contiguous rows) -> [M, N] in x.dtype."""
    m, k = x.shape
    n = scales.shape[0]
    group = k if group_size <= 0 else group_size
    assert x.stride(1) == 1 and qweight.stride(1) == 1 and scales.stride(1) == 1
    assert qweight.shape == (n, k // 8 if bits == 4 else k), f"qweight {tuple(qweight.shape)}"
    assert scales.shape[1] == -(-k // group), f"scales {tuple(scales.shape)} for group {group}"
    cfg = config or _default_config(m, n, k, bits, x.device)
    block_k = min(cfg.block_k, next_power_of_2(k))
    if group >= k:  # per channel: every tile lies in group 0
        groups_per_tile = 1
    else:
        assert group % block_k == 0 or block_k % group == 0, "tiles must not straddle groups"
        groups_per_tile = max(block_k // group, 1)
    assert block_k >= 8 and block_k % 8 == 0
    k_per_split = -(-k // (cfg.split_k * block_k)) * block_k
    atomic = cfg.split_k > 1
    out = (torch.zeros if atomic else torch.empty)(
        m, n, device=x.device, dtype=torch.float32 if atomic else x.dtype
    )
    if m == 0:
        return out.to(x.dtype)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    _wint_gemm_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales, perm if perm is not None
        else scales, smooth if smooth is not None else scales, out,
        m, n, k, k_per_split, group,
        x.stride(0), qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0, out.stride(0),
        BITS=bits, GROUPS_PER_TILE=groups_per_tile, ATOMIC=atomic,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_flags(qweight, zeros, perm, smooth),
    )  # fmt: skip
    return out.to(x.dtype) if atomic else out


def wint_dequant_triton(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
    perm: torch.Tensor | None = None,
    smooth: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense W_eff [N, K] in ``dtype`` with smooth folded in and columns back in input order."""
    n = scales.shape[0]
    k = qweight.shape[1] * (8 if bits == 4 else 1)
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_n, block_k = 32, 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _wint_dequant_kernel[grid](
        qweight, scales, zeros if zeros is not None else scales, perm if perm is not None
        else scales, smooth if smooth is not None else scales, out,
        n, k, k if group_size <= 0 else group_size, qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0, out.stride(0),
        BITS=bits, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        **_flags(qweight, zeros, perm, smooth),
    )  # fmt: skip
    return out


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [N, K / 8] -> codes uint8 [N, K] (code k at bits 4 (k % 8) of word k // 8)."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    codes = (packed.unsqueeze(-1) >> shifts) & 0xF
    return codes.reshape(packed.shape[0], -1).to(torch.uint8)


def wint_dequant_ref(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
    perm: torch.Tensor | None = None,
    smooth: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch dequantization with the kernel's rounding (the CPU path and the oracle)."""
    u = unpack_int4(qweight) if bits == 4 else qweight
    k = u.shape[1]
    group = k if group_size <= 0 else group_size
    w = u.float()
    if qweight.dtype != FP8_DTYPE:
        z = (
            zeros.float().repeat_interleave(group, 1)[:, :k]
            if zeros is not None
            else 2.0 ** (bits - 1)
        )
        w = w - z
    w = (w * scales.float().repeat_interleave(group, 1)[:, :k]).to(dtype)
    if smooth is not None:
        w = (w.float() * smooth.float()).to(dtype)
    if perm is not None:
        w = torch.empty_like(w).index_copy_(1, perm.long(), w)
    return w


def wint_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    perm: torch.Tensor | None = None,
    smooth: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    w = wint_dequant_ref(qweight, scales, zeros, bits, group_size, x.dtype, perm, smooth)
    return F.linear(x, w, bias)


def wint_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    perm: torch.Tensor | None = None,
    smooth: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T + b for a weight-only quantized W; x [..., K] -> [..., N] in x.dtype."""
    if not use_triton(x, qweight, scales):
        return wint_linear_ref(x, qweight, scales, zeros, bits, group_size, perm, smooth, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1 or x2.stride(0) != x2.shape[1]:
        x2 = x2.contiguous()
    if x2.shape[0] <= FUSED_MAX_M[bits]:
        out = wint_gemm_triton(x2, qweight, scales, zeros, bits, group_size, perm, smooth)
        if bias is not None:
            out += bias
    else:
        w = wint_dequant_triton(qweight, scales, zeros, bits, group_size, x.dtype, perm, smooth)
        out = F.linear(x2, w, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])

"""Tensor-core W4A16 GEMM for decode batches (3..MMA_MAX_M rows): symmetric int4, group-wise.

    y[m, n] = sum_k xs[m, k] (u[n, k] - 8) s[n, k // G],   xs[m, k] = x[m, k] * smooth[k]

Codes are kiln/quant's packing (code k at bits 4 (k % 8) of int32 word k // 8, [N, K / 8]).
One lop3 turns a word shifted by 4 i into the bf16 (or fp16) pair (128 + u_i, 128 + u_(i+4))
(the exponent of 128 with the code in the mantissa, 1024 for fp16), one packed FMA into
(u_i - 8, u_(i+4) - 8), exact; a K tile of one scale group goes through tl.dot against x, whose
columns are permuted the same way (a reduction does not care about order), and the group's
float32 result is scaled before it joins the accumulator, as the dequantized reference's
rounding-free math does.

K is split over ``split`` programs per tile of rows, so that every SM has work when N alone
gives too few tiles; the last program of a tile to finish adds the float32 partials in split
order (the same bits whatever the arrival order) and writes the output, then resets the tile's
arrival counter for the next launch. The counters are one zeroed int32 buffer per device,
allocated on first use (which must not be inside a CUDA graph capture: run once eagerly). Two
launches must not overlap in time on different streams of one device (with PDL, one stream's
next kernel touches the counters only after its wait, when this kernel has finished).

Against the CUDA-core kernels of quant_gemm (H100, Llama-3.1-8B shapes, bf16, g128,
benchmarks/results/h100/int4_mma.txt): qkv + o + gate_up + down take 84 us at M = 16 against
240 for the tile kernel this replaced and 166 for bf16 cuBLAS; 112 at M = 64 against 329 and
169. At M = 1 the FMA GEMV is 1.4-1.7x faster, so it keeps M <= 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.kernels._triton import num_sms, pdl, tl, triton, wait_for_inputs

MMA_MIN_M = 3  # below: the CUDA-core GEMV (quant_gemm) is as fast or faster
MMA_MAX_M = 64  # above: dequantize + cuBLAS; at M = 128 this kernel lost to bf16 by 1.6-2x
_COUNTER_CAPACITY = 1 << 16  # row tiles per launch

# per asm instance: the word shifted by 4 i in $1 ($2 is the same register), the pair out in $0
_DECODE_BF16 = tl.constexpr(
    "{ .reg .b32 t, one, off; mov.b32 one, 0x3F803F80; mov.b32 off, 0xC308C308; "
    "lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 $0, t, one, off; }")
_DECODE_F16 = tl.constexpr(
    "{ .reg .b32 t, one, off; mov.b32 one, 0x3C003C00; mov.b32 off, 0xE408E408; "
    "lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA; fma.rn.f16x2 $0, t, one, off; }")


@dataclass(frozen=True)
class MmaTiles:
    block_n: int  # rows of W per program (the dot's M: 64 or 128)
    split: int  # programs sharing a tile's K
    block_m: int  # rows of x, padded (16, 32 or 64)
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _code_pairs(shifted, ASM: tl.constexpr, dtype: tl.constexpr):
    """shifted [..., 4] (a word >> 4 i) -> [..., 4, 2] in dtype: (u_i - 8, u_(i+4) - 8)."""
    if ASM:  # nested ifs: each folds at compile time, so one branch's type is all there is
        if dtype == tl.bfloat16:  # (inline asm takes literal dtypes, not a constexpr one)
            return tl.inline_asm_elementwise(_DECODE_BF16, "=r,r,r", [tl.join(shifted, shifted)],
                                             dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(_DECODE_F16, "=r,r,r", [tl.join(shifted, shifted)],
                                             dtype=tl.float16, is_pure=True, pack=2)
    # the interpreter runs no PTX: the same values with integer ops
    lo = (shifted & 0xF) - 8
    hi = ((shifted >> 16) & 0xF) - 8
    return tl.join(lo, hi).to(tl.float32).to(dtype)


@triton.jit
def _int4_mma_kernel(
    x_ptr, w_ptr, s_ptr, smooth_ptr, out_ptr, part_ptr, count_ptr,
    M, N, KW, kw_per_split, stride_xm, stride_wn, stride_sn, stride_om,
    WPG: tl.constexpr, HAS_SMOOTH: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """out^T [BLOCK_N, BLOCK_M] of one row tile over 1/SPLIT of K, one scale group (WPG words
    a row) per step: acc += s * (W_codes [BLOCK_N, 8 WPG] @ x^T [8 WPG, BLOCK_M])."""
    BK: tl.constexpr = WPG * 8
    dt = x_ptr.dtype.element_ty
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)  # clamped, not masked: unpredicated loads
    offs_w = tl.arange(0, WPG)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    shifts = tl.arange(0, 4) * 4
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    kw_begin = pid_k * kw_per_split
    wait_for_inputs(USE_PDL)
    for kw0 in range(kw_begin, tl.minimum(kw_begin + kw_per_split, KW), WPG):
        words = tl.load(w_rows + (kw0 + offs_w)[None, :])  # [BLOCK_N, WPG]
        w = _code_pairs(words[:, :, None] >> shifts[None, None, :], ASM, dt)
        w = tl.reshape(w, [BLOCK_N, BK])  # column 8 c + 2 i + h holds code 8 c + i + 4 h
        k = kw0 * 8 + tl.arange(0, BK)
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0)  # [BLOCK_M, BK]
        if HAS_SMOOTH:  # AWQ: x * smooth, rounded to x's dtype as in the reference
            x = (x.to(tl.float32) * tl.load(smooth_ptr + k).to(tl.float32)[None, :]).to(dt)
        x = tl.permute(tl.reshape(x, [BLOCK_M, WPG, 2, 4]), (0, 1, 3, 2))  # the codes' order
        part = tl.dot(w, tl.trans(tl.reshape(x, [BLOCK_M, BK])))
        s = tl.load(s_ptr + rows * stride_sn + kw0 // WPG).to(tl.float32)
        acc += part * s[:, None]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    out_mask = (offs_n < N)[:, None] & m_mask[None, :]
    if SPLIT == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        local = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        tile_parts = part_ptr + pid_n * (SPLIT * BLOCK_N * BLOCK_M)
        tl.store(tile_parts + pid_k * (BLOCK_N * BLOCK_M) + local, acc)
        tl.debug_barrier()  # every thread's partial stored before the arrival is counted
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT - 1:  # the last program of the tile: sum the splits in order
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for j in tl.static_range(SPLIT):
                total += tl.load(tile_parts + j * (BLOCK_N * BLOCK_M) + local,
                                 cache_modifier=".cg")  # fmt: skip
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)


_counters: dict[tuple[str, int | None], torch.Tensor] = {}


def _arrival_counters(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index)
    if key not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the int4 tensor-core GEMM allocates its split-K counters on first use, which "
                "cannot happen inside a CUDA graph capture: run the model once eagerly before "
                "capturing")
        _counters[key] = torch.zeros(_COUNTER_CAPACITY, device=device, dtype=torch.int32)
    return _counters[key]


def int4_mma_applies(x: torch.Tensor, zeros: torch.Tensor | None, perm: torch.Tensor | None,
                     bits: int, group: int, w_fp8: bool) -> bool:
    """Whether this kernel takes x [M, K] @ W^T for W's format (quant_gemm's arguments): int4
    codes, symmetric, group-wise (32, 64 or 128 dividing K), no act-order permutation, 16-bit x,
    MMA_MIN_M <= M <= MMA_MAX_M."""
    m, k = x.shape
    return (bits == 4 and not w_fp8 and zeros is None and perm is None
            and x.dtype in (torch.bfloat16, torch.float16) and MMA_MIN_M <= m <= MMA_MAX_M
            and group in (32, 64, 128) and k % group == 0)


def int4_mma_tiles(m: int, n: int, kw: int, wpg: int, device: torch.device) -> MmaTiles:
    """From the H100 sweep (results/h100/int4_mma.txt): 64-row tiles up to M = 32, 128 above
    (fewer programs re-reading the larger x tile); K split until the programs cover twice the SMs
    (once above M = 32), keeping at least two groups a split."""
    block_m = max(16, 1 << (m - 1).bit_length())
    block_n = 64 if m <= 32 else 128
    target = (2 if m <= 32 else 1) * num_sms(device)
    tiles, split = -(-n // block_n), 1
    while tiles * split < target and kw // (wpg * split * 2) >= 2:
        split *= 2
    return MmaTiles(block_n, split, block_m)


def int4_mma_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int,
                  smooth: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                  tiles: MmaTiles | None = None) -> torch.Tensor:
    """x [M, K] (contiguous rows, 16-bit) @ dequantized W^T -> [M, N] in ``out_dtype``."""
    m, k = x.shape
    n, kw = qweight.shape
    wpg = group // 8
    assert x.stride(1) == 1 and qweight.stride(1) == 1 and scales.stride(1) == 1
    assert kw * 8 == k and k % group == 0 and scales.shape == (n, k // group)
    tiles = tiles or int4_mma_tiles(m, n, kw, wpg, x.device)
    assert tiles.block_m >= m
    row_tiles = triton.cdiv(n, tiles.block_n)
    assert row_tiles <= _COUNTER_CAPACITY, f"{n} rows: more tiles than the split-K counters"
    groups_per_split = -(-(kw // wpg) // tiles.split)
    out = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    parts = (torch.empty(row_tiles * tiles.split * tiles.block_n * tiles.block_m,
                         device=x.device, dtype=torch.float32) if tiles.split > 1 else out)
    counters = _arrival_counters(x.device) if tiles.split > 1 else out
    _int4_mma_kernel[(row_tiles, tiles.split)](
        x, qweight, scales, smooth if smooth is not None else scales, out, parts, counters,
        m, n, kw, groups_per_split * wpg, x.stride(0), qweight.stride(0), scales.stride(0),
        out.stride(0), WPG=wpg, HAS_SMOOTH=smooth is not None, SPLIT=tiles.split,
        ASM=x.is_cuda, BLOCK_N=tiles.block_n, BLOCK_M=tiles.block_m,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl(x.device),
    )  # fmt: skip
    return out

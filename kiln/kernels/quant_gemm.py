"""Weight-only quantized GEMM with dequantization inside the kernel (W4A16, W8A16, FP8-weight),
and the batch-1 GEMV for dense bf16 weights (``dense_gemv``: bf16 as 16-bit codes, no scale).

    W[n, k] = (u[n, k] - z[n, k // G]) * s[n, k // G]        (FP8 weights: W = f8[n, k] * s[n])
    y[m, n] = sum_k xs[m, k] * W[n, k] + b[n],   xs[m, k] = x[m, perm[k]] * smooth[k]

u are 4-bit codes packed 8 per int32 along K (code k sits at bits 4 (k % 8) of word k // 8) or
8-bit codes (uint8); z is 2^(bits-1) when the format is symmetric; G = K for per-channel scales.
``perm`` (GPTQ act-order) and ``smooth`` (AWQ) are optional per-input-channel gathers/scales.

Three paths, picked by M: for decode batches the word-streaming kernels below read the packed
weights once as int32 words and dequantize in registers (a CUDA-core GEMV up to
GEMV_FMA_MAX_M rows, a tensor-core variant for int4 up to SMALL_M, see _gemv_config); up to
FUSED_MAX_M rows a tensor-core tile kernel; above, one dequantization kernel into a dense
weight followed by cuBLAS (the same math, ``W`` rounded to x.dtype). The stored layout is
kiln/quant's ([N, K / 8] int32 or [N, K] bytes, row-major): no kernel needs a repacked weight.
Symmetric int4 and 8-bit integer codes without act-order at 16-bit x and 3 to
wint_mma.MMA_MAX_M rows (see wint_mma_applies) skip all three for kiln/kernels/wint_mma.py
(codes decoded straight into tensor-core operands: faster than the tile kernel and the
dequantization there), unless the caller forces a config; from wint_ws.WS_MIN_M (32 rows of
8-bit codes, 48 of int4) to WS_MAX_M rows (wint_ws_preferred; past wint_mma's range too:
prefill chunks) the persistent warp-specialized Gluon kernel kiln/kernels/wint_ws.py takes
them instead.
``gated=True`` (Llama's merged gate/up projection) returns silu(gate) * up instead of y: the
CUDA-core GEMV computes it in its epilogue, the dequantize-then-GEMM path through ``linear``
(kiln/kernels/gated_gemm.py at prefill sizes), every other path runs silu_and_mul after. The bias
goes in the word-streaming kernels' epilogue where K is not split, else it is added after.
W8A8 (FP8 / INT8 activations through cuBLAS) lives in ``kiln/quant/w8a8.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.kernels._triton import (
    next_power_of_2,
    num_sms,
    pdl,
    tl,
    triton,
    use_triton,
    wait_for_inputs,
)
from kiln.kernels.activation import silu_and_mul, silu_mul
from kiln.kernels.gated_gemm import gated_gemm_applies, gated_gemm_triton
from kiln.kernels.w4_gemv import w4_gemv, w4_gemv_applies
from kiln.kernels.wint_mma import MmaTiles, wint_mma_applies, wint_mma_gemm
from kiln.kernels.wint_ws import wint_ws_applies, wint_ws_gemm, wint_ws_preferred

FP8_DTYPE = torch.float8_e4m3fn
# above this many rows dequantize-then-cuBLAS beats the fused tile kernel (benchmarks/gpu_quant.py;
# results/h100/fp8_swap_ab.txt, f83d070, int4 over Llama-3.1-8B's qkv, o, gate_up and down: fused
# 357 us against 380 at M = 64, but 622 against 389 at M = 128, once the word-streaming
# dequantization kernel replaced the slower one the earlier int4 threshold of 128 was set with)
FUSED_MAX_M = {4: 64, 8: 64}
SMALL_M = 16  # up to this many rows the word-streaming kernels (_wq_gemv_*) may run: decode
GEMV_FMA_MAX_M = 4  # ... the CUDA-core one up to this many rows; see _gemv_config
DENSE_GEMV_MAX_M = 1  # bf16 rows up to which dense_gemv replaces cuBLAS
# batch-1 symmetric int4 g128 weights of at most this many codes (Llama-3.1-8B's qkv and o_proj,
# not gate_up, down_proj or the head) go to kiln/kernels/w4_gemv.py, whose TMA ring decodes a
# chunk while the next ones land: qkv 6.3 us against 7.0, o_proj 4.1 against 5.1 on an H100.
# This file's GEMV keeps the merged gate_up (w4_gemv 6% faster alone, but the gated form here
# has silu in its epilogue), down_proj (its best w4_gemv tiles only matched this GEMV) and the
# head (benchmarks/results/h100/w4_gemv.txt)
W4_GEMV_MAX_CODES = 1 << 25


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # 1: GEMV (reduce with CUDA cores); >= 16: tensor-core tl.dot
    block_n: int
    block_k: int
    split_k: int = 1  # > 1: float32 partial sums per split, added after (see _output)
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class GemvConfig:
    """The small-M path (M <= SMALL_M): packed weights streamed as int32 words, see below.

    A program owns ``block_n`` output rows and (split_k > 1: a 1/split_k share of) K, walked in
    tiles of ``block_kw`` int32 words per row. ``mma``: tensor cores (tl.dot over ``block_m``
    rows of x, padded to 16) instead of the CUDA-core FMA kernel, which runs one row of x per
    program and ignores ``block_m``.
    """

    block_m: int
    block_n: int
    block_kw: int
    split_k: int = 0  # 0: as few as keep the SMs busy (see _gemv_split)
    num_warps: int = 4
    mma: bool = False
    num_stages: int = 1
    natural: bool = False  # mma: codes joined into input order, one dot per tile


@triton.jit
def _split_slice(out_ptr, pid_k, M, N):
    """Split-K: split pid_k's [M, N] slice of the float32 [split, M, N] output (the slice for
    no split). Slices are summed afterwards in a fixed order, unlike atomic adds, so a result
    never depends on which split finished first."""
    return out_ptr + pid_k.to(tl.int64) * M * N


@triton.jit
def _wint_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, smooth_ptr, out_ptr,
    M, N, K, k_per_split, group_size,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
    BITS: tl.constexpr, W_FP8: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, GROUPS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(USE_PDL)
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
    out_ptrs = _split_slice(out_ptr, pid_k, M, N) + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# ---- M <= SMALL_M: weight streaming over int32 words (the decode path) --------------------------
#
# The packed weight is read as int32 words: a word holds 8 int4 codes or 4 int8 / FP8 codes of
# consecutive input channels (k = PER_WORD w + j for code j of word w). Integer codes are decoded
# with one shift and one and/or into the float f = 1 + u / 2^BITS (u's bits placed in the top
# mantissa bits of 1.0), so that
#     sum_k (u_k - z) s x_k = s (2^BITS sum_k f_k x_k - (2^BITS + z) sum_k x_k),
# where sum_k x_k is shared by all rows: per code a shift, an and/or and one FMA. The FMA kernel
# decodes int4 codes against 16-bit x with three shifts a word instead of eight (_int4_code).
#
# CUDA-core kernel layout (checked in the TTGIR and SASS of Triton 3.6 on the H100 and 3.9: no
# layout conversion, no shared memory inside the K loop of the default [8, 512] tile; 256-word
# and 8-warp tiles do move x through shared memory): a tile is [BLOCK_N rows, BLOCK_KW = 512
# words] and lane l of warp v loads words 4 c .. 4 c + 3 (one 16-byte vector, c = 32 v + l) of
# every row: each warp load reads 512 contiguous bytes of a row. The tile is split in registers
# into 4 planes [BLOCK_N, 128] (word 4 c + a), and x for plane a is one 16-byte load per thread
# of the PER_WORD inputs of word 4 c + a, split in registers into PER_WORD vectors: all of them
# in the layout of the planes, and every x value serves BLOCK_N rows. A thread's 4 words lie in
# one scale group (group sizes are multiples of 4 words), so a group scale is loaded and
# applied once per row per tile.


@triton.jit
def _decode(words, j: tl.constexpr, BITS: tl.constexpr, W_FP8: tl.constexpr, one=0x3F800000):
    """Code j of int32 words as float32: FP8 codes -> their value, integer u -> 1 + u / 2^BITS,
    BITS = 16: bf16 weights -> their value (a bf16 is the top half of its float32).

    ``one``: the bits of 1.0f (0x3F800000), best passed as a run-time value (see the FMA kernel).
    """
    if BITS == 16:
        if j == 0:
            return (words << 16).to(tl.float32, bitcast=True)
        return (words & -65536).to(tl.float32, bitcast=True)  # -65536: 0xFFFF0000 as int32
    if W_FP8:
        byte = ((words >> (8 * j)) & 0xFF).to(tl.int8)
        return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    # move code bits [BITS j, BITS (j + 1)) to mantissa bits [23 - BITS, 23), exponent of 1.0
    if 23 - BITS - BITS * j >= 0:
        t = words << (23 - BITS - BITS * j)
    else:
        t = words >> (BITS * j + BITS - 23)
    return ((t & (((1 << BITS) - 1) << (23 - BITS))) | one).to(tl.float32, bitcast=True)


@triton.jit
def _int4_code(words, j: tl.constexpr, one):
    """Int4 code j of int32 words for the FMA kernel: f = 1 + u 2^(pos - 23) for its mantissa
    position pos = 11 + 4 (j % 3), so that f x w = x w + u x / 16 with w = 2^(19 - pos).

    Codes 0-2, 3-5 and 6-7 share one shift each (to bits 11, 15, 19 of the mantissa): three
    shifts a word instead of _decode's eight, one instruction in eight fewer per code. The low
    positions cost float32 bits of the partial sums (u x / 16 next to up to 256 x: 12 of 24
    left): far below a 16-bit output's rounding, so float32 inputs keep _decode.
    """
    if j < 3:
        t = words << 11
    elif j < 6:
        t = words >> 1
    else:
        t = words >> 13
    return ((t & (15 << (11 + 4 * (j % 3)))) | one).to(tl.float32, bitcast=True)


@triton.jit
def _fma_code(one, p, xs, xn, words, x_row, xj, perm_ptr, smooth_ptr, cols, c_mask,
              j: tl.constexpr, BITS: tl.constexpr, W_FP8: tl.constexpr, HAS_PERM: tl.constexpr,
              HAS_SMOOTH: tl.constexpr, EVEN_K: tl.constexpr, SHIFT3: tl.constexpr):  # fmt: skip
    """p += f_j x_j w_j for code j of ``words`` (its input x_j = xs[PER_WORD cols + j]);
    xs accumulates x_j w_j, xn x_j: sum_j u_j x_j = 2^BITS (p - xs). SHIFT3: int4 codes by
    _int4_code, else by _decode (w_j = 1)."""
    k = cols * (32 // BITS) + j
    if HAS_PERM:  # GPTQ act-order: gather x
        if EVEN_K:
            xj = tl.load(x_row + tl.load(perm_ptr + k))
        else:
            xj = tl.load(x_row + tl.load(perm_ptr + k, mask=c_mask, other=0), mask=c_mask,
                         other=0.0)  # fmt: skip
    if HAS_SMOOTH:  # AWQ: x * smooth, rounded to x's dtype as in the reference
        if EVEN_K:
            sm = tl.load(smooth_ptr + k).to(tl.float32)
        else:
            sm = tl.load(smooth_ptr + k, mask=c_mask, other=0.0).to(tl.float32)
        xj = (xj.to(tl.float32) * sm).to(x_row.dtype.element_ty)
    x = xj.to(tl.float32)
    if SHIFT3:
        xw = x * (1 << (8 - 4 * (j % 3)))  # w_j
        return p + _int4_code(words, j, one) * xw[None, :], xs + xw, xn + x
    return p + _decode(words, j, BITS, W_FP8, one) * x[None, :], xs + x, xn + x


@triton.jit
def _fma_word_plane(one, p, xs, xn, words, x_row, perm_ptr, smooth_ptr, cols, c_mask,
                    BITS: tl.constexpr, W_FP8: tl.constexpr, HAS_PERM: tl.constexpr,
                    HAS_SMOOTH: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_C: tl.constexpr,
                    SHIFT3: tl.constexpr):  # fmt: skip
    """All codes of a plane of words [BLOCK_N, BLOCK_C] (word index ``cols``) against x."""
    if HAS_PERM:  # gathered per code in _fma_code
        z = tl.zeros([BLOCK_C], x_row.dtype.element_ty)
        x0, x1, x2, x3, x4, x5, x6, x7 = z, z, z, z, z, z, z, z
    elif BITS == 4:  # the 8 inputs of each word: one 16-byte load, split in registers
        x_ptrs = x_row + cols[:, None] * 8 + tl.arange(0, 8)[None, :]
        xw = tl.load(x_ptrs) if EVEN_K else tl.load(x_ptrs, mask=c_mask[:, None], other=0.0)
        xe, xo = tl.split(tl.reshape(xw, [BLOCK_C, 4, 2]))
        xe0, xe1 = tl.split(tl.reshape(xe, [BLOCK_C, 2, 2]))
        xo0, xo1 = tl.split(tl.reshape(xo, [BLOCK_C, 2, 2]))
        x0, x4 = tl.split(xe0)
        x2, x6 = tl.split(xe1)
        x1, x5 = tl.split(xo0)
        x3, x7 = tl.split(xo1)
    elif BITS == 8:
        x_ptrs = x_row + cols[:, None] * 4 + tl.arange(0, 4)[None, :]
        xw = tl.load(x_ptrs) if EVEN_K else tl.load(x_ptrs, mask=c_mask[:, None], other=0.0)
        xe, xo = tl.split(tl.reshape(xw, [BLOCK_C, 2, 2]))
        x0, x2 = tl.split(xe)
        x1, x3 = tl.split(xo)
        x4, x5, x6, x7 = x0, x1, x2, x3  # unused
    else:  # 16-bit: two inputs per word
        x_ptrs = x_row + cols[:, None] * 2 + tl.arange(0, 2)[None, :]
        xw = tl.load(x_ptrs) if EVEN_K else tl.load(x_ptrs, mask=c_mask[:, None], other=0.0)
        x0, x1 = tl.split(xw)
        x2, x3, x4, x5, x6, x7 = x0, x1, x0, x1, x0, x1  # unused
    x_codes = (x0, x1, x2, x3, x4, x5, x6, x7)
    for j in tl.static_range(32 // BITS):  # the word's codes, in order
        p, xs, xn = _fma_code(one, p, xs, xn, words, x_row, x_codes[j], perm_ptr, smooth_ptr,
                              cols, c_mask, j, BITS, W_FP8, HAS_PERM, HAS_SMOOTH, EVEN_K,
                              SHIFT3)  # fmt: skip
    return p, xs, xn


@triton.jit
def _load_words(w_rows, cols, live, KW, EVEN_K: tl.constexpr):
    """The int32 words [BLOCK_N, len(cols)] at ``cols`` of every row; none if not ``live`` (a
    scalar: past the program's K range), masked past KW unless EVEN_K."""
    # a uniform mask (one predicate for the tile keeps 16-byte loads), splat into a tensor
    # because the interpreter takes no scalar mask
    tile = tl.full([1, cols.shape[0]], 1, tl.int1) & live
    if EVEN_K:
        return tl.load(w_rows + cols[None, :], mask=tile, other=0)
    return tl.load(w_rows + cols[None, :], mask=tile & (cols < KW)[None, :], other=0)


@triton.jit
def _wq_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, smooth_ptr, bias_ptr, out_ptr,
    M, N, KW, kw_per_split,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
    BITS: tl.constexpr, W_FP8: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, WPG: tl.constexpr, CODE_SCALE: tl.constexpr,
    ZERO_SYM: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, SHIFT3: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """CUDA-core GEMV: y[m, n] for the row m = program_id(0) of x, FMAs in float32.

    GATED: W is a merged [gate; up] projection (N = 2 I rows) and the output is
    silu(y[:, :I]) * y[:, I:] [M, I]. A program takes BLOCK_N / 2 gate rows and the up rows that
    pair with them, so its epilogue holds both halves of each output (no split-K).
    HAS_BIAS (no split-K either): y + b, rounded once, as F.linear's epilogue does.

    WPG: words per scale group (0: one group per row, applied after the K loop). w_ptr is the
    packed weight viewed as int32 [N, KW] (stride_wn in words). Rows of x are programs (their
    weight reads after the first come from L2): 3-D tensors with an M axis made Triton shuffle
    the weights between layouts.

    The words of the next tile are loaded before the current one is multiplied (in registers),
    and those of the first tile before ``wait_for_inputs``: the weights do not depend on the
    previous kernel, so with PDL the program's first loads overlap that kernel's tail instead of
    starting after it, and a program's load and FMA phases overlap instead of taking turns.
    """
    BLOCK_C: tl.constexpr = BLOCK_KW // 4
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_w = tl.arange(0, BLOCK_KW)
    offs_c = tl.arange(0, BLOCK_C) * 4  # first word of each thread's 4
    if GATED:  # tile row 2 i: gate row j = pid_n BLOCK_N / 2 + i; row 2 i + 1: up row I + j
        half = N // 2
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
        rows = tl.minimum(offs_n, half - 1) + (tl.arange(0, BLOCK_N) % 2) * half
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_n, N - 1)  # clamped instead of masked: no predicated loads
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    x_row = x_ptr + pid_m * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_C], tl.float32)
    xacc = tl.zeros([BLOCK_C], tl.float32)  # per-row scales: sum of xs (then of xn)
    nacc = tl.zeros([BLOCK_C], tl.float32)
    # the bits of 1.0f as a run-time value (KW > 0): as an immediate, ptxas re-materializes it
    # before every decode's and/or (about 0.6 more instructions per code)
    one = (KW >> 31) + 0x3F800000
    kw_begin = pid_k * kw_per_split
    kw_end = tl.minimum(kw_begin + kw_per_split, KW)
    packed = _load_words(w_rows, kw_begin + offs_w, kw_begin < kw_end, KW, EVEN_K)
    if HAS_BIAS:  # a weight too: before the wait
        bias = tl.load(bias_ptr + rows).to(tl.float32)
    wait_for_inputs(USE_PDL)
    for kw0 in range(kw_begin, kw_end, BLOCK_KW):
        words = packed
        packed = _load_words(w_rows, kw0 + BLOCK_KW + offs_w, kw0 + BLOCK_KW < kw_end, KW,
                             EVEN_K)  # fmt: skip
        we, wo = tl.split(tl.reshape(words, [BLOCK_N, BLOCK_C, 2, 2]))
        w0, w2 = tl.split(we)
        w1, w3 = tl.split(wo)
        c0 = kw0 + offs_c
        p = tl.zeros([BLOCK_N, BLOCK_C], tl.float32) if WPG > 0 else acc
        xs = tl.zeros([BLOCK_C], tl.float32)
        xn = xs
        p, xs, xn = _fma_word_plane(one, p, xs, xn, w0, x_row, perm_ptr, smooth_ptr,
                                    c0, c0 < KW, BITS, W_FP8, HAS_PERM, HAS_SMOOTH, EVEN_K,
                                    BLOCK_C, SHIFT3)  # fmt: skip
        p, xs, xn = _fma_word_plane(one, p, xs, xn, w1, x_row, perm_ptr, smooth_ptr,
                                    c0 + 1, c0 + 1 < KW, BITS, W_FP8, HAS_PERM, HAS_SMOOTH, EVEN_K,
                                    BLOCK_C, SHIFT3)  # fmt: skip
        p, xs, xn = _fma_word_plane(one, p, xs, xn, w2, x_row, perm_ptr, smooth_ptr,
                                    c0 + 2, c0 + 2 < KW, BITS, W_FP8, HAS_PERM, HAS_SMOOTH, EVEN_K,
                                    BLOCK_C, SHIFT3)  # fmt: skip
        p, xs, xn = _fma_word_plane(one, p, xs, xn, w3, x_row, perm_ptr, smooth_ptr,
                                    c0 + 3, c0 + 3 < KW, BITS, W_FP8, HAS_PERM, HAS_SMOOTH, EVEN_K,
                                    BLOCK_C, SHIFT3)  # fmt: skip
        if WPG > 0:  # scale this tile's partial sums: acc += s (2^BITS (p - xs) - z xn)
            g = tl.minimum(c0, KW - 1) // WPG  # masked columns have p = xs = xn = 0
            s = tl.load(s_ptr + rows[:, None] * stride_sn + g[None, :])
            if HAS_ZEROS:
                z = tl.load(z_ptr + rows[:, None] * stride_zn + g[None, :])
                zx = CODE_SCALE * xs[None, :] + z.to(tl.float32) * xn[None, :]
            else:
                zx = (CODE_SCALE * xs + ZERO_SYM * xn)[None, :]
            acc += (p * CODE_SCALE - zx) * s.to(tl.float32)
        else:
            acc = p
            xacc += xs
            nacc += xn
    if WPG > 0 or BITS == 16:  # group scales already applied; 16-bit: no scale
        y = tl.sum(acc, axis=1)
    elif W_FP8:
        y = tl.sum(acc, axis=1) * tl.load(s_ptr + rows * stride_sn).to(tl.float32)
    else:
        s = tl.load(s_ptr + rows * stride_sn).to(tl.float32)
        zc = tl.load(z_ptr + rows * stride_zn).to(tl.float32) if HAS_ZEROS else ZERO_SYM
        y = s * (CODE_SCALE * (tl.sum(acc, axis=1) - tl.sum(xacc, axis=0))
                 - zc * tl.sum(nacc, axis=0))
    if HAS_BIAS:
        y += bias
    dt = out_ptr.dtype.element_ty
    if GATED:  # gate and up rounded to the output dtype first, as the unfused path stores them
        gate, up = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        y = silu_mul(gate, up, dt)
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        n_mask = offs_n < half
    else:
        n_mask = offs_n < N
    out_ptrs = _split_slice(out_ptr, pid_k, M, N) + pid_m * stride_om + offs_n
    tl.store(out_ptrs, y.to(dt), mask=n_mask)


@triton.jit
def _mma_plane(packed, j: tl.constexpr, a, b, zc, one, BITS: tl.constexpr,
               W_FP8: tl.constexpr, WPG: tl.constexpr, CODE_SCALE: tl.constexpr,
               dt: tl.constexpr):  # fmt: skip
    """W_j = (u - z) s (per-row scales: the exact integer u - z) of code j, in dtype dt."""
    f = _decode(packed, j, BITS, W_FP8, one)
    if W_FP8:
        w = f
    elif WPG > 0:
        w = f * a - b  # f (2^BITS s) - (2^BITS + z) s: exact, as (u - z) s in float32
    else:
        w = f * CODE_SCALE - zc
    return w.to(dt)


@triton.jit
def _mma_x(x_cols, perm_ptr, smooth_ptr, k, k_mask, m_mask, HAS_PERM: tl.constexpr,
           HAS_SMOOTH: tl.constexpr):  # fmt: skip
    """x^T [len(k), BLOCK_M]: xs[m, k] = x[m, perm[k]] * smooth[k] in x's dtype."""
    src = tl.load(perm_ptr + k, mask=k_mask, other=0) if HAS_PERM else k
    xt = tl.load(x_cols + src, mask=k_mask & m_mask[None, :], other=0.0)
    if HAS_SMOOTH:
        sm = tl.load(smooth_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        xt = (xt.to(tl.float32) * sm).to(xt.dtype)
    return xt


@triton.jit
def _wq_gemv_mma_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, smooth_ptr, bias_ptr, out_ptr,
    M, N, KW, kw_per_split,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
    BITS: tl.constexpr, W_FP8: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, WPG: tl.constexpr, CODE_SCALE: tl.constexpr,
    ZERO_SYM: tl.constexpr, EVEN_K: tl.constexpr, NATURAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Tensor-core variant (swap AB): out^T[n, m] += W[n, k] x[m, k]^T.

    W_j = (u - z) s of each code position j is formed in registers (exact integers u - z when
    the scale is per row; it is applied after the K loop) and rounded to x's dtype like the
    dequantized reference. NATURAL: the PER_WORD planes are joined in registers into the
    [BLOCK_N, PER_WORD BLOCK_KW] tile in input order, one dot against a contiguous x tile;
    else one dot per code position against x[:, PER_WORD w + j] (strided loads). HAS_BIAS (no
    split-K): + b before the one rounding.
    """
    wait_for_inputs(USE_PDL)
    PER_WORD: tl.constexpr = 32 // BITS
    dt = x_ptr.dtype.element_ty
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_KW)
    m_mask, n_mask = offs_m < M, offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_cols = x_ptr + offs_m[None, :] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    one = (KW >> 31) + 0x3F800000  # 1.0f as a run-time value: see _wq_gemv_kernel
    zc = 0.0  # per-row zero point (per-channel scales): W_j = f 2^BITS - (2^BITS + z)
    if WPG == 0 and not W_FP8:
        if HAS_ZEROS:
            zc = tl.load(z_ptr + offs_n * stride_zn, mask=n_mask, other=0).to(tl.float32)
            zc = (zc + CODE_SCALE)[:, None]
        else:
            zc = CODE_SCALE + ZERO_SYM
    kw_begin = pid_k * kw_per_split
    for kw0 in range(kw_begin, tl.minimum(kw_begin + kw_per_split, KW), BLOCK_KW):
        cols = kw0 + offs_w
        c_mask = cols < KW
        wk_mask = n_mask[:, None] & c_mask[None, :]
        packed = tl.load(w_rows + cols[None, :], mask=wk_mask, other=0)
        if WPG > 0:
            g = cols // WPG
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + g[None, :], mask=wk_mask, other=0.0)
            s = s.to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(z_ptr + offs_n[:, None] * stride_zn + g[None, :], mask=wk_mask, other=0)
                b = (z.to(tl.float32) + CODE_SCALE) * s
            else:
                b = (CODE_SCALE + ZERO_SYM) * s
            a = s * CODE_SCALE
        else:
            a, b = 0.0, 0.0
        if NATURAL:
            w0 = _mma_plane(packed, 0, a, b, zc, one, BITS, W_FP8, WPG, CODE_SCALE, dt)
            w1 = _mma_plane(packed, 1, a, b, zc, one, BITS, W_FP8, WPG, CODE_SCALE, dt)
            w2 = _mma_plane(packed, 2, a, b, zc, one, BITS, W_FP8, WPG, CODE_SCALE, dt)
            w3 = _mma_plane(packed, 3, a, b, zc, one, BITS, W_FP8, WPG, CODE_SCALE, dt)
            if PER_WORD == 8:
                w4 = _mma_plane(packed, 4, a, b, zc, one, BITS, W_FP8, WPG, CODE_SCALE, dt)
                w5 = _mma_plane(packed, 5, a, b, zc, one, BITS, W_FP8, WPG, CODE_SCALE, dt)
                w6 = _mma_plane(packed, 6, a, b, zc, one, BITS, W_FP8, WPG, CODE_SCALE, dt)
                w7 = _mma_plane(packed, 7, a, b, zc, one, BITS, W_FP8, WPG, CODE_SCALE, dt)
            else:
                w4, w5, w6, w7 = w0, w1, w2, w3  # unused
            w = tl.reshape(_join_codes(w0, w1, w2, w3, w4, w5, w6, w7, PER_WORD),
                           [BLOCK_N, BLOCK_KW * PER_WORD])  # fmt: skip
            k = (kw0 * PER_WORD + tl.arange(0, BLOCK_KW * PER_WORD))[:, None]
            xt = _mma_x(x_cols, perm_ptr, smooth_ptr, k, k < KW * PER_WORD, m_mask, HAS_PERM,
                        HAS_SMOOTH)  # fmt: skip
            if dt == tl.float32:
                acc = tl.dot(w, xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, xt, acc)
        else:
            for j in tl.static_range(PER_WORD):
                w = _mma_plane(packed, j, a, b, zc, one, BITS, W_FP8, WPG, CODE_SCALE, dt)
                k = (cols * PER_WORD + j)[:, None]
                xt = _mma_x(x_cols, perm_ptr, smooth_ptr, k, c_mask[:, None], m_mask, HAS_PERM,
                            HAS_SMOOTH)  # fmt: skip
                if dt == tl.float32:
                    acc = tl.dot(w, xt, acc, input_precision="ieee")
                else:
                    acc = tl.dot(w, xt, acc)
    if WPG == 0:
        s = tl.load(s_ptr + offs_n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc * s[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = _split_slice(out_ptr, pid_k, M, N) + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


@triton.jit
def _join_codes(v0, v1, v2, v3, v4, v5, v6, v7, PER_WORD: tl.constexpr):
    """[..., PER_WORD] with element j = v_j (code j of a word), joined in registers."""
    if PER_WORD == 8:
        e = tl.join(tl.join(v0, v4), tl.join(v2, v6))  # [..., 2, 2]: v_(4 a + 2 b)
        o = tl.join(tl.join(v1, v5), tl.join(v3, v7))
        return tl.join(e, o)  # [..., 2, 2, 2]: v_(4 a + 2 b + c)
    else:
        return tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [..., 2, 2]: v_(2 a + b)


@triton.jit
def _dequant_code(packed, j: tl.constexpr, s, zc, BITS: tl.constexpr, W_FP8: tl.constexpr,
                  CODE_SCALE: tl.constexpr, dt: tl.constexpr):  # fmt: skip
    """(u - z) s (FP8: f s) in float32, rounded to dt: exactly the reference's rounding."""
    f = _decode(packed, j, BITS, W_FP8)
    if W_FP8:
        return (f * s).to(dt)
    return ((f * CODE_SCALE - zc) * s).to(dt)  # f 2^BITS - 2^BITS - z = u - z exactly


@triton.jit
def _wq_dequant_kernel(
    w_ptr, s_ptr, z_ptr, perm_ptr, smooth_ptr, out_ptr,
    N, KW, stride_wn, stride_sn, stride_zn, stride_on,
    BITS: tl.constexpr, W_FP8: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, WPG: tl.constexpr, CODE_SCALE: tl.constexpr,
    ZERO_SYM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Dense W_eff[n, perm[k]] = (u - z) s smooth[k] from the int32 words (16-byte loads); the
    codes of a word are joined in registers so that the stores are contiguous."""
    wait_for_inputs(USE_PDL)  # the store may reuse memory the previous kernel still reads
    PER_WORD: tl.constexpr = 32 // BITS
    dt = out_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.program_id(1) * BLOCK_KW + tl.arange(0, BLOCK_KW)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)[:, None]
    mask = n_mask[:, None] & (offs_w < KW)[None, :]
    packed = tl.load(w_ptr + rows * stride_wn + offs_w[None, :], mask=mask, other=0)
    g = offs_w // WPG if WPG > 0 else offs_w * 0
    s = tl.load(s_ptr + rows * stride_sn + g[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zc = tl.load(z_ptr + rows * stride_zn + g[None, :], mask=mask, other=0)
        zc = zc.to(tl.float32) + CODE_SCALE
    else:
        zc = CODE_SCALE + ZERO_SYM
    v0 = _dequant_code(packed, 0, s, zc, BITS, W_FP8, CODE_SCALE, dt)
    v1 = _dequant_code(packed, 1, s, zc, BITS, W_FP8, CODE_SCALE, dt)
    v2 = _dequant_code(packed, 2, s, zc, BITS, W_FP8, CODE_SCALE, dt)
    v3 = _dequant_code(packed, 3, s, zc, BITS, W_FP8, CODE_SCALE, dt)
    if PER_WORD == 8:
        v4 = _dequant_code(packed, 4, s, zc, BITS, W_FP8, CODE_SCALE, dt)
        v5 = _dequant_code(packed, 5, s, zc, BITS, W_FP8, CODE_SCALE, dt)
        v6 = _dequant_code(packed, 6, s, zc, BITS, W_FP8, CODE_SCALE, dt)
        v7 = _dequant_code(packed, 7, s, zc, BITS, W_FP8, CODE_SCALE, dt)
    else:
        v4, v5, v6, v7 = v0, v1, v2, v3  # unused
    w = tl.reshape(_join_codes(v0, v1, v2, v3, v4, v5, v6, v7, PER_WORD),
                   [BLOCK_N, BLOCK_KW * PER_WORD])  # fmt: skip
    offs_k = tl.program_id(1) * (BLOCK_KW * PER_WORD) + tl.arange(0, BLOCK_KW * PER_WORD)
    k_mask = offs_k < KW * PER_WORD
    if HAS_SMOOTH:  # round W as the fused path does, then apply smooth
        sm = tl.load(smooth_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        w = (w.to(tl.float32) * sm[None, :]).to(dt)
    dst_k = tl.load(perm_ptr + offs_k, mask=k_mask, other=0) if HAS_PERM else offs_k
    tl.store(out_ptr + rows * stride_on + dst_k[None, :], w, mask=n_mask[:, None] & k_mask[None, :])


@triton.jit
def _wint_dequant_kernel(
    w_ptr, s_ptr, z_ptr, perm_ptr, smooth_ptr, out_ptr,
    N, K, group_size, stride_wn, stride_sn, stride_zn, stride_on,
    BITS: tl.constexpr, W_FP8: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(USE_PDL)
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
    """Tiles of the tensor-core tile kernel (M > SMALL_M, and 8-bit codes at M > GEMV_FMA_MAX_M)."""
    if m <= 16:
        cfg = GemmConfig(16, 64, 128, num_warps=4, num_stages=4)
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


def _gemv_config(m: int, n: int, k: int, bits: int) -> GemvConfig | None:
    """Small-M choice (None: the tile kernel), from the H100 run in results/h100/quant_kernels.

    M <= GEMV_FMA_MAX_M: the FMA kernel, [8 or 16 rows, 512 words] tiles (each thread those rows
    x 16 bytes; one x load serves them all): 256-512 programs per row of x at N = 4096, enough
    for 132 SMs without split-K. Rows of x are programs, so its cost grows with M: at M = 2 and
    4 it still beat the alternatives (4096 x 4096: W4 8.7 / 13.9 us vs 20.2 / 20.4 us
    tensor-core word kernel; W8 9.7 / 16.3 us vs 18.1 / 18.3). Above: the tile kernel. The
    ``natural=True`` word-kernel variant has not run on a GPU yet: not a default.
    """
    if m <= 2:
        # batch 1, from the sweep with PDL and the pipelined K loop
        # (results/h100/quant_decode1_sweep.txt): 8-bit codes stream best 4 rows a program at
        # every shape but qkv and the 14336-wide gate (within 1.5 us there), the LM head
        # included (128256 x 4096: 167 us against 176). int4 with _int4_code
        # (results/h100/quant_shift3.txt): 16 rows and all of K = 4096 in one tile at every
        # Llama-3.1-8B shape up to 8192 rows (qkv 7.0 us against 7.5 for the 256-word tiles
        # before; o_proj 5.1 against 5.6), and at down_proj's K = 14336, where _decode runs
        # (14.4 us against 16.5 for 8 rows); wider ones keep 8: the merged gate_up with silu in
        # its epilogue at 16 rows cost the batch-1 decode 1.6% (420.5 tok/s against 427.4), the
        # 14336-wide gate is the same either way, and the LM head (128256 x 4096) streams best
        # at 8 rows (100.6 us against 123 for 16, ab_runs.txt 9). The tiles depend on the shape
        # alone: the gated GEMV gives the plain one's bits followed by silu_and_mul's.
        if bits == 8:
            return GemvConfig(1, 4, 512)
        return GemvConfig(1, 8 if n > 8192 else 16, 512, 1)
    if m <= GEMV_FMA_MAX_M:
        return GemvConfig(1, 16, 512)
    # the tensor-core word kernel (GemvConfig(16, 64, 32, mma=True)) beat the tile kernel for int4
    # at M = 16 by 5-15% in one H100 run, but changed after it; until it is re-timed and checked
    # on a GPU again the tile kernel, which has been, keeps M > GEMV_FMA_MAX_M
    return None


def _gemv_split(cfg: GemvConfig, n: int, kw: int, block_kw: int, device: torch.device) -> int:
    """split_k 0: split K (float32 partials and a kernel to add them) only while N alone leaves
    SMs idle."""
    if cfg.split_k:
        return max(1, min(cfg.split_k, -(-kw // block_kw)))
    tiles, split = -(-n // cfg.block_n), 1
    while tiles * split < num_sms(device) and kw // (block_kw * split * 2) >= 2:
        split *= 2
    return split


def _words(qweight: torch.Tensor, bits: int) -> torch.Tensor | None:
    """The packed weight as int32 words [N, K * bits / 32], or None if it cannot be viewed so."""
    if bits == 4:
        return qweight
    if qweight.shape[1] % 4 or qweight.stride(0) % 4 or qweight.data_ptr() % 4:
        return None
    return qweight.view(torch.int32) if qweight.stride(0) == qweight.shape[1] else None


def _output(m: int, n: int, device: torch.device, split: int,
            dtype: torch.dtype) -> torch.Tensor:
    """The output of a launch: [M, N] in ``dtype``, or with split-K float32 [split, M, N], one
    slice per split (``_reduce_splits`` adds them)."""
    if split > 1:
        return torch.empty(split, m, n, device=device, dtype=torch.float32)
    return torch.empty(m, n, device=device, dtype=dtype)


def _reduce_splits(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[M, N] in ``dtype`` from ``_output``'s buffer: the split slices added in order."""
    return out.sum(0).to(dtype) if out.dim() == 3 else out


def _gemv_launch(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group: int,
    perm: torch.Tensor | None,
    smooth: torch.Tensor | None,
    w_fp8: bool,
    cfg: GemvConfig,
    out_dtype: torch.dtype | None = None,
    gated: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """gated (the FMA kernel only): silu(gate) * up of a merged [gate; up] weight, [M, N / 2].
    bias [N]: added in the kernel's epilogue without split-K (always when gated), else after the
    split slices are summed."""
    m, k = x.shape
    out_dtype = out_dtype or x.dtype
    n, kw = words.shape
    per_word = 32 // bits
    wpg = 0 if group >= k else group // per_word  # scales are looked up per 4 words
    block_kw = max(min(cfg.block_kw, next_power_of_2(kw)), 4)
    assert wpg % 4 == 0, f"group {group}: the kernels need groups of whole 4-word vectors"
    assert not gated or (not cfg.mma and n % 2 == 0 and cfg.block_n % 2 == 0)
    split = 1 if gated else _gemv_split(cfg, n, kw, block_kw, x.device)
    kw_per_split = -(-kw // (split * block_kw)) * block_kw
    bias_in_kernel = bias is not None and split == 1
    out = _output(m, n // 2 if gated else n, x.device, split, out_dtype)
    kernel = _wq_gemv_mma_kernel if cfg.mma else _wq_gemv_kernel
    # int4 codes by _int4_code for 16-bit x where a program's K range is one tile (H100, 16-row
    # tiles: qkv 7.0 us against 7.5, o_proj 5.1 against 5.6, batch-1 int4 decode 430.5 tok/s
    # against 427.4); with a K loop it was slower (down_proj, 4096 x 14336: 18.4 against 14.4
    # us), see benchmarks/results/h100/quant_shift3.txt
    shift3 = (bits == 4 and not w_fp8 and x.dtype != torch.float32 and not cfg.mma
              and kw_per_split <= block_kw)
    block_m = max(cfg.block_m, 16) if cfg.mma else 1  # FMA kernel: one row of x per program
    # rows of x fastest: the programs that share a weight tile run together (L2 hits)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, cfg.block_n), triton.cdiv(kw, kw_per_split))
    kernel[grid](
        x, words, scales, zeros if zeros is not None else scales, perm if perm is not None
        else scales, smooth if smooth is not None else scales,
        bias if bias_in_kernel else scales, out,
        m, n, kw, kw_per_split,
        x.stride(0), words.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0, out.stride(-2),
        BITS=bits, W_FP8=w_fp8, HAS_ZEROS=zeros is not None, HAS_PERM=perm is not None,
        HAS_SMOOTH=smooth is not None, WPG=wpg, CODE_SCALE=float(2**bits),
        ZERO_SYM=float(2 ** (bits - 1)),
        EVEN_K=kw % block_kw == 0 and kw_per_split % block_kw == 0, BLOCK_M=block_m,
        HAS_BIAS=bias_in_kernel,
        **({"NATURAL": cfg.natural} if cfg.mma else {"GATED": gated, "SHIFT3": shift3}),
        BLOCK_N=cfg.block_n, BLOCK_KW=block_kw, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl(x.device),
    )  # fmt: skip
    out = _reduce_splits(out, out_dtype)
    if bias is not None and not bias_in_kernel:
        out += bias
    return out


def dense_gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``dense_gemv`` runs x [M, K] @ weight^T: a CUDA bf16 weight (contiguous rows,
    K a multiple of 8, 16-byte aligned) and at most DENSE_GEMV_MAX_M rows of bf16 x."""
    k = weight.shape[-1]
    return (use_triton(x, weight) and weight.dtype == torch.bfloat16
            and x.dtype == torch.bfloat16 and x.numel() <= DENSE_GEMV_MAX_M * k
            and weight.dim() == 2 and weight.stride() == (k, 1) and k % 8 == 0
            and weight.data_ptr() % 16 == 0)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, config: GemvConfig | None = None,
               gated: bool = False) -> torch.Tensor:
    """y = x W^T (+ b) for a dense bf16 W [N, K] through the word-streaming GEMV: its rows read
    as int32 words of two bf16 each ("16-bit codes", decoded with one shift or and), x [..., K]
    (bf16; float32 runs too, for the interpreter) -> [..., N] in ``out_dtype`` (x's by default).

    At batch 1 it streams the weights faster than cuBLAS' GEMV kernels on an H100, loads them
    before its PDL wait, and keeps the whole decode step in PDL-chained Triton kernels
    (benchmarks/results/h100/quant_decode1_sweep.txt, kind w16).

    gated: W is a merged [gate; up] projection and the result silu(gate) * up [..., N / 2],
    computed in the GEMV's epilogue (after the bias, which the epilogue adds too)."""
    n, k = weight.shape
    assert weight.dtype == torch.bfloat16 and weight.stride() == (k, 1) and k % 8 == 0
    x2 = x.reshape(-1, k).contiguous()  # a no-op for rows already laid out densely
    words = weight.view(torch.int32)  # [N, K / 2]
    cfg = config or _dense_gemv_config(n, k)
    out = _gemv_launch(x2, words, words, None, 16, k, None, None, False, cfg, out_dtype, gated,
                       bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _dense_gemv_config(n: int, k: int) -> GemvConfig:
    """From the H100 sweep (quant_decode1_sweep.txt, kind w16): 1024-word rows in 8 warps, 8 rows
    a program; 16 rows and no split where N = 4096 leaves too few programs otherwise
    (4096 x 4096: 11.1 us against 13.1 for 8 x 512 words; 4096 x 14336: 38.9 against 40.5)."""
    if n <= 4096:
        return GemvConfig(1, 16, 1024, 1, num_warps=8)
    return GemvConfig(1, 8, 1024, num_warps=8)


def _mma_applies(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor | None,
                 perm: torch.Tensor | None, bits: int, group_size: int) -> bool:
    """Whether kiln/kernels/wint_mma.py takes x [M, K] @ W^T (its words viewable as int32)."""
    k = x.shape[1]
    return _words(qweight, bits) is not None and wint_mma_applies(
        x, qweight.shape[0], zeros, perm, bits, k if group_size <= 0 else group_size,
        qweight.dtype == FP8_DTYPE)


def _ws_takes(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor | None, perm: torch.Tensor | None,
              smooth: torch.Tensor | None, bits: int, group_size: int,
              out_dtype: torch.dtype | None) -> bool:
    """Whether kiln/kernels/wint_ws.py takes x [M, K] @ W^T by default: a row count it is
    preferred at (wint_ws_preferred) and a format it decodes (wint_ws_applies)."""
    words = _words(qweight, bits)
    m, k = x.shape
    return (words is not None and zeros is None and perm is None and smooth is None
            and qweight.dtype != FP8_DTYPE
            and wint_ws_preferred(m, bits, (out_dtype or x.dtype).itemsize)
            and wint_ws_applies(x, words, scales, bits, k if group_size <= 0 else group_size,
                                out_dtype=out_dtype))


def wint_gemm_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    perm: torch.Tensor | None = None,
    smooth: torch.Tensor | None = None,
    config: GemmConfig | GemvConfig | MmaTiles | None = None,
    out_dtype: torch.dtype | None = None,
    gated: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused path: x [M, K] (contiguous rows) -> x W^T + b [M, N] in ``out_dtype`` (x.dtype by
    default).

    Where wint_mma applies (or given MmaTiles): kiln/kernels/wint_mma.py; else M <= SMALL_M (or
    a GemvConfig): the word-streaming kernels; else (or a GemmConfig) the tensor-core tile
    kernel. gated: silu(gate) * up [M, N / 2] of a merged [gate; up] weight,
    in the CUDA-core GEMV's epilogue where that kernel runs, else by silu_and_mul after. The
    bias goes in that epilogue too, else it is added after the GEMM (before any silu_and_mul).
    """
    m, k = x.shape
    n = scales.shape[0]
    group = k if group_size <= 0 else group_size
    assert x.stride(1) == 1 and qweight.stride(1) == 1 and scales.stride(1) == 1
    assert qweight.shape == (n, k // 8 if bits == 4 else k), f"qweight {tuple(qweight.shape)}"
    assert scales.shape[1] == -(-k // group), f"scales {tuple(scales.shape)} for group {group}"
    if m == 0:
        return torch.empty(0, n // 2 if gated else n, device=x.device, dtype=out_dtype or x.dtype)
    words = _words(qweight, bits)
    w_fp8 = qweight.dtype == FP8_DTYPE
    ws = config is None and _ws_takes(x, qweight, scales, zeros, perm, smooth, bits,
                                      group_size, out_dtype)
    if ws or isinstance(config, MmaTiles) or config is None and _mma_applies(
            x, qweight, zeros, perm, bits, group_size):
        if ws:
            out = wint_ws_gemm(x, words, scales, bits, group, out_dtype)
        else:
            out = wint_mma_gemm(x, words, scales, bits, group, smooth, out_dtype, config)
        if bias is not None:
            out += bias
        return silu_and_mul(out) if gated else out
    if (config is None and m == 1 and bits == 4 and group == 128 and not gated and zeros is None
            and perm is None and smooth is None and n * k <= W4_GEMV_MAX_CODES
            and w4_gemv_applies(x, words, scales)):
        out = w4_gemv(x, words, scales, out_dtype)
        return out + bias if bias is not None else out
    gemv_ok = words is not None and (group >= k or group % (128 // bits) == 0)
    if config is None and m <= SMALL_M and gemv_ok:
        config = _gemv_config(m, n, k, bits)
    if isinstance(config, GemvConfig) and gemv_ok:
        fuse = gated and not config.mma
        out = _gemv_launch(x, words, scales, zeros, bits, group, perm, smooth, w_fp8, config,
                           out_dtype, fuse, bias)
        return silu_and_mul(out) if gated and not fuse else out
    cfg = config if isinstance(config, GemmConfig) else _default_config(m, n, k, bits, x.device)
    block_k = min(cfg.block_k, next_power_of_2(k))
    if group >= k:  # per channel: every tile lies in group 0
        groups_per_tile = 1
    else:
        assert group % block_k == 0 or block_k % group == 0, "tiles must not straddle groups"
        groups_per_tile = max(block_k // group, 1)
    assert block_k >= 8 and block_k % 8 == 0
    k_per_split = -(-k // (cfg.split_k * block_k)) * block_k
    out_dtype = out_dtype or x.dtype
    out = _output(m, n, x.device, cfg.split_k, out_dtype)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    _wint_gemm_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales, perm if perm is not None
        else scales, smooth if smooth is not None else scales, out,
        m, n, k, k_per_split, group,
        x.stride(0), qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0, out.stride(-2),
        BITS=bits, GROUPS_PER_TILE=groups_per_tile,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_flags(qweight, zeros, perm, smooth),
        **pdl(x.device),
    )  # fmt: skip
    out = _reduce_splits(out, out_dtype)
    if bias is not None:
        out += bias
    return silu_and_mul(out) if gated else out


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
    launch_pdl = pdl(qweight.device)
    words = _words(qweight, bits)
    group = k if group_size <= 0 else group_size
    if words is not None and (group >= k or group % (32 // bits) == 0):
        kw = words.shape[1]
        block_n, block_kw = 16, min(64, next_power_of_2(kw))
        _wq_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(kw, block_kw))](
            words, scales, zeros if zeros is not None else scales, perm if perm is not None
            else scales, smooth if smooth is not None else scales, out,
            n, kw, words.stride(0), scales.stride(0),
            zeros.stride(0) if zeros is not None else 0, out.stride(0),
            BITS=bits, W_FP8=qweight.dtype == FP8_DTYPE, HAS_ZEROS=zeros is not None,
            HAS_PERM=perm is not None, HAS_SMOOTH=smooth is not None,
            WPG=0 if group >= k else group * bits // 32, CODE_SCALE=float(2**bits),
            ZERO_SYM=float(2 ** (bits - 1)), BLOCK_N=block_n, BLOCK_KW=block_kw, num_warps=4,
            **launch_pdl,
        )  # fmt: skip
        return out
    block_n, block_k = 32, 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _wint_dequant_kernel[grid](
        qweight, scales, zeros if zeros is not None else scales, perm if perm is not None
        else scales, smooth if smooth is not None else scales, out,
        n, k, k if group_size <= 0 else group_size, qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0, out.stride(0),
        BITS=bits, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        **_flags(qweight, zeros, perm, smooth), **launch_pdl,
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
    out_dtype: torch.dtype | None = None,
    gated: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """y = x W^T + b for a weight-only quantized W; x [..., K] -> [..., N] in ``out_dtype``
    (x.dtype by default; float32 logits come from the float32 accumulator, unrounded).
    gated: silu(y[..., :N / 2]) * y[..., N / 2:] of a merged [gate; up] projection.
    residual: as ``linear``'s, where the rows take the dequantize + cuBLAS path."""
    if not use_triton(x, qweight, scales):
        out = wint_linear_ref(x, qweight, scales, zeros, bits, group_size, perm, smooth, bias)
        out = out if out_dtype is None else out.to(out_dtype)
        return silu_and_mul(out) if gated else out
    return wint_linear_triton(x, qweight, scales, zeros, bits, group_size, perm, smooth, bias,
                              out_dtype, gated, residual)


def wint_linear_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    perm: torch.Tensor | None = None,
    smooth: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    gated: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``wint_linear`` without the device check: the Triton paths, picked by the rows of x."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if (x2.shape[0] <= FUSED_MAX_M[bits]
            or _mma_applies(x2, qweight, zeros, perm, bits, group_size)
            or _ws_takes(x2, qweight, scales, zeros, perm, smooth, bits, group_size, out_dtype)):
        out = wint_gemm_triton(x2, qweight, scales, zeros, bits, group_size, perm, smooth,
                               out_dtype=out_dtype, gated=gated, bias=bias)
    else:
        w = wint_dequant_triton(qweight, scales, zeros, bits, group_size, x.dtype, perm, smooth)
        out = linear(x2, w, bias, out_dtype, gated, residual)
        if out is None:
            return None
    return out.reshape(*x.shape[:-1], out.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, gated: bool = False,
           residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """F.linear, with a float32 ``out_dtype`` taken from cuBLAS' float32 accumulator on CUDA
    (rounding to x.dtype first would turn near-tie logits into ties). gated: ``weight`` is a
    merged [gate; up] projection and the result silu(gate) * up, from the gated GEMM's epilogue
    where it applies (prefill rows on Hopper).

    residual [..., N]: on CUDA (no bias, x's dtype out, not gated) cuBLAS adds the result into it
    in place in its epilogue (addmm_, beta = 1) and None is returned; else the result, for the
    caller to add. The RMSNorm after then reads the sum alone: two passes over the rows where its
    fused residual add makes four (H100, Llama-3.1-8B o_proj + norm at 16384 rows: 874-894
    against 937-949 us, benchmarks/results/h100/residual_epilogue.txt)."""
    if (residual is not None and x.is_cuda and bias is None and not gated
            and out_dtype in (None, x.dtype)):
        residual.view(-1, residual.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]), weight.t())
        return None
    if gated:
        if out_dtype in (None, x.dtype) and gated_gemm_applies(x, weight, bias):
            return gated_gemm_triton(x.reshape(-1, x.shape[-1]),
                                     weight).reshape(*x.shape[:-1], -1)
        return silu_and_mul(linear(x, weight, bias, out_dtype))
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, weight, bias)
    if not x.is_cuda:
        return F.linear(x, weight, bias).to(out_dtype)
    out = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=out_dtype)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], -1)

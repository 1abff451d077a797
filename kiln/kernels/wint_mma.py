"""Tensor-core weight-only GEMM for decode batches (3..MMA_MAX_M[bits] rows): symmetric int4
codes (group-wise or per channel) and symmetric 8-bit codes (W8A16, per channel).

    y[m, n] = sum_k xs[m, k] (u[n, k] - 2^(b - 1)) s[n, k // G],   xs[m, k] = x[m, k] smooth[k]

Codes are kiln/quant's packing read as int32 words: int4 puts code k at bits 4 (k % 8) of word
k // 8 ([N, K / 8]); 8-bit codes are uint8 [N, K], viewed as [N, K / 4] (code k at bits
8 (k % 4)). A word shifted right by b i holds codes i and i + H (H = 16 / b) at bits 0 and 16,
and a lop3 puts each in the mantissa of one half of a bf16 pair with the exponent of 128 (1024
for fp16); one packed FMA then subtracts the offset, exactly:
  int4:  t = 128 + u,                          u - 8   = t - 136
  8-bit: t = 128 + (u & 127), c = -256 or -128 (u's top bit, a second lop3), u - 128 = t + c
(bf16 holds 8 significant bits, so 128 + u itself would not be exact for 8-bit codes). The
decoded [BLOCK_N, K step] tile goes through tl.dot against x, whose columns are permuted the
same way (a reduction does not care about order). Group-wise scales multiply each group's
float32 result before it joins the accumulator (one group a K step); per-channel scales
multiply the accumulator once at the end.

K is split over ``split`` programs per tile of rows, so that every SM has work when N alone
gives too few tiles; the last program of a tile to finish adds the float32 partials in split
order (the same bits whatever the arrival order) and writes the output, then resets the tile's
arrival counter for the next launch. The counters are one zeroed int32 buffer per device,
allocated on first use (which must not be inside a CUDA graph capture: run once eagerly). Two
launches must not overlap in time on different streams of one device (with PDL, one stream's
next kernel touches the counters only after its wait, when this kernel has finished).

Against the CUDA-core kernels of quant_gemm (H100, Llama-3.1-8B shapes, bf16, g128,
benchmarks/results/h100/int4_mma.txt): int4 qkv + o + gate_up + down take 84 us at M = 16
against 240 for the tile kernel this replaced and 166 for bf16 cuBLAS; 112 at M = 64 against
329 and 169. At M = 1 the FMA GEMV is 1.4-1.7x faster, so it keeps M <= 2. Past 64 rows it
replaced dequantize + cuBLAS, 1.2-2.1x slower (wint_mma.txt: int4 208 us a layer at M = 128
against 389; bf16 cuBLAS 177), up to 256 rows for int4 (wint_mma_tiles.txt) and 128 for 8-bit
codes, which below 65 rows run here only for small weights at up to 32 rows (wint_mma_applies).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.kernels._triton import num_sms, pdl, tl, triton, wait_for_inputs

MMA_MIN_M = 3  # below: the CUDA-core GEMV (quant_gemm) is as fast or faster
# above (per code width): dequantize + cuBLAS, which won every Llama-3.1-8B shape at M = 512
# and, for 8-bit codes, qkv and o_proj at 256 (results/h100/wint_mma_tiles.txt)
MMA_MAX_M = {4: 256, 8: 128}
# 8-bit codes up to 64 rows: here only at up to MMA_W8_SMALL_MAX_M rows and for weights of at most
# MMA_W8_SMALL_MAX_CODES codes (qkv and o_proj of Llama-3.1-8B: 25 and 17 M), else quant_gemm's
# tile kernel (wint_mma_applies)
MMA_W8_SMALL_MAX_M = 32
MMA_W8_SMALL_MAX_CODES = 1 << 25
MIN_STEPS_PER_SPLIT = 8  # K steps a program keeps when K is split (fewer: no further split)
_COUNTER_CAPACITY = 1 << 16  # output tiles (row tiles x x tiles) per launch
_GROUPS = (32, 64, 128)  # group sizes a K step covers (wider ones: per channel only)

# per asm instance: the shifted word in $1 ($2 is the same register), the pair out in $0
_DECODE4_BF16 = tl.constexpr(
    "{ .reg .b32 t, one, off; mov.b32 one, 0x3F803F80; mov.b32 off, 0xC308C308; "
    "lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 $0, t, one, off; }")
_DECODE4_F16 = tl.constexpr(
    "{ .reg .b32 t, one, off; mov.b32 one, 0x3C003C00; mov.b32 off, 0xE408E408; "
    "lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA; fma.rn.f16x2 $0, t, one, off; }")
# 0xEA: (a & b) | c; 0x6A: (a & b) ^ c (the top bit set turns -256 / -1152 into -128 / -1024)
_DECODE8_BF16 = tl.constexpr(
    "{ .reg .b32 t, c, one; mov.b32 one, 0x3F803F80; "
    "lop3.b32 t, $1, 0x007F007F, 0x43004300, 0xEA; lop3.b32 c, $1, 0x00800080, 0xC380C380, 0x6A; "
    "fma.rn.bf16x2 $0, t, one, c; }")
_DECODE8_F16 = tl.constexpr(
    "{ .reg .b32 t, c, one; mov.b32 one, 0x3C003C00; "
    "lop3.b32 t, $1, 0x007F007F, 0x64006400, 0xEA; lop3.b32 c, $1, 0x00800080, 0xE480E480, 0x6A; "
    "fma.rn.f16x2 $0, t, one, c; }")


@dataclass(frozen=True)
class MmaTiles:
    block_n: int  # rows of W per program (the dot's M: 64 or 128)
    split: int  # programs sharing a tile's K; 0: as many as _split picks
    block_m: int  # rows of x a program takes (a power of two >= 16; more rows: more x tiles)
    num_warps: int = 4
    num_stages: int = 3
    k_step: int = 128  # codes of K per step with per-channel scales (group-wise: the group)


@triton.jit
def _code_pairs(shifted, BITS: tl.constexpr, ASM: tl.constexpr, dtype: tl.constexpr):
    """shifted [..., H] (a word >> BITS i) -> [..., H, 2] in dtype: the codes i and i + H of the
    word, less 2^(BITS - 1)."""
    if ASM:  # nested ifs: each folds at compile time, so one branch's type is all there is
        pair = tl.join(shifted, shifted)  # (inline asm takes literal dtypes, not a constexpr one)
        if dtype == tl.bfloat16:
            asm: tl.constexpr = _DECODE4_BF16 if BITS == 4 else _DECODE8_BF16
            return tl.inline_asm_elementwise(asm, "=r,r,r", [pair], dtype=tl.bfloat16,
                                             is_pure=True, pack=2)
        else:
            asm: tl.constexpr = _DECODE4_F16 if BITS == 4 else _DECODE8_F16
            return tl.inline_asm_elementwise(asm, "=r,r,r", [pair], dtype=tl.float16,
                                             is_pure=True, pack=2)
    # the interpreter runs no PTX: the same values with integer ops
    mask: tl.constexpr = (1 << BITS) - 1
    zero: tl.constexpr = 1 << (BITS - 1)
    lo = (shifted & mask) - zero
    hi = ((shifted >> 16) & mask) - zero
    return tl.join(lo, hi).to(tl.float32).to(dtype)


@triton.jit
def _wint_mma_kernel(
    x_ptr, w_ptr, s_ptr, smooth_ptr, out_ptr, part_ptr, count_ptr,
    M, N, KW, kw_per_split, stride_xm, stride_wn, stride_sn, stride_om,
    BITS: tl.constexpr, STEP_W: tl.constexpr, GROUPED: tl.constexpr, HAS_SMOOTH: tl.constexpr,
    SPLIT: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """out^T [BLOCK_N, BLOCK_M] of one (row tile, x tile) over 1/SPLIT of K, STEP_W words a row
    per step: acc += W_codes [BLOCK_N, BK] @ x^T [BK, BLOCK_M], times the step's scale group if
    GROUPED, else the row's scale at the end. x tiles are the fastest grid axis, so the programs
    that share a weight tile run together and read it from HBM once."""
    CPW: tl.constexpr = 32 // BITS  # codes per word
    H: tl.constexpr = CPW // 2
    BK: tl.constexpr = STEP_W * CPW
    dt = x_ptr.dtype.element_ty
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)  # clamped, not masked: unpredicated loads
    offs_w = tl.arange(0, STEP_W)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    shifts = tl.arange(0, H) * BITS
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    kw_begin = pid_k * kw_per_split
    wait_for_inputs(USE_PDL)
    for kw0 in range(kw_begin, tl.minimum(kw_begin + kw_per_split, KW), STEP_W):
        words = tl.load(w_rows + (kw0 + offs_w)[None, :])  # [BLOCK_N, STEP_W]
        w = _code_pairs(words[:, :, None] >> shifts[None, None, :], BITS, ASM, dt)
        w = tl.reshape(w, [BLOCK_N, BK])  # column CPW c + 2 i + h holds code CPW c + i + H h
        k = kw0 * CPW + tl.arange(0, BK)
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0)  # [BLOCK_M, BK]
        if HAS_SMOOTH:  # AWQ: x * smooth, rounded to x's dtype as in the reference
            x = (x.to(tl.float32) * tl.load(smooth_ptr + k).to(tl.float32)[None, :]).to(dt)
        x = tl.permute(tl.reshape(x, [BLOCK_M, STEP_W, 2, H]), (0, 1, 3, 2))  # the codes' order
        xt = tl.trans(tl.reshape(x, [BLOCK_M, BK]))
        if GROUPED:
            s = tl.load(s_ptr + rows * stride_sn + kw0 // STEP_W).to(tl.float32)
            acc += tl.dot(w, xt) * s[:, None]
        else:
            acc = tl.dot(w, xt, acc)
    if not GROUPED:
        acc = acc * tl.load(s_ptr + rows * stride_sn).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    out_mask = (offs_n < N)[:, None] & m_mask[None, :]
    if SPLIT == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = pid_n * tl.num_programs(0) + pid_m
        local = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tile_parts = part_ptr + tile.to(tl.int64) * (SPLIT * BLOCK_N * BLOCK_M)
        tl.store(tile_parts + pid_k * (BLOCK_N * BLOCK_M) + local, acc)
        tl.debug_barrier()  # every thread's partial stored before the arrival is counted
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT - 1:  # the last program of the tile: sum the splits in order
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for j in tl.static_range(SPLIT):
                total += tl.load(tile_parts + j * (BLOCK_N * BLOCK_M) + local,
                                 cache_modifier=".cg")  # fmt: skip
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0)


_counters: dict[tuple[str, int | None], torch.Tensor] = {}


def _arrival_counters(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index)
    if key not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the tensor-core weight-only GEMM allocates its split-K counters on first use, "
                "which cannot happen inside a CUDA graph capture: run the model once eagerly "
                "before capturing")
        _counters[key] = torch.zeros(_COUNTER_CAPACITY, device=device, dtype=torch.int32)
    return _counters[key]


def _per_channel_step(k: int) -> int | None:
    """Codes of K per step with per-channel scales: 64 (the H100 sweep's best for 8-bit codes
    at 4-64 rows, results/h100/wint_mma.txt), else 32 where 64 does not divide K."""
    return next((step for step in (64, 32) if k % step == 0), None)


def wint_mma_applies(x: torch.Tensor, n: int, zeros: torch.Tensor | None,
                     perm: torch.Tensor | None, bits: int, group: int, w_fp8: bool) -> bool:
    """Whether this kernel takes x [M, K] @ W^T for W's format (quant_gemm's arguments, W [N, K]
    as int32 words): symmetric int4 or 8-bit integer codes, group-wise (32, 64 or 128 dividing
    K) or per channel (K a multiple of 32), no act-order permutation, 16-bit x, MMA_MIN_M <= M
    <= MMA_MAX_M[bits]; 8-bit codes at up to 64 rows only at 3..MMA_W8_SMALL_MAX_M rows of
    weights of at most MMA_W8_SMALL_MAX_CODES codes. There the H100 sweeps
    (results/h100/wint_mma.txt, wint_mma_tiles.txt) have this kernel faster than quant_gemm's
    tile kernel at qkv and o_proj (M = 16: 16.5 / 16.2 us against 18.8 / 16.5; M = 32: 18.1 /
    16.3 against 24.5 / 19.3) and slower at down_proj (36.8-44.9 against 32.5) and the W8 LM
    head (288 against 209): the int8 preset decoded 7% slower at batch 16 with every 8-bit
    layer here, 2.4-2.6% faster at batch 16 and 32 with qkv and o_proj. At 33-64 rows qkv and
    o_proj are faster here alone (25.7 / 17.8 against 26.1 / 21.0 at M = 64), but the int8
    preset decoded 1-1.7% slower at batch 64 with them here, in three A/B runs: the time of this
    kernel alone in a graph of itself misjudges its time between the engine's kernels
    (wint_mma_tiles.txt 7. and 8.; why is not known), so its dispatch follows engine runs."""
    m, k = x.shape
    grouping = group in _GROUPS and k % group == 0 or group >= k and _per_channel_step(k)
    w8_small = m <= MMA_W8_SMALL_MAX_M and n * k <= MMA_W8_SMALL_MAX_CODES
    if bits not in MMA_MAX_M or bits == 8 and m <= 64 and not w8_small:
        return False
    return (not w_fp8 and zeros is None and perm is None and bool(grouping)
            and x.dtype in (torch.bfloat16, torch.float16) and MMA_MIN_M <= m <= MMA_MAX_M[bits])


def wint_mma_tiles(m: int, n: int, k: int, group: int, bits: int,
                   device: torch.device) -> MmaTiles:
    """From the H100 sweeps (results/h100/int4_mma.txt, wint_mma.txt, wint_mma_tiles.txt):
    - up to 32 rows: one x tile of 16 / 32 rows against 64 rows of W;
    - int4 past 32 rows, and 8-bit codes at 33-64: 128 rows of W against x tiles of 64 rows
      (fewer programs re-reading x than with 64-row W tiles; at 65-256 rows of int4 faster than
      one 128-row x tile: merged gate_up 92 us against 102 at M = 128, 180 against 196 at 256);
    - 8-bit codes at 65-128 rows: one 128-row x tile (W decoded once for all of them), against
      64 rows of W, or 128 in 8 warps where 64-row tiles would be more than three a SM (gate_up:
      W8 113 us against 149 with int4's tiles).
    K split by _split."""
    block_m = max(16, 1 << (m - 1).bit_length())
    k_step = group if group < k else _per_channel_step(k)
    if block_m <= 32:
        return MmaTiles(64, 0, block_m, k_step=k_step)
    if bits == 4 or block_m == 64:
        return MmaTiles(128, 0, 64, k_step=k_step)
    if -(-n // 64) > 3 * num_sms(device):
        return MmaTiles(128, 0, 128, num_warps=8, k_step=k_step)
    return MmaTiles(64, 0, 128, k_step=k_step)


def _split(tiles: MmaTiles, out_tiles: int, steps: int, device: torch.device) -> int:
    """K split until the programs cover twice the SMs (once above 32 rows of x), keeping at
    least MIN_STEPS_PER_SPLIT steps a split (int4 o_proj at M = 64: 4 splits of 8 steps,
    14.1 us, against 8 splits of 4, 17.3; down_proj's 112 steps still split 8 ways). Counted in
    codes instead (8-bit codes' o_proj at up to 32 rows in 4 splits: 13.6 us alone against 16.2
    in 8) it made the int8 preset decode 2-4% slower (results/h100/wint_mma_tiles.txt, 7.)."""
    target = (2 if tiles.block_m <= 32 else 1) * num_sms(device)
    split = 1
    while out_tiles * split < target and steps // (split * 2) >= MIN_STEPS_PER_SPLIT:
        split *= 2
    return split


def wint_mma_gemm(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, bits: int,
                  group: int, smooth: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None,
                  tiles: MmaTiles | None = None) -> torch.Tensor:
    """x [M, K] (contiguous rows, 16-bit) @ dequantized W^T -> [M, N] in ``out_dtype``; W's
    codes as int32 words [N, K bits / 32], scales [N, K / group] (group >= K: per channel)."""
    m, k = x.shape
    n, kw = words.shape
    cpw = 32 // bits
    grouped = group < k
    assert words.dtype == torch.int32 and kw * cpw == k
    assert x.stride(1) == 1 and words.stride(1) == 1 and scales.stride(1) == 1
    assert scales.shape == (n, k // group if grouped else 1)
    tiles = tiles or wint_mma_tiles(m, n, k, group, bits, x.device)
    k_step = group if grouped else tiles.k_step
    assert k % k_step == 0 and k_step % cpw == 0
    x_tiles, row_tiles = triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n)
    assert x_tiles * row_tiles <= _COUNTER_CAPACITY, \
        f"{m} x {n}: more output tiles than the split-K counters"
    step_w = k_step // cpw
    split = tiles.split or _split(tiles, x_tiles * row_tiles, k // k_step, x.device)
    steps_per_split = -(-(kw // step_w) // split)
    out = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    parts = (torch.empty(x_tiles * row_tiles * split * tiles.block_n * tiles.block_m,
                         device=x.device, dtype=torch.float32) if split > 1 else out)
    counters = _arrival_counters(x.device) if split > 1 else out
    _wint_mma_kernel[(x_tiles, row_tiles, split)](
        x, words, scales, smooth if smooth is not None else scales, out, parts, counters,
        m, n, kw, steps_per_split * step_w, x.stride(0), words.stride(0), scales.stride(0),
        out.stride(0), BITS=bits, STEP_W=step_w, GROUPED=grouped,
        HAS_SMOOTH=smooth is not None, SPLIT=split, ASM=x.is_cuda,
        BLOCK_N=tiles.block_n, BLOCK_M=tiles.block_m,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl(x.device),
    )  # fmt: skip
    return out

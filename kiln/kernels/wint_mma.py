"""Tensor-core weight-only GEMM for decode batches (3..MMA_MAX_M[bits] rows): symmetric int4
codes (group-wise or per channel) and symmetric 8-bit codes (W8A16, per channel).

    y[m, n] = sum_k xs[m, k] (u[n, k] - 2^(b - 1)) s[n, k // G],   xs[m, k] = x[m, k] smooth[k]

Codes are kiln/quant's packing read as int32 words: int4 puts code k at bits 4 (k % 8) of word
k // 8 ([N, K / 8]); 8-bit codes are uint8 [N, K], viewed as [N, K / 4] (code k at bits
8 (k % 4)). A prmt puts codes 2 i and 2 i + 1 of a word in the low bits of bytes 0 and 2 (for
int4 from bytes i of the word and of the word >> 4), and a lop3 puts each in the mantissa of one
half of a bf16 pair with the exponent of 128 (1024 for fp16); one packed FMA then subtracts the
offset, exactly:
  int4:  t = 128 + u,                          u - 8   = t - 136
  8-bit: t = 128 + (u & 127), c = -256 or -128 (u's top bit, a second lop3), u - 128 = t + c
(bf16 holds 8 significant bits, so 128 + u itself would not be exact for 8-bit codes). The
decoded [BLOCK_N, K step] tile is in K order, so tl.dot takes x^T [K step, BLOCK_M] as loaded:
Triton stages it through shared memory with cp.async, and a dot whose operands come from those
staging buffers and that accumulates in place stays in flight while the next step decodes
(wgmma waits with pendings > 0). Group-wise scales (one group a K step) therefore multiply the
decoded weights (rounded to x's dtype, as the dequantized reference's) once x tiles are larger
than 32 rows; up to 32 rows, where that would be 2-4 multiplies per output element, they
multiply each group's float32 dot result instead, and the dot is waited on every step.
Per-channel scales multiply the accumulator once at the end. (Decoding codes i and i + 16 / b
and permuting x's columns to match, as this kernel did before, put x through registers and kept
every dot synchronous: results/h100/wint_mma_natural.txt.)

K is split over ``split`` programs per tile of rows, so that every SM has work when N alone
gives too few tiles; the last program of a tile to finish adds the float32 partials in split
order (the same bits whatever the arrival order) and writes the output, then resets the tile's
arrival counter for the next launch. The counters are one zeroed int32 buffer per device,
allocated on first use (which must not be inside a CUDA graph capture: run once eagerly). Two
launches must not overlap in time on different streams of one device (with PDL, one stream's
next kernel touches the counters only after its wait, when this kernel has finished).

H100, Llama-3.1-8B shapes, bf16, qkv + o + gate_up + down, each GEMM alone in a graph over
rotating weight copies (results/h100/wint_mma_natural.txt): int4 g128 at M = 16 / 64 / 128 /
256 takes 78 / 108 / 163 / 245 us a layer (bf16 cuBLAS 173 / 172 / 180 / 199; before this form
83 / 119 / 197 / 353), 8-bit codes at 64 / 128 rows 153 / 182 (196 / 246 before). Past that
(results/h100/wint_mma_large_m.txt), against dequantize + cuBLAS: int4 at 512 / 1024 rows 436 /
798 us against 516 / 823 (bf16 300 / 579), 8-bit codes at 256 / 512 rows 271 / 486 against 447 /
538 (bf16 204 / 300). Without row masks where every x tile is full (results/h100/
wint_mma_even_m.txt), int4 at 256 / 512 rows takes 231 / 407 us and 8-bit codes 261 / 456 (bf16
204 / 297), and M just past whole x tiles (wint_mma_gemm's two launches) int4 at 264 / 300 rows
333 / 348 against 402 / 405 (bf16 220 / 231). W's rows past whole waves of 256-row x tiles in
64-row tiles (_launch) take int4 / 8-bit codes at 512 rows from 413 / 482 to 396 / 461 us
(results/h100/wint_mma_w_tail.txt). At M = 1 the FMA GEMV is 1.4-1.7x faster, so it
keeps M <= 2; past MMA_MAX_M rows dequantize + cuBLAS is faster. 8-bit codes at up to 32 rows
run here only for small weights (wint_mma_applies).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kiln.kernels._triton import HAS_TRITON, num_sms, pdl, tl, triton, wait_for_inputs

MMA_MIN_M = 3  # below: the CUDA-core GEMV (quant_gemm) is as fast or faster
# above (per code width): dequantize + cuBLAS, faster over a Llama-3.1-8B layer from 2048 rows
# for int4 and 1024 for 8-bit codes (results/h100/wint_mma_large_m.txt)
MMA_MAX_M = {4: 1024, 8: 512}
MMA_X_TILE_MAX = 256  # rows of x a program takes at most; more rows: more x tiles
# 8-bit codes at up to MMA_W8_SMALL_MAX_M rows: here only for weights of at most
# MMA_W8_SMALL_MAX_CODES codes (qkv and o_proj of Llama-3.1-8B: 25 and 17 M), else quant_gemm's
# tile kernel (wint_mma_applies)
MMA_W8_SMALL_MAX_M = 32
MMA_W8_SMALL_MAX_CODES = 1 << 25
MIN_STEPS_PER_SPLIT = 8  # K steps a program keeps when K is split (fewer: no further split)
COUNTER_CAPACITY = 1 << 16  # output tiles (row tiles x x tiles) per launch
_GROUPS = (32, 64, 128)  # group sizes a K step covers (wider ones: per channel only)

# per asm instance: a word in $1 ($2 is the same register), a second word in $3 ($4), the prmt
# selector of the pair in $5 ($6), the pair out in $0. The prmt puts the pair's codes in the low
# bits of bytes 0 and 2: for int4 byte i of the word and byte i of the word >> 4 (codes 2 i and
# 2 i + 1), for 8-bit codes bytes 2 i and 2 i + 1 of the word (the second word unused).
DECODE4_BF16 = tl.constexpr(
    "{ .reg .b32 t, one, off; mov.b32 one, 0x3F803F80; mov.b32 off, 0xC308C308; "
    "prmt.b32 t, $1, $3, $5; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; "
    "fma.rn.bf16x2 $0, t, one, off; }")
DECODE4_F16 = tl.constexpr(
    "{ .reg .b32 t, one, off; mov.b32 one, 0x3C003C00; mov.b32 off, 0xE408E408; "
    "prmt.b32 t, $1, $3, $5; lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA; "
    "fma.rn.f16x2 $0, t, one, off; }")
# 0xEA: (a & b) | c; 0x6A: (a & b) ^ c (the top bit set turns -256 / -1152 into -128 / -1024)
DECODE8_BF16 = tl.constexpr(
    "{ .reg .b32 p, t, c, one; mov.b32 one, 0x3F803F80; prmt.b32 p, $1, $3, $5; "
    "lop3.b32 t, p, 0x007F007F, 0x43004300, 0xEA; lop3.b32 c, p, 0x00800080, 0xC380C380, 0x6A; "
    "fma.rn.bf16x2 $0, t, one, c; }")
DECODE8_F16 = tl.constexpr(
    "{ .reg .b32 p, t, c, one; mov.b32 one, 0x3C003C00; prmt.b32 p, $1, $3, $5; "
    "lop3.b32 t, p, 0x007F007F, 0x64006400, 0xEA; lop3.b32 c, p, 0x00800080, 0xE480E480, 0x6A; "
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
def _code_pairs(words, BITS: tl.constexpr, H: tl.constexpr, ASM: tl.constexpr,
                dtype: tl.constexpr):
    """words [..., 1] -> [..., H, 2] in dtype: codes 2 i and 2 i + 1 of each word at [..., i, :]
    (the word's codes in order), less 2^(BITS - 1)."""
    pair = tl.arange(0, H)
    if ASM:  # nested ifs: each folds at compile time, so one branch's type is all there is
        # prmt selector of bytes 0 and 2 (0..3: the first word's bytes, 4..7: the second's)
        if BITS == 4:
            second = words >> 4  # once a word, before the broadcast over its pairs
            sel = pair * 0x101 + 0x400
        else:
            second = words
            sel = pair * 0x202 + 0x100
        # (the asm broadcasts its arguments: words and second [..., 1, 2], sel [H, 2])
        args = [tl.join(words, words), tl.join(second, second), tl.join(sel, sel)]
        if dtype == tl.bfloat16:  # (inline asm takes literal dtypes, not a constexpr one)
            asm: tl.constexpr = DECODE4_BF16 if BITS == 4 else DECODE8_BF16
            return tl.inline_asm_elementwise(asm, "=r,r,r,r,r,r,r", args, dtype=tl.bfloat16,
                                             is_pure=True, pack=2)
        else:
            asm: tl.constexpr = DECODE4_F16 if BITS == 4 else DECODE8_F16
            return tl.inline_asm_elementwise(asm, "=r,r,r,r,r,r,r", args, dtype=tl.float16,
                                             is_pure=True, pack=2)
    # the interpreter runs no PTX: the same values with integer ops
    mask: tl.constexpr = (1 << BITS) - 1
    zero: tl.constexpr = 1 << (BITS - 1)
    lo = ((words >> (2 * BITS * pair)) & mask) - zero
    hi = ((words >> (2 * BITS * pair + BITS)) & mask) - zero
    return tl.join(lo, hi).to(tl.float32).to(dtype)


@triton.jit
def _retire(acc, RETIRE: tl.constexpr):
    """RETIRE: acc through an identity the pipeliner cannot see through, so that Triton waits for
    the step's wgmmas (wait_group 0) before the next step decodes into registers they may still
    read (retire_each_step says why)."""
    if RETIRE:
        acc = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32,
                                        is_pure=True, pack=1)
    return acc


@triton.jit
def _wint_mma_kernel(
    x_ptr, w_ptr, s_ptr, smooth_ptr, out_ptr, part_ptr, count_ptr,
    M, N, KW, kw_per_split, stride_xm, stride_wn, stride_sn, stride_om,
    BITS: tl.constexpr, STEP_W: tl.constexpr, GROUPED: tl.constexpr, HAS_SMOOTH: tl.constexpr,
    SPLIT: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, EVEN_M: tl.constexpr, RETIRE: tl.constexpr, USE_PDL: tl.constexpr,
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
    xt_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if SPLIT == 1:  # K from a constant 0: int4 gate_up at 128 rows 74.5 -> 67.7 us
        # (results/h100/wint_mma_start0.txt)
        kw_begin, kw_end = 0, KW
    else:
        kw_begin = pid_k * kw_per_split
        kw_end = tl.minimum(kw_begin + kw_per_split, KW)
    wait_for_inputs(USE_PDL)
    for kw0 in range(kw_begin, kw_end, STEP_W):
        words = tl.load(w_rows + (kw0 + offs_w)[None, :])  # [BLOCK_N, STEP_W]
        w = tl.reshape(_code_pairs(words[:, :, None], BITS, H, ASM, dt), [BLOCK_N, BK])
        k = kw0 * CPW + tl.arange(0, BK)
        if EVEN_M:  # every x tile full: no row mask (44 of the loop's 358 instructions at
            xt = tl.load(xt_cols + k[:, None])  # 256-row tiles; int4 at 512 rows 6% faster)
        else:  # masked: rows clamped to M - 1 instead made ragged M 1.2-1.8x slower, every
            # padding row of a tile reading that one row (results/h100/wint_mma_even_m.txt)
            xt = tl.load(xt_cols + k[:, None], mask=m_mask[None, :], other=0.0)  # [BK, BLOCK_M]
        if HAS_SMOOTH:  # AWQ: x * smooth, rounded to x's dtype as in the reference
            xt = (xt.to(tl.float32) * tl.load(smooth_ptr + k).to(tl.float32)[:, None]).to(dt)
        if not GROUPED:
            acc = _retire(tl.dot(w, xt, acc), RETIRE)
        elif BLOCK_M <= 32:  # a multiply per output: 1/4 of folding's at 16 rows
            s = tl.load(s_ptr + rows * stride_sn + kw0 // STEP_W).to(tl.float32)
            acc += tl.dot(w, xt) * s[:, None]  # (the MMA waited on every step)
        else:  # scales folded into the weight (rounded to dt as the dequantized reference's);
            # the MMA accumulates in place and, unless RETIRE, runs on while the next step decodes
            s = tl.load(s_ptr + rows * stride_sn + kw0 // STEP_W)
            acc = _retire(tl.dot(w * s[:, None], xt, acc), RETIRE)
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


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K arrival counters (COUNTER_CAPACITY zeroed int32, one an output tile,
    each back to zero when its launch ends), shared by this kernel and wint_ws.py's: launches
    on one stream run one after the other."""
    key = (device.type, device.index)
    if key not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the tensor-core weight-only GEMM allocates its split-K counters on first use, "
                "which cannot happen inside a CUDA graph capture: run the model once eagerly "
                "before capturing")
        _counters[key] = torch.zeros(COUNTER_CAPACITY, device=device, dtype=torch.int32)
    return _counters[key]


def _per_channel_step(k: int) -> int | None:
    """Codes of K per step with per-channel scales: 64 (the H100 sweep's best for 8-bit codes
    at 4-64 rows, results/h100/wint_mma.txt), else 32 where 64 does not divide K."""
    return next((step for step in (64, 32) if k % step == 0), None)


# Triton before 3.9 (3.6 beside torch 2.11 on the H100 machine) pipelines a dot whose A operand is
# in registers with waits that retire only the oldest wgmma, so the next step's decode writes
# registers that wgmmas still in flight read (triton-lang/triton#9433). Triton 3.9's SASS of the
# same tiles has no such write (benchmarks/sm90_compile.py's wgmma_hazards).
_RS_WGMMA_HAZARD = HAS_TRITON and tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9)


def retire_each_step(tiles: MmaTiles) -> bool:
    """Whether the kernel waits for each step's wgmmas before the next step decodes: under
    Triton < 3.9, for the tiles whose SASS writes an in-flight wgmma's registers there (8 warps;
    4 warps over 16/32-row x tiles with per-channel scales; not the 8-bit 64-row x tiles in 4
    warps). Without the wait, the int8 engine's LM head at 128 rows gave logits up to 10 off,
    run to run, in CUDA graphs with PDL; with it, layers at 64-256 rows take up to 28% longer
    (results/h100/wint_mma_rs_hazard.txt)."""
    return _RS_WGMMA_HAZARD and (tiles.num_warps == 8 or tiles.block_m < 64)


def wint_mma_applies(x: torch.Tensor, n: int, zeros: torch.Tensor | None,
                     perm: torch.Tensor | None, bits: int, group: int, w_fp8: bool) -> bool:
    """Whether this kernel takes x [M, K] @ W^T for W's format (quant_gemm's arguments, W [N, K]
    as int32 words): symmetric int4 or 8-bit integer codes, group-wise (32, 64 or 128 dividing
    K) or per channel (K a multiple of 32), no act-order permutation, 16-bit x, MMA_MIN_M <= M
    <= MMA_MAX_M[bits]; 8-bit codes at up to MMA_W8_SMALL_MAX_M rows only for weights of at most
    MMA_W8_SMALL_MAX_CODES codes: with gate_up, down_proj and the 8-bit LM head here too, the
    int8 preset decoded 7% slower at batch 16 (3,065 against 3,289 tok/s; the LM head 291 us a
    step against 200 on quant_gemm's tile kernel: results/h100/wint_mma_natural.txt)."""
    m, k = x.shape
    grouping = group in _GROUPS and k % group == 0 or group >= k and _per_channel_step(k)
    if _w8_small_m_lags(m, n, k, bits):
        return False
    return (bits in MMA_MAX_M and not w_fp8 and zeros is None and perm is None
            and bool(grouping) and x.dtype in (torch.bfloat16, torch.float16)
            and MMA_MIN_M <= m <= MMA_MAX_M[bits])


def _w8_small_m_lags(m: int, n: int, k: int, bits: int) -> bool:
    """8-bit codes at up to MMA_W8_SMALL_MAX_M rows of a weight of more than
    MMA_W8_SMALL_MAX_CODES codes, where quant_gemm's tile kernel is faster."""
    return bits == 8 and m <= MMA_W8_SMALL_MAX_M and n * k > MMA_W8_SMALL_MAX_CODES


def wint_mma_tiles(m: int, n: int, k: int, group: int, bits: int,
                   device: torch.device) -> MmaTiles:
    """x tiles of the next power of two >= M rows (16..MMA_X_TILE_MAX). From the H100 sweeps
    (results/h100/wint_mma_natural.txt, wint_mma_large_m.txt) and engine runs:
    - up to 32 rows: 64 rows of W in 4 warps. 128 rows in 8 warps were as fast alone (int4
      layer at M = 16: 76 us against 78), but with them (and the scales folded) the int4
      preset decoded 5% slower at batch 16 (4,292 against 4,509 tok/s);
    - int4 past 32 rows: 128 rows of W in 8 warps (two warpgroups decode, each its 64 rows),
      up to 256 rows in one x tile, so each weight is decoded once (int4 layer at M = 256: 247
      us against 285 in two 128-row x tiles; merged gate_up 111 against 153). 256 rows of W
      against 128-row x tiles (half the x bytes a MAC) were slower at every shape (gate_up at
      M = 256: 145 us);
    - 8-bit codes, lighter to decode: 128 rows of W in 4 warps against 64-row x tiles, and as
      int4 against 128- and 256-row ones, with 4 stages (M = 128: 180 us a layer against 189
      with 3; M = 256: 271 against 320 in two 128-row x tiles).
    K split by _split. Eight warps against a ragged x tile (M not a multiple of block_m, its
    x loads masked) take 2 stages: with 3 or 4, Triton 3.6's kernel returned wrong results
    that changed from run to run on the H100 (8-bit codes into float32 at 65-127 rows, the LM
    head's case, relative error 0.06-0.27; int4 at 40 rows, NaN; results/h100/
    wint_ws_overlap.txt 3.). Most likely the register hazard retire_each_step now waits out
    (results/h100/wint_mma_rs_hazard.txt 2.: 2 stages have it in their SASS too); 3-4 stages
    there were not tried again."""
    block_m = min(MMA_X_TILE_MAX, max(16, 1 << (m - 1).bit_length()))
    k_step = group if group < k else _per_channel_step(k)
    if block_m <= 32:
        return MmaTiles(64, 0, block_m, k_step=k_step)
    stages = 2 if m % block_m else 4 if bits == 8 and block_m >= 128 else 3
    if bits == 4 or block_m >= 128:
        return MmaTiles(128, 0, block_m, num_warps=8, num_stages=stages, k_step=k_step)
    return MmaTiles(128, 0, block_m, k_step=k_step)


def _split(tiles: MmaTiles, out_tiles: int, steps: int, device: torch.device) -> int:
    """K split until the programs' warpgroups cover twice the SMs (once for x tiles above 32
    rows), keeping at least MIN_STEPS_PER_SPLIT steps a split (down_proj's 112 steps still
    split 8 ways). In the sweep of results/h100/wint_mma_natural.txt the split this picks was
    the fastest of half, it and twice it at 33 of 36 layer x M points; the two more than 4% off:
    int4 qkv at 16 rows (12.6 us against 11.4 in 8 splits) and 8-bit o_proj at 32 rows (16.2
    against 13.6 in 4, which made the int8 preset decode slower in earlier engine runs:
    wint_mma_tiles.txt 7.)."""
    target = (2 if tiles.block_m <= 32 else 1) * num_sms(device)
    warpgroups = tiles.num_warps // 4
    split = 1
    while out_tiles * split * warpgroups < target and steps // (split * 2) >= MIN_STEPS_PER_SPLIT:
        split *= 2
    return split


def wint_mma_gemm(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, bits: int,
                  group: int, smooth: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None,
                  tiles: MmaTiles | None = None) -> torch.Tensor:
    """x [M, K] (contiguous rows, 16-bit) @ dequantized W^T -> [M, N] in ``out_dtype``; W's
    codes as int32 words [N, K bits / 32], scales [N, K / group] (group >= K: per channel).

    With the default tiles, M past a whole number of MMA_X_TILE_MAX-row x tiles by at most half
    a tile takes two launches where the whole tiles fill the SMs: those tiles, then the rest in
    tiles of its own size. A ragged 256-row tile costs a whole one, an extra wave there (gate_up
    int4 at M = 264: 213 us, 147 in two launches; results/h100/wint_mma_even_m.txt). Where the
    tiles fit one wave, the ragged ones run beside the whole ones, and a second launch only adds
    its own time (qkv at 300 rows: 53 us in one launch, 66 in two). Not for 8-bit codes whose
    rest is as slow here as _w8_small_m_lags says."""
    m, k = x.shape
    n, kw = words.shape
    assert words.dtype == torch.int32 and kw * (32 // bits) == k
    assert x.stride(1) == 1 and words.stride(1) == 1 and scales.stride(1) == 1
    assert scales.shape == (n, k // group if group < k else 1)
    # rows of the output padded to a multiple of 16 elements: an unaligned row stride compiles
    # to an epilogue that spills (255 registers, a 736-byte stack), and that variant computed
    # NaNs on the H100 with unmasked x loads (results/h100/wint_mma_even_m.txt)
    width = -(-n // 16) * 16
    out = torch.empty(m, width, device=x.device, dtype=out_dtype or x.dtype)[:, :n]
    whole = m // MMA_X_TILE_MAX * MMA_X_TILE_MAX
    rest = m - whole
    full = wint_mma_tiles(whole, n, k, group, bits, x.device)
    whole_tiles = whole // full.block_m * triton.cdiv(n, full.block_n)
    if (tiles is None and whole_tiles >= num_sms(x.device) and 0 < rest <= MMA_X_TILE_MAX // 2
            and not _w8_small_m_lags(rest, n, k, bits)):
        _launch(x[:whole], words, scales, bits, group, smooth, out[:whole], None)
        _launch(x[whole:], words, scales, bits, group, smooth, out[whole:], None)
    else:
        _launch(x, words, scales, bits, group, smooth, out, tiles)
    return out.contiguous()  # a copy only for an unaligned width


def _launch(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, bits: int, group: int,
            smooth: torch.Tensor | None, out: torch.Tensor, tiles: MmaTiles | None) -> None:
    """The kernel over x's rows into ``out``'s. With the default tiles, W's rows past whole
    waves of 256-row x tiles (one program an SM) go to a second launch in tiles of 64 rows of W
    where those fit one wave: gate_up at 512 rows is 448 tiles, 3.4 waves of the H100's 132 SMs,
    and its last 52 run as 104 programs of half the work (_head_rows). No K split there: a
    128 x 256 tile's float32 partials cost more than they save (results/h100/
    wint_mma_stream_k.txt)."""
    if tiles is None:
        tiles = wint_mma_tiles(x.shape[0], words.shape[0], x.shape[1], group, bits, x.device)
        head = _head_rows(tiles, x.shape[0], words.shape[0], x.device)
        if head:
            _launch_kernel(x, words[:head], scales[:head], bits, group, smooth, out[:, :head],
                           tiles)
            _launch_kernel(x, words[head:], scales[head:], bits, group, smooth, out[:, head:],
                           replace(tiles, block_n=64, split=1, num_warps=4))
            return
    _launch_kernel(x, words, scales, bits, group, smooth, out, tiles)


def _head_rows(tiles: MmaTiles, m: int, n: int, device: torch.device) -> int:
    """Rows of W whose tiles make whole waves, where the rest fit one wave of 64-row tiles (two
    programs a tile); 0 where that does not hold (fewer tiles than a wave, whole waves only, a
    larger rest, or x tiles small enough for several programs an SM)."""
    if tiles.block_m < MMA_X_TILE_MAX:
        return 0
    sms = num_sms(device)
    x_tiles, row_tiles = triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n)
    head = x_tiles * row_tiles // sms * sms // x_tiles  # row tiles of the whole waves
    rest = row_tiles - head
    return head * tiles.block_n if head and rest and 2 * rest * x_tiles <= sms else 0


def _launch_kernel(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, bits: int,
                   group: int, smooth: torch.Tensor | None, out: torch.Tensor,
                   tiles: MmaTiles) -> None:
    """One launch of the kernel over x's rows into ``out``'s."""
    m, k = x.shape
    n, kw = words.shape
    cpw = 32 // bits
    grouped = group < k
    k_step = group if grouped else tiles.k_step
    assert k % k_step == 0 and k_step % cpw == 0
    x_tiles, row_tiles = triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n)
    assert x_tiles * row_tiles <= COUNTER_CAPACITY, \
        f"{m} x {n}: more output tiles than the split-K counters"
    step_w = k_step // cpw
    split = tiles.split or _split(tiles, x_tiles * row_tiles, k // k_step, x.device)
    steps_per_split = -(-(kw // step_w) // split)
    parts = (torch.empty(x_tiles * row_tiles * split * tiles.block_n * tiles.block_m,
                         device=x.device, dtype=torch.float32) if split > 1 else out)
    counters = arrival_counters(x.device) if split > 1 else out
    _wint_mma_kernel[(x_tiles, row_tiles, split)](
        x, words, scales, smooth if smooth is not None else scales, out, parts, counters,
        m, n, kw, steps_per_split * step_w, x.stride(0), words.stride(0), scales.stride(0),
        out.stride(0), BITS=bits, STEP_W=step_w, GROUPED=grouped,
        HAS_SMOOTH=smooth is not None, SPLIT=split, ASM=x.is_cuda,
        BLOCK_N=tiles.block_n, BLOCK_M=tiles.block_m, EVEN_M=m % tiles.block_m == 0,
        RETIRE=x.is_cuda and retire_each_step(tiles),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl(x.device),
    )  # fmt: skip

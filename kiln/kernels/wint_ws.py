"""Persistent, warp-specialized tensor-core weight-only GEMM for decode batches of 32-48 to 1024
rows (Gluon, sm_90): wint_mma.py's formats (symmetric int4 codes, group-wise or per channel, and
symmetric 8-bit codes per channel) and its math, in the structure cuBLAS uses for bf16.

    out^T [N, M] = W [N, K] @ x^T [K, M],   W[n, k] = (u[n, k] - 2^(b - 1)) s[n, k // G]

Why a second kernel: past 256 rows wint_mma's Triton kernel runs at 0.65-0.80x of cuBLAS bf16
(benchmarks/results/h100/wint_mma_stream_k.txt). Its decode costs only 2-5%; what it lacks is
cuBLAS's structure: one program per tile leaves a partial last wave idle, and the warps that
decode and multiply also issue x's cp.async loads and meet at a barrier every K step (tensor
pipe busy 75% of active cycles against cuBLAS's 99%). Under Triton 3.6 it also waits out every
K step (wint_mma.retire_each_step), and from 32-48 rows this kernel beats it
(results/h100/wint_ws_split.txt). Here:

- one program per SM walks units pid, pid + programs, ...: a unit is an output tile's K, or
  one of ``split`` slices of it where W has too few tiles to fill the SMs; x tiles vary
  fastest, then the split, so the programs that share a tile of W run at the same time and
  read it from HBM once. A split tile's last unit to arrive adds the float32 partials in split
  order (_store_split);
- a producer warp streams each K step's x tile ([BLOCK_M, 64] 16-bit, 128-byte swizzle) and
  code words ([BLOCK_N, 64 codes] as int32) by TMA into a ring of NUM_STAGES buffers, each
  completing a "ready" mbarrier. It runs ahead across units, so the next unit's loads overlap
  this unit's epilogue. Rows of W past N arrive as zeros (TMA's fill) and their outputs are not
  stored; the last x tile's box ends at M where it can (_x_start);
- one or two consumer warpgroups (64 rows of W each, one partition) load words from shared
  memory in a layout where each thread holds exactly the words of its wgmma A fragment
  (``_decode_layout``), decode its pair of codes of each word (wint_mma's prmt / lop3 / fma asm)
  straight into the register operand, multiply by x in shared memory and release the stage
  ("empty" mbarrier) once that wgmma is done. Each step's wgmma runs while the next step
  decodes (see _consume for what that takes from ptxas). A whole tile's output is stored from
  a layout of 8 rows of W a thread, 16 bytes at a time (_out_layout);
- a tile of x rows that are no power of two (WsTiles.block_m2: 160 = 128 + 32) has a second
  TMA box and ring of x and a second wgmma and accumulator on the same decoded operand (Gluon's
  register tensors and TMA boxes are powers of two): gate_up at 160 rows no longer computes
  96 rows past M in every tile (results/h100/wint_ws_composite.txt).

Group scales (64 or 128 codes) multiply the decoded weights (rounded to x's dtype, as the
dequantized reference's); per-channel scales multiply the accumulator once at the end.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from kiln.kernels import _gluon
from kiln.kernels._gluon import (
    HAS_GLUON,
    SMEM_BUDGET,
    TensorDescriptor,
    axis_layout,
    constexpr_function,
    cta_barrier,
    fence_async_shared,
    gdc,
    jit,
    mbarrier,
    tma_load,
    ttgl,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from kiln.kernels._triton import num_sms, pdl
from kiln.kernels.wint_mma import (
    COUNTER_CAPACITY,
    DECODE4_BF16,
    DECODE4_F16,
    DECODE8_BF16,
    DECODE8_F16,
    arrival_counters,
)

STEP = 64  # codes of K a step: x boxes 64 16-bit values wide (128 bytes, the widest swizzle)
_STEP = ttgl.constexpr(STEP) if HAS_GLUON else STEP  # (kernels read constexpr globals only)
# registers a thread of the producer warp (the consumers get what is left of the register file)
PRODUCER_REGS = ttgl.constexpr(24) if HAS_GLUON else 24


@dataclass(frozen=True)
class WsTiles:
    """block_n rows of W a tile (64 a consumer warpgroup), block_m rows of x a tile
    (the wgmma's N: a multiple of 16 up to 256), stages ring buffers, split programs sharing
    a tile's K (a power of two: each takes K / split). block_m2: a second wgmma's rows of x
    on the same decoded weights (a multiple of 16, less than block_m; 0: none), for tiles of
    rows that are no power of two (Gluon's register tensors and TMA boxes are): 160 = 128 + 32,
    192 = 128 + 64, 320 = 256 + 64; K not split."""

    block_n: int = 128
    block_m: int = 256
    stages: int = 5
    split: int = 1
    block_m2: int = 0

    def __post_init__(self):
        if self.block_n not in (64, 128):
            raise ValueError(f"block_n={self.block_n}: 64 or 128 (one or two warpgroups)")
        if self.block_m % 16 or not 16 <= self.block_m <= 256:
            raise ValueError(f"block_m={self.block_m}: a multiple of 16 in 16..256")
        if not 2 <= self.stages <= 8:
            raise ValueError(f"stages={self.stages}: 2..8")
        if self.split not in (1, 2, 4, 8):
            raise ValueError(f"split={self.split}: 1, 2, 4 or 8")
        if self.block_m2 % 16 or not 0 <= self.block_m2 < self.block_m:
            raise ValueError(f"block_m2={self.block_m2}: 0 or a multiple of 16 less than "
                             f"block_m={self.block_m}")
        if self.block_m2 and self.split > 1:
            raise ValueError(f"block_m2={self.block_m2} with split={self.split}: K not split")

    @property
    def rows(self) -> int:
        """Rows of x a tile."""
        return self.block_m + self.block_m2

    @property
    def name(self) -> str:
        """As benchmarks/wint_mma_sweep.py's --ws-tiles takes it: 128x64s8k4, 128x128+32s6k1."""
        second = f"+{self.block_m2}" if self.block_m2 else ""
        return f"{self.block_n}x{self.block_m}{second}s{self.stages}k{self.split}"

    @property
    def consumers(self) -> int:
        """Consumer warpgroups (64 rows of W each)."""
        return self.block_n // 64


@constexpr_function
def _decode_layout(bits, rows):
    """[rows, words a step, pairs a word, 2] such that the reshape to [rows, STEP] is
    wgmma's register A layout (DotOperandLayout(0, NVMMA v3, k_width=2)). In that layout a
    thread holds rows r and r + 8 and, per 16 codes of K, codes 2 t, 2 t + 1, 2 t + 8, 2 t + 9
    (t = lane % 4): for int4 (8 codes a word) pair t of every word, for 8-bit codes (4 a word)
    pair t % 2 of every other word. Lanes whose only difference is the pair share their words
    (a broadcast shared-memory load)."""
    bits, rows = int(bits), int(rows)  # (constexprs inside a kernel)
    step_w = STEP * bits // 32
    pairs = 16 // bits

    def basis(n=0, w=0, p=0, e=0):
        return [n, w, p, e]

    # registers: the pair's two codes, row + 8, then K upward (the operand's order)
    reg = [basis(e=1), basis(n=8)]
    if bits == 4:  # k = 8 w + 2 p + e: lanes take K bits 1-2 (the pair)
        lane = [basis(p=1), basis(p=2)]
        reg += [basis(w=1 << i) for i in range(int(math.log2(step_w)))]
    else:  # k = 4 w + 2 p + e: lanes take K bits 1 (the pair) and 2 (the word's lowest bit)
        lane = [basis(p=1), basis(w=1)]
        reg += [basis(w=1 << i) for i in range(1, int(math.log2(step_w)))]
    lane += [basis(n=1), basis(n=2), basis(n=4)]
    warp = [basis(n=16 << i) for i in range(int(math.log2(rows // 16)))]  # 16 rows a warp
    return ttgl.DistributedLinearLayout(reg, lane, warp, [], [rows, step_w, pairs, 2])


@jit
def _decode(words, BITS: ttgl.constexpr, L4: ttgl.constexpr, A: ttgl.constexpr,
            dtype: ttgl.constexpr):
    """The tile's words [BLOCK_N, STEP_W] (layout: L4 without its last two axes) -> the codes
    less 2^(BITS - 1), [BLOCK_N, _STEP] in dtype and layout A: each thread decodes only the
    pairs of its own fragment."""
    P: ttgl.constexpr = 16 // BITS
    pair = ttgl.arange(0, P, layout=axis_layout(L4, 2))
    half = ttgl.arange(0, 2, layout=axis_layout(L4, 3))
    # prmt selectors of the pair's bytes (wint_mma._code_pairs): int4 bytes p of the word and
    # of the word >> 4, 8-bit codes bytes 2 p and 2 p + 1 of the word
    if BITS == 4:
        second = words >> 4
        sel = pair * 0x101 + 0x400
    else:
        second = words
        sel = pair * 0x202 + 0x100
    sel = sel[None, None, :, None] + half[None, None, None, :] * 0
    first, sel = ttgl.broadcast(words[:, :, None, None], sel)
    second, _ = ttgl.broadcast(second[:, :, None, None], sel)
    if dtype == ttgl.bfloat16:  # (inline asm takes literal dtypes, not a constexpr one)
        asm: ttgl.constexpr = DECODE4_BF16 if BITS == 4 else DECODE8_BF16
        codes = ttgl.inline_asm_elementwise(asm, "=r,r,r,r,r,r,r", [first, second, sel],
                                            dtype=ttgl.bfloat16, is_pure=True, pack=2)
    else:
        asm: ttgl.constexpr = DECODE4_F16 if BITS == 4 else DECODE8_F16
        codes = ttgl.inline_asm_elementwise(asm, "=r,r,r,r,r,r,r", [first, second, sel],
                                            dtype=ttgl.float16, is_pure=True, pack=2)
    flat = ttgl.reshape(codes, [codes.shape[0], codes.shape[1] * P * 2])
    return ttgl.convert_layout(flat, A, assert_trivial=True)


@jit
def _unit(unit, x_tiles, SPLIT: ttgl.constexpr):
    """Work unit ``unit`` -> (output tile, its x tile, its W tile, its K split). x tiles vary
    fastest, then the split: the programs that read one tile of W run at the same time."""
    rest = unit // x_tiles
    x_tile = unit % x_tiles
    w_tile = rest // SPLIT
    return w_tile * x_tiles + x_tile, x_tile, w_tile, rest % SPLIT


@jit
def _x_start(x_tile, M, X_ROWS: ttgl.constexpr, SHIFT: ttgl.constexpr):
    """The first row of x tile ``x_tile``'s box (X_ROWS rows). With SHIFT (_shifts: M holds a
    whole box and more, not a multiple of it) the last one's ends at row M (its rows before
    x_tile * X_ROWS belong to the tile before it and are not stored again): a box partly past M
    made the GEMM slower in proportion to its rows past M (TMA's zero fill;
    results/h100/wint_ws_split.txt). Unshifted, 128 x 256 tiles ran gate_up at 776 rows in 1.8x
    bf16's time (results/h100/wint_ws_refit.txt)."""
    if SHIFT:
        return ttgl.minimum(x_tile * X_ROWS, M - X_ROWS)
    else:
        return x_tile * X_ROWS


# Every partition takes the same arguments (worker partitions share one signature): the TMA
# descriptors, the shared buffers and barriers (x and words rings, ready, empty), the pointers
# and sizes as tuples, then the constexprs.
@jit
def _produce(descs, smem, ptrs, sizes, BITS: ttgl.constexpr, GROUP_STEPS: ttgl.constexpr,
             BLOCK_N: ttgl.constexpr, BLOCK_M: ttgl.constexpr, BLOCK_M2: ttgl.constexpr,
             STEP_W: ttgl.constexpr, NUM_STAGES: ttgl.constexpr, SPLIT: ttgl.constexpr,
             USE_PDL: ttgl.constexpr, SHIFT: ttgl.constexpr):
    """The producer warp: every unit's K steps, x and words by TMA into the ring. With PDL it
    waits for the previous kernel (x is its output) before its first load, then lets the next
    kernel launch; the consumers store nothing (out, partials, counters) before their first
    stage arrives, so after that wait too."""
    x_desc, x2_desc, w_desc = descs
    x_bufs, x2_bufs, w_bufs, ready, empty = smem
    M, N, KW, stride_sn, stride_om, x_tiles, num_units = sizes
    if USE_PDL:
        gdc(True)
        # x was written through the generic proxy and is read here through the async one (TMA)
        ttgl.inline_asm_elementwise("fence.proxy.async.global; // $0", "=r", [],
                                    dtype=ttgl.int32, is_pure=False, pack=1)
        gdc(False)
    X_ROWS: ttgl.constexpr = BLOCK_M + BLOCK_M2
    nbytes: ttgl.constexpr = X_ROWS * _STEP * 2 + BLOCK_N * STEP_W * 4
    kw_split = KW // SPLIT
    count = 0
    for unit in range(ttgl.program_id(0), num_units, ttgl.num_programs(0)):
        _, x_tile, w_tile, part = _unit(unit, x_tiles, SPLIT)
        m0 = _x_start(x_tile, M, X_ROWS, SHIFT)
        row0 = w_tile * BLOCK_N
        for kw0 in range(part * kw_split, (part + 1) * kw_split, STEP_W):
            stage = count % NUM_STAGES
            # the ring's barriers start in phase 0: the first pass waits on phase 1, done
            mbarrier.wait(empty.index(stage), ((count // NUM_STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), nbytes)
            k0 = kw0 // STEP_W * _STEP
            tma_load(x_desc, [m0, k0], ready.index(stage), x_bufs.index(stage))
            if BLOCK_M2 > 0:
                tma_load(x2_desc, [m0 + BLOCK_M, k0], ready.index(stage), x2_bufs.index(stage))
            tma_load(w_desc, [row0, kw0], ready.index(stage), w_bufs.index(stage))
            count += 1


@jit
def _step(smem, s_rows, accs, count, step, first, BITS: ttgl.constexpr,
          GROUP_STEPS: ttgl.constexpr, NUM_STAGES: ttgl.constexpr, L4: ttgl.constexpr,
          LW: ttgl.constexpr, A: ttgl.constexpr, A2: ttgl.constexpr, BLOCK_M: ttgl.constexpr,
          BLOCK_M2: ttgl.constexpr, LAST: ttgl.constexpr):
    """The unit's K step ``step`` (K step ``first + step`` of the whole K, the ring's
    ``count``-th): decode the words straight into wgmma's register A operand and issue the
    wgmma (two with BLOCK_M2: accs is the pair of accumulators, else a 1-tuple); then wait for
    the previous step's wgmmas and release its stage. The unit's LAST step waits for its own
    wgmmas too, in the same block: ptxas let the epilogue read the accumulator before a wait
    placed after the loop.
    Each wgmma starts with a fence (WARPGROUP.ARRIVE), and the times fit its holding the warps
    until the wgmma group before it is done: with the larger issued first, the next step's
    decode waited for it, and 128 x (128 + 64) tiles took 1045 cycles a K step, as many as
    128 x 256 (%clock64 in the K loop; alone, without the decode, the two wgmmas take 768).
    The smaller first: 128 x (128 + 32 / 64) tiles 0.85x / 0.93x the time (geometric means
    over 72 shapes), one warpgroup's within 1% (results/h100/wint_ws_order.txt)."""
    x_bufs, x2_bufs, w_bufs, ready, empty = smem
    stage = count % NUM_STAGES
    if GROUP_STEPS > 0:  # issued before the wait: its latency hides behind it
        s = ttgl.load(s_rows + (first + step) // GROUP_STEPS)
    mbarrier.wait(ready.index(stage), (count // NUM_STAGES) & 1)
    a = _decode(w_bufs.index(stage).load(LW), BITS, L4, A, x_bufs.dtype)
    if GROUP_STEPS > 0:
        a = a * s[:, None]
    if BLOCK_M2 > 0:  # the smaller wgmma first (the docstring says why)
        acc2 = warpgroup_mma(ttgl.convert_layout(a, A2, assert_trivial=True),
                             x2_bufs.index(stage).permute((1, 0)), accs[1], is_async=True)
    acc = warpgroup_mma(a, x_bufs.index(stage).permute((1, 0)), accs[0], is_async=True)
    if BLOCK_M2 > 0:
        accs = warpgroup_mma_wait(0 if LAST else 2, deps=[acc, acc2])
    else:
        accs = (warpgroup_mma_wait(0 if LAST else 1, deps=[acc]),)
    if step > 0:  # the unit's previous step
        mbarrier.arrive(empty.index((count + NUM_STAGES - 1) % NUM_STAGES))
    if LAST:
        mbarrier.arrive(empty.index(stage))
    return accs


@jit
def _out_mask(rows, cols, x_tile, M, N, X_ROWS: ttgl.constexpr, SHIFT: ttgl.constexpr):
    """Which of the output tile's [rows, cols] to store: nothing past N or M, nor (SHIFT) the
    last x tile's columns of the tile before it."""
    cols_kept = cols < M
    if SHIFT:
        cols_kept = (cols >= x_tile * X_ROWS) & cols_kept
    return (rows < N)[:, None] & cols_kept[None, :]


@jit
def _store_tile(acc, out_ptr, sizes, row0, col0, x_tile, X_ROWS: ttgl.constexpr,
                SHIFT: ttgl.constexpr):
    """acc [W rows from row0, x rows from col0] into out^T, from a layout of 8 rows of W a
    thread (_out_layout): 16-byte stores."""
    M, N, KW, stride_sn, stride_om, x_tiles, num_units = sizes
    OUT: ttgl.constexpr = _out_layout(acc.shape[0])
    rows = row0 + ttgl.arange(0, acc.shape[0], layout=ttgl.SliceLayout(1, OUT))
    cols = col0 + ttgl.arange(0, acc.shape[1], layout=ttgl.SliceLayout(0, OUT))
    # 32-bit offsets (wint_ws_applies): 64-bit pointers a value spill in this epilogue
    ttgl.store(out_ptr + (cols[None, :] * stride_om + rows[:, None]),
               ttgl.convert_layout(acc.to(out_ptr.dtype.element_ty), OUT),
               mask=_out_mask(rows, cols, x_tile, M, N, X_ROWS, SHIFT))


@jit
def _store_split(acc, parts, counter, out, mask, part, local, SPLIT: ttgl.constexpr,
                 TILE: ttgl.constexpr):
    """A split unit's float32 partial ``acc`` into the tile's ``parts`` [SPLIT, TILE] (at
    ``local``); the tile's last unit to arrive (``counter``) adds them in split order (the
    same bits whatever the arrival order), stores the sum at ``out`` and resets the counter
    for the next launch."""
    ttgl.store(parts + part * TILE + local, acc)
    cta_barrier()  # every thread's partial stored before the arrival is counted
    if ttgl.atomic_add(counter, 1, sem="acq_rel") == SPLIT - 1:
        acc = ttgl.load(parts + local, cache_modifier=".cg")
        for j in ttgl.static_range(1, SPLIT):
            acc += ttgl.load(parts + j * TILE + local, cache_modifier=".cg")
        ttgl.store(out, acc.to(out.dtype.element_ty), mask=mask)
        ttgl.atomic_xchg(counter, 0)


@constexpr_function
def _mma_layout(block_n, block_m):
    """The accumulator's layout of a [block_n, block_m] wgmma tile (one warpgroup a 64 rows)."""
    return ttgl.NVMMADistributedLayout([3, 0], [int(block_n) // 16, 1], [16, int(block_m), 16])


@constexpr_function
def _out_layout(block_n):
    """The output's layout for its store, [block_n, any] (W rows x x rows): each thread 8 rows of
    W of one row of x, 16 contiguous bytes of out^T; each warp 16 rows of W, the rows it holds in
    the wgmma's layout, so converting to it stays within the warp (through a few KB of shared
    memory, 16 rows of x at a time). In the wgmma's layout each thread held single 16-bit
    values 8 rows apart, one store each."""
    return ttgl.BlockedLayout([8, 1], [2, 16], [int(block_n) // 16, 1], [0, 1])


@jit
def _consume(descs, smem, ptrs, sizes, BITS: ttgl.constexpr, GROUP_STEPS: ttgl.constexpr,
             BLOCK_N: ttgl.constexpr, BLOCK_M: ttgl.constexpr, BLOCK_M2: ttgl.constexpr,
             STEP_W: ttgl.constexpr, NUM_STAGES: ttgl.constexpr, SPLIT: ttgl.constexpr,
             USE_PDL: ttgl.constexpr, SHIFT: ttgl.constexpr):
    """The consumer warpgroups (64 rows of W each): acc [BLOCK_N, BLOCK_M] over the unit's K,
    then out^T (or, K split, the partial: _store_split).
    Each step's wgmma stays in flight while the next step decodes (_step). The loop takes two
    steps at a time so that each step's register operand has registers of its own: an operand
    carried round the loop would be copied at the back edge and its registers reused while its
    wgmma runs. Nothing holds the operands past their wait: in this form ptxas gave the next
    decode other registers at every tiling (tests/kernels/test_wint_ws.py reads the SASS for
    it). (With each warpgroup its own partition, ptxas serializes the wgmmas: "insufficient
    register resources".)"""
    x_bufs, x2_bufs, w_bufs, ready, empty = smem
    s_ptr, out_ptr, part_ptr, count_ptr = ptrs
    M, N, KW, stride_sn, stride_om, x_tiles, num_units = sizes
    X_ROWS: ttgl.constexpr = BLOCK_M + BLOCK_M2
    MMA: ttgl.constexpr = _mma_layout(BLOCK_N, BLOCK_M)
    A: ttgl.constexpr = ttgl.DotOperandLayout(0, MMA, 2)
    # the second wgmma's (the same operand registers: assert_trivial in _step)
    MMA2: ttgl.constexpr = _mma_layout(BLOCK_N, BLOCK_M2 if BLOCK_M2 > 0 else BLOCK_M)
    A2: ttgl.constexpr = ttgl.DotOperandLayout(0, MMA2, 2)
    L4: ttgl.constexpr = _decode_layout(BITS, BLOCK_N)
    LW: ttgl.constexpr = ttgl.SliceLayout(2, ttgl.SliceLayout(3, L4))
    rows_a = ttgl.arange(0, BLOCK_N, layout=ttgl.SliceLayout(1, A))
    rows_c = ttgl.arange(0, BLOCK_N, layout=ttgl.SliceLayout(1, MMA))
    cols_c = ttgl.arange(0, BLOCK_M, layout=ttgl.SliceLayout(0, MMA))
    steps = KW // STEP_W // SPLIT  # even (wint_ws_applies)
    count = 0
    for unit in range(ttgl.program_id(0), num_units, ttgl.num_programs(0)):
        tile, x_tile, w_tile, part = _unit(unit, x_tiles, SPLIT)
        m0 = _x_start(x_tile, M, X_ROWS, SHIFT)
        row0 = w_tile * BLOCK_N
        first = part * steps
        # scale rows clamped (rows past N are computed from zero words and not stored)
        s_rows = s_ptr + ttgl.minimum(row0 + rows_a, N - 1).to(ttgl.int64) * stride_sn
        if BLOCK_M2 > 0:
            accs = (ttgl.zeros([BLOCK_N, BLOCK_M], ttgl.float32, MMA),
                    ttgl.zeros([BLOCK_N, BLOCK_M2], ttgl.float32, MMA2))
        else:
            accs = (ttgl.zeros([BLOCK_N, BLOCK_M], ttgl.float32, MMA),)
        for step in range(0, steps - 2, 2):
            accs = _step(smem, s_rows, accs, count, step, first, BITS, GROUP_STEPS, NUM_STAGES,
                         L4, LW, A, A2, BLOCK_M, BLOCK_M2, False)
            accs = _step(smem, s_rows, accs, count + 1, step + 1, first, BITS, GROUP_STEPS,
                         NUM_STAGES, L4, LW, A, A2, BLOCK_M, BLOCK_M2, False)
            count += 2
        accs = _step(smem, s_rows, accs, count, steps - 2, first, BITS, GROUP_STEPS,
                     NUM_STAGES, L4, LW, A, A2, BLOCK_M, BLOCK_M2, False)
        accs = _step(smem, s_rows, accs, count + 1, steps - 1, first, BITS, GROUP_STEPS,
                     NUM_STAGES, L4, LW, A, A2, BLOCK_M, BLOCK_M2, True)
        count += 2
        acc = accs[0]
        rows = row0 + rows_c
        if GROUP_STEPS == 0:  # per channel
            scale = ttgl.load(s_ptr + ttgl.minimum(rows, N - 1).to(ttgl.int64) * stride_sn)
            acc = acc * scale.to(ttgl.float32)[:, None]
        if SPLIT == 1:
            _store_tile(acc, out_ptr, sizes, row0, m0, x_tile, X_ROWS, SHIFT)
        else:
            TILE: ttgl.constexpr = BLOCK_N * BLOCK_M
            cols = m0 + cols_c
            # 32-bit offsets (wint_ws_applies): 64-bit pointers a value spill in this epilogue
            _store_split(acc, part_ptr + tile.to(ttgl.int64) * (SPLIT * TILE), count_ptr + tile,
                         out_ptr + (cols[None, :] * stride_om + rows[:, None]),
                         _out_mask(rows, cols, x_tile, M, N, X_ROWS, SHIFT),
                         part, rows_c[:, None] * BLOCK_M + cols_c[None, :], SPLIT, TILE)
        if BLOCK_M2 > 0:  # (K not split: WsTiles)
            acc2 = accs[1]
            if GROUP_STEPS == 0:
                scale2 = ttgl.convert_layout(scale, ttgl.SliceLayout(1, MMA2))
                acc2 = acc2 * scale2.to(ttgl.float32)[:, None]
            _store_tile(acc2, out_ptr, sizes, row0, m0 + BLOCK_M, x_tile, X_ROWS,
                        SHIFT)


# M and the unit counts as any int32 (no variant per batch size: fewer compiles while the engine
# captures its graphs), at launch and in compile_sm90 (the kernel the SASS tests read); N
# specialized (a model's few widths): N divisible by 16 lets the store mask 8 rows at a time
_UNSPECIALIZED = ("M", "x_tiles", "num_units")


@jit(do_not_specialize=list(_UNSPECIALIZED))
def _wint_ws_kernel(
    x_desc, x2_desc, w_desc, s_ptr, out_ptr, part_ptr, count_ptr, M, N, KW, stride_sn, stride_om,
    x_tiles, num_units,
    BITS: ttgl.constexpr, GROUP_STEPS: ttgl.constexpr, BLOCK_N: ttgl.constexpr,
    BLOCK_M: ttgl.constexpr, BLOCK_M2: ttgl.constexpr, STEP_W: ttgl.constexpr,
    NUM_STAGES: ttgl.constexpr, SPLIT: ttgl.constexpr, USE_PDL: ttgl.constexpr,
    SHIFT: ttgl.constexpr,
):  # fmt: skip
    """Launched with BLOCK_N / 16 warps (the consumer warpgroups); warp_specialize adds the
    producer warp."""
    x_bufs = ttgl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES, BLOCK_M, _STEP],
                                         x_desc.layout)
    if BLOCK_M2 > 0:  # the second wgmma's rows of x, a ring of their own (power-of-two shapes)
        x2_bufs = ttgl.allocate_shared_memory(x2_desc.dtype, [NUM_STAGES, BLOCK_M2, _STEP],
                                              x2_desc.layout)
    else:
        x2_bufs = x_bufs
    w_bufs = ttgl.allocate_shared_memory(ttgl.int32, [NUM_STAGES, BLOCK_N, STEP_W],
                                         w_desc.layout)
    ready = ttgl.allocate_shared_memory(ttgl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = ttgl.allocate_shared_memory(ttgl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in ttgl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()  # the initialized barriers visible to TMA
    descs = (x_desc, x2_desc, w_desc)
    smem = (x_bufs, x2_bufs, w_bufs, ready, empty)
    ptrs = (s_ptr, out_ptr, part_ptr, count_ptr)
    sizes = (M, N, KW, stride_sn, stride_om, x_tiles, num_units)
    ttgl.warp_specialize([
        (_consume, (descs, smem, ptrs, sizes, BITS, GROUP_STEPS, BLOCK_N, BLOCK_M, BLOCK_M2,
                    STEP_W, NUM_STAGES, SPLIT, USE_PDL, SHIFT)),
        (_produce, (descs, smem, ptrs, sizes, BITS, GROUP_STEPS, BLOCK_N, BLOCK_M, BLOCK_M2,
                    STEP_W, NUM_STAGES, SPLIT, USE_PDL, SHIFT)),
    ], [1], [PRODUCER_REGS])


# Each tiling's cost model, fitted to the H100 sweeps of Llama-3.1-8B's layers at 48-1024 rows
# (benchmarks/results/h100/wint_ws_composite.txt, wint_ws_refit.txt): a round of units (a
# tile's K, or a split of it) over the SMs takes a + (b + e x the MiB of x) x the unit's K steps
# + d x the rows of x past M in a box (TMA's zero fill; _x_start shifts the last box back to end
# at M, so a tile pays it only with fewer rows than one box) us, and
# splitting K adds c us (the partials' sum) once; None: not split (128 x 256, and two-wgmma
# tiles). A K step slows as x grows (every W tile's program reads all of x): down_proj's 14336
# columns at 448-512 rows ran 0.40 us a step in 128 x 128 tiles against gate_up's 0.32, and
# without e the model picked them (100-106 us) over 64 x 256 (86-91). A two-wgmma tiling takes
# its first wgmma's tiling's e (the sweeps have no large x for it). Past X_MIB_MAX MiB of x a
# step stops slowing: at 1024-8192 rows 128 x 256 tiles ran within 10% of the model with x
# capped there (5% rms); uncapped, it gave down_proj at 8192 rows 2.9x the measured time
# (results/h100/wint_ws_shift.txt). Each ring depth is the sweep's fastest. The two 128-row W
# tilings with two wgmmas are refitted on sweeps with the smaller wgmma first (_step;
# results/h100/wint_ws_order.txt).
_COSTS = {
    WsTiles(64, 32, 8): (3.85, 0.152, 1.872, 0.0, 0.0099),
    WsTiles(64, 64, 8): (4.544, 0.156, 3.676, 0.03, 0.0017),
    WsTiles(64, 128, 8): (6.737, 0.177, 4.324, 0.085, 0.005),
    WsTiles(64, 256, 6): (8.747, 0.249, 20.497, 0.126, 0.0075),
    WsTiles(128, 32, 8): (5.445, 0.215, 1.854, 0.0, 0.0149),
    WsTiles(128, 64, 8): (7.802, 0.219, 3.585, 0.028, 0.005),
    WsTiles(128, 128, 6): (12.005, 0.259, 4.883, 0.034, 0.0083),
    WsTiles(128, 256, 5): (11.784, 0.461, None, 0.017, 0.0086),
    WsTiles(64, 128, 8, block_m2=32): (3.854, 0.236, None, 0.069, 0.005),
    WsTiles(64, 128, 8, block_m2=64): (4.691, 0.256, None, 0.053, 0.005),
    WsTiles(64, 256, 5, block_m2=64): (1.801, 0.409, None, 0.096, 0.0075),
    WsTiles(128, 128, 6, block_m2=32): (7.77, 0.382, None, 0.0, 0.0083),
    WsTiles(128, 128, 6, block_m2=64): (9.202, 0.433, None, 0.0, 0.0083),
}
SPLITS = (1, 2, 4)
X_MIB_MAX = 28.0  # MiB of x past which a K step stops slowing (above)
# Rows from which this kernel takes each code width (fewer: wint_mma.py, or quant_gemm's tile
# kernel for 8-bit codes): in the sweep, int4 at 32 rows ran 92 us a layer here against
# wint_mma's 76, at 48 rows 102 against 155; 8-bit codes at 32 rows 102 against the tile
# kernel's 155 (fewer rows not measured)
WS_MIN_M = {4: 48, 8: 32}
# and up to which, by the output's bytes a value; more rows (prefill): dequantize + cuBLAS.
# 16-bit: this kernel took 0.77-0.95x that time for Llama-3.1-8B's four layers at 1024-3072
# rows of int4 (8-bit codes: 0.65-0.94x at 640-3072), 0.98-1.00x at 4096 (gate_up
# 1.02-1.03x), 1.01x at 6144 and 1.04x at 8192. float32 (the LM head's logits): 1.00-1.03x
# at 2048 rows, without dequantize's 1 GB temporary of the weight, 1.10-1.12x at 4096
# (results/h100/wint_ws_shift.txt)
WS_MAX_M = {2: 4096, 4: 2048}


# us a plan's second launch costs (its fill and drain: about the decode GEMMs' per-kernel floor,
# results/h100/gemm_sm90.txt)
LAUNCH_US = 3.0
# and the share of the one launch's modelled time it must save: near a tie the model's error
# (median 2-10% a tiling) decides: two launches ran 1-17% slower than one at 800-880 rows
# (results/h100/wint_ws_refit.txt)
TWO_LAUNCH_MARGIN = 0.02


class WsLaunch(NamedTuple):
    """One launch of a plan (ws_plan): W's rows [row0, row0 + rows) in ``tiles``."""

    row0: int
    rows: int
    tiles: WsTiles


def _cost(tiles: WsTiles, m: int, n: int, k: int, sms: int) -> float:
    """Modelled us of x [M, K] @ W [N, K]^T in ``tiles`` on ``sms`` multiprocessors."""
    a, b, c, d, e = _COSTS[replace(tiles, split=1)]
    rounds = -(-_tiles(m, n, tiles) * tiles.split // sms)
    past_m = tiles.rows - m  # (_x_start: only with fewer rows than a box)
    x_mib = min(m * k * 2 / 2**20, X_MIB_MAX)
    unit = a + (b + e * x_mib) * k / STEP / tiles.split + d * max(0, past_m)
    return rounds * unit + (c if tiles.split > 1 else 0.0)


def _candidates(k: int, bits: int, out_bytes: int) -> list[WsTiles]:
    """Every tiling and K split of _COSTS that K splits into and whose shared memory
    (``bits``-bit codes, an output of ``out_bytes`` a value) fits SMEM_BUDGET."""
    return [replace(tiles, split=split) for tiles, (_, _, c, _, _) in _COSTS.items()
            for split in SPLITS
            if (split == 1 or c is not None and _splits_k(k, split))
            and smem_bytes(bits, tiles, out_bytes) <= SMEM_BUDGET]


@functools.lru_cache(maxsize=4096)  # (a decode step asks for the same few shapes every step)
def ws_tiles(m: int, n: int, k: int, sms: int, bits: int, out_bytes: int = 2) -> WsTiles:
    """The tiling and K split of least modelled time (_COSTS) for x [M, K] @ W [N, K]^T on
    ``sms`` multiprocessors, of those that fit (_candidates)."""
    return min(_candidates(k, bits, out_bytes), key=lambda tiles: _cost(tiles, m, n, k, sms))


@functools.lru_cache(maxsize=4096)
def ws_plan(m: int, n: int, k: int, sms: int, bits: int,
            out_bytes: int = 2) -> tuple[WsLaunch, ...]:
    """ws_tiles' tiling in one launch, or where the model says it is TWO_LAUNCH_MARGIN faster,
    two: a tiling's whole rounds over the first rows of W, then the rows left in a launch of
    their own tiling (ws_tiles' for them). A last round that leaves most SMs idle (gate_up at
    512 rows in 128 x 256 tiles: 448 units on 132 SMs) becomes a launch of smaller tiles over
    every SM. Every launch's first row is a multiple of 64 (16-byte aligned words and output
    columns)."""
    one = ws_tiles(m, n, k, sms, bits, out_bytes)
    best, plan = _cost(one, m, n, k, sms) * (1 - TWO_LAUNCH_MARGIN), (WsLaunch(0, n, one),)
    for tiles in _candidates(k, bits, out_bytes):
        whole = _tiles(m, n, tiles) * tiles.split // sms * sms  # units of the whole rounds
        rows = whole // (-(-m // tiles.rows) * tiles.split) * tiles.block_n
        if not 0 < rows < n:
            continue
        rest = ws_tiles(m, n - rows, k, sms, bits, out_bytes)
        cost = _cost(tiles, m, rows, k, sms) + _cost(rest, m, n - rows, k, sms) + LAUNCH_US
        if cost < best:
            best, plan = cost, (WsLaunch(0, rows, tiles), WsLaunch(rows, n - rows, rest))
    return plan


def wint_ws_preferred(m: int, bits: int, out_bytes: int = 2) -> bool:
    """Whether this kernel, at ws_tiles, beats wint_mma.py (its default tiles), quant_gemm's
    tile kernel and dequantize + cuBLAS for M rows of ``bits``-bit codes and an output of
    ``out_bytes`` a value: from WS_MIN_M to WS_MAX_M rows, in the H100 sweeps of Llama-3.1-8B's
    layers (results/h100/wint_ws_split.txt, wint_ws_shift.txt)."""
    return (bits in WS_MIN_M and out_bytes in WS_MAX_M
            and WS_MIN_M[bits] <= m <= WS_MAX_M[out_bytes])


def _x_layout():
    """x's shared layout (and the TMA box's): 64 16-bit values a row, the 128-byte swizzle."""
    return ttgl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def _w_layout(bits: int):
    """The words' shared layout: swizzled over a row's bytes (32 for int4, 64 for 8-bit), so
    that the 8 rows a warp's lanes read at once fall in different banks."""
    return ttgl.NVMMASharedLayout(swizzle_byte_width=STEP * bits // 8, element_bitwidth=32,
                                  rank=2)


def _constexprs(bits: int, group: int, k: int, tiles: WsTiles, use_pdl: bool,
                shift: bool) -> dict:
    step_w = STEP * bits // 32
    return dict(BITS=bits, GROUP_STEPS=group // STEP if group < k else 0,
                BLOCK_N=tiles.block_n, BLOCK_M=tiles.block_m, BLOCK_M2=tiles.block_m2,
                STEP_W=step_w,
                NUM_STAGES=tiles.stages, SPLIT=tiles.split, USE_PDL=use_pdl, SHIFT=shift)


def _shifts(m: int, tiles: WsTiles) -> bool:
    """Whether the last x tile's box shifts back to end at row M (_x_start): M holds a whole
    box and is no multiple of it. Elsewhere the kernel without the shift: with the shift's code
    at every M, decode steps at batch 512 ran 0.2% slower, 512 x 512/256 end to end 0.5%
    (results/h100/wint_ws_shift.txt 5.)."""
    return m > tiles.rows and m % tiles.rows != 0


def _out_width(n: int) -> int:
    """The output's row stride: N padded to 16 elements (aligned stores), as wint_mma_gemm's."""
    return -(-n // 16) * 16


def _splits_k(k: int, split: int) -> bool:
    """Whether K splits ``split`` ways into whole two-step loop passes."""
    return k % (2 * STEP * split) == 0


def _tiles(m: int, n: int, tiles: WsTiles) -> int:
    """Output tiles: x tiles x W tiles."""
    return -(-m // tiles.rows) * -(-n // tiles.block_n)


def smem_bytes(bits: int, tiles: WsTiles, out_bytes: int = 2) -> int:
    """The ring and its barriers, the scratch of the store's layout conversion (16 rows of x at
    a time, ``out_bytes`` a value) and Triton's own few bytes (4-12 under Triton 3.6): an upper
    bound of what the compiled kernel takes (tests/kernels/test_wint_ws.py compares)."""
    return (tiles.stages * (tiles.rows * STEP * 2 + tiles.block_n * STEP * bits // 8 + 16)
            + tiles.block_n * 16 * out_bytes + 64)


def wint_ws_applies(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, bits: int,
                    group: int, tiles: WsTiles | None = None,
                    out_dtype: torch.dtype | None = None) -> bool:
    """Whether this kernel takes x [M, K] @ W^T: Gluon importable, CUDA sm_90 (wgmma), 16-bit x
    with 16-byte aligned rows, contiguous int32 words, symmetric int4 codes in groups of 64 or
    128 or per channel, or 8-bit codes per channel, K a multiple of 128 a split (two steps a
    loop pass), scales in x's dtype (the decoded weights are multiplied in it), the shared
    memory (the output in ``out_dtype``, x's by default) within SMEM_BUDGET, the output's
    offsets, the last x tile's rows included, within 32 bits, and with K split, no more output
    tiles than the arrival counters; in ``tiles``, else in every launch of ws_plan's."""
    if not (HAS_GLUON and x.is_cuda and words.is_cuda):
        return False
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return False
    m, k = x.shape
    n = words.shape[0]
    out_bytes = (out_dtype or x.dtype).itemsize
    per_channel = group >= k
    return (x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1
            and (x.stride(0) * 2) % 16 == 0 and x.data_ptr() % 16 == 0
            and words.dtype == torch.int32 and words.is_contiguous()
            and words.data_ptr() % 16 == 0
            and (bits == 4 and (per_channel or group in (64, 128) and k % group == 0)
                 or bits == 8 and per_channel)
            and scales.stride(1) == 1 and scales.dtype == x.dtype
            and -(-m // 256) * 256 * _out_width(n) < 2**31
            and all(_splits_k(k, part.tiles.split)
                    and smem_bytes(bits, part.tiles, out_bytes) <= SMEM_BUDGET
                    and (part.tiles.split == 1
                         or _tiles(m, part.rows, part.tiles) <= COUNTER_CAPACITY)
                    for part in _plan(m, n, k, x.device, bits, tiles, out_bytes)))


def _plan(m: int, n: int, k: int, device: torch.device, bits: int, tiles: WsTiles | None,
          out_bytes: int) -> tuple[WsLaunch, ...]:
    """One launch in ``tiles`` if given, else ws_plan's."""
    if tiles is not None:
        return (WsLaunch(0, n, tiles),)
    return ws_plan(m, n, k, num_sms(device), bits, out_bytes)


def wint_ws_gemm(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, bits: int,
                 group: int, out_dtype: torch.dtype | None = None,
                 tiles: WsTiles | None = None) -> torch.Tensor:
    """x [M, K] (16-bit) @ dequantized W^T -> [M, N] in ``out_dtype`` (x's by default); W's
    codes as int32 words [N, K bits / 32], scales [N, K / group] (group >= K: per channel).
    In ``tiles`` (one launch) if given, else in ws_plan's launches."""
    out_dtype = out_dtype or x.dtype
    assert wint_ws_applies(x, words, scales, bits, group, tiles, out_dtype), \
        "wint_ws_gemm does not take these inputs (see wint_ws_applies)"
    m, k = x.shape
    n = words.shape[0]
    out = torch.empty(m, _out_width(n), device=x.device, dtype=out_dtype)[:, :n]
    for row0, rows, part_tiles in _plan(m, n, k, x.device, bits, tiles, out_dtype.itemsize):
        rows_of = slice(row0, row0 + rows)
        _launch(x, words[rows_of], scales[rows_of], out[:, rows_of], bits, group, part_tiles)
    return out.contiguous()


def _launch(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
            bits: int, group: int, tiles: WsTiles) -> None:
    """One launch: x @ W^T into ``out`` [M, N] (a view whose rows may be longer than N)."""
    m, k = x.shape
    n, kw = words.shape
    step_w = STEP * bits // 32
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [tiles.block_m, STEP], _x_layout())
    # (without a second wgmma, the first's descriptor again, unread)
    x2_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [tiles.block_m2 or tiles.block_m,
                                                             STEP], _x_layout())
    w_desc = TensorDescriptor(words, [n, kw], [kw, 1], [tiles.block_n, step_w], _w_layout(bits))
    x_tiles = -(-m // tiles.rows)
    num_units = _tiles(m, n, tiles) * tiles.split
    if tiles.split > 1:  # the float32 partials, then the tile's arrival counter
        parts = torch.empty(num_units * tiles.block_n * tiles.block_m, device=x.device,
                            dtype=torch.float32)
        counters = arrival_counters(x.device)
    else:
        parts = counters = out
    launch = pdl(x.device)
    _wint_ws_kernel[(min(num_units, num_sms(x.device)),)](
        x_desc, x2_desc, w_desc, scales, out, parts, counters, m, n, kw, scales.stride(0),
        out.stride(0),
        x_tiles, num_units,
        **_constexprs(bits, group, k, tiles, launch["USE_PDL"], _shifts(m, tiles)),
        num_warps=4 * tiles.consumers, maxnreg=_maxnreg(tiles), launch_pdl=launch["launch_pdl"],
    )  # fmt: skip


def compile_sm90(bits: int, group: int, k: int, tiles: WsTiles | None = None,
                 dtype: str = "bf16", use_pdl: bool = True, out_dtype: str | None = None,
                 shift: bool = True):
    """The kernel compiled for sm_90 on any host (kiln.kernels._gluon.compile_sm90) as it is
    launched: M and the unit counts unspecialized (any row counts), N divisible by 16; x, the
    scales and (unless ``out_dtype``, as "fp32") the output in ``dtype``; ``shift``: the
    variant launched where M is no multiple of the tile's rows (_shifts)."""
    tiles = tiles or WsTiles()
    step_w = STEP * bits // 32
    sig = {"x_desc": f"tensordesc<{dtype}[{tiles.block_m}, {STEP}],{_x_layout()!r}>",
           "x2_desc": (f"tensordesc<{dtype}[{tiles.block_m2 or tiles.block_m}, {STEP}],"
                       f"{_x_layout()!r}>"),
           "w_desc": f"tensordesc<i32[{tiles.block_n}, {step_w}],{_w_layout(bits)!r}>",
           "s_ptr": f"*{dtype}", "out_ptr": f"*{out_dtype or dtype}", "part_ptr": "*fp32",
           "count_ptr": "*i32", "M": "i32", "N": "i32", "KW": "i32", "stride_sn": "i32",
           "stride_om": "i32", "x_tiles": "i32", "num_units": "i32"}
    return _gluon.compile_sm90(_wint_ws_kernel, sig,
                               _constexprs(bits, group, k, tiles, use_pdl, shift),
                               4 * tiles.consumers, maxnreg=_maxnreg(tiles),
                               unspecialized=_UNSPECIALIZED)


def _maxnreg(tiles: WsTiles) -> int:
    """Registers a thread at launch, before the partitions trade them (setmaxnreg): the
    register file (64 K) over every warpgroup, the producer's included, rounded down to 8, at
    most 240."""
    return min(240, 65536 // ((tiles.consumers + 1) * 128) // 8 * 8)

"""Batch-1 (M = 1 or 2) symmetric int4 g128 weight-only GEMV in Gluon (sm_90), weights streamed
through a TMA ring so that a chunk's int4 decode runs while the next chunks are in flight.

    y[m, n] = sum_k x[m, k] (u[n, k] - 8) s[n, k // 128]

u: 4-bit codes packed 8 per int32 along K (code k at bits 4 (k % 8) of word k // 8), words
[N, K / 8]; s: bf16 scales [N, K / 128]; x: bf16 [M, K]. Float32 accumulation; the scale
multiplies a float32 partial over 4 words instead of rounding each dequantized weight to bf16 as
``wint_linear_ref`` does (quant_gemm's CUDA-core GEMV does the same), so the two agree to bf16
rounding, not bit for bit. Every sum is in a fixed order: the same bits on every run.

A program owns ``block_n`` rows and ``num_steps * chunk_kw`` words of each (all of K unless
K is split). Its weights arrive by TMA in [block_n, chunk_kw] chunks, each completing an
mbarrier, and are decoded chunk by chunk as they land, so the decode of chunk i runs while
chunks i + 1.. are still in flight. Where a program's chunks fit in ``stages`` buffers (K = 4096
at 4 stages: 4 chunks, 32 KB) every chunk has its own buffer and all are requested at the
start, before anything else (before the PDL wait too: weights never depend on the previous
kernel); else the buffers form a ring (the default tiles' 3 stages at K = 4096: less shared
memory, more programs an SM), chunk i + stages requested as soon as every warp has chunk i's
words in registers. (quant_gemm's GEMV loads a whole tile into registers, then
decodes it: its decode ran after the words landed, benchmarks/results/h100/quant_shift3.txt.)

Decode (the FMA trick of quant_gemm._int4_code, with two shifts a word instead of three): code j
of word w is put in the mantissa of a float32 with the exponent of 1.0, at bit pos_j (codes 0-2
from w << 11 at bits 11/15/19, codes 3-4 where they are in w, at 12/16, codes 5-7 from w >> 9 at
11/15/19), so f_j = 1 + u_j 2^(pos_j - 23) and f_j (x_j 2^(19 - pos_j)) = x_j 2^(19 - pos_j) +
u_j x_j / 16: one and/or and one FMA per code, 2.25 instructions a code with the shifts. The
x_j 2^(19 - pos_j) are precomputed once per program into a shared-memory table laid out for the
decode ([step, code j, column c, word v], float32: one 16-byte load per code and 4 words), with,
per word, -D = -sum_j (x_j 2^(19 - pos_j) + x_j / 2), the FMA chain's start, so that a word's
chain ends at sum_j (u_j - 8) x_j / 16 (exact in float32 up to the FMAs' rounding: x is bf16).
Scales are precomputed likewise, one per (step, row, 4-word column), into shared memory.

Register layout: a thread holds ``rows_per_thread`` rows x 4 consecutive words of each chunk (a
16-byte shared load per row), the warp's lanes run along K first (conflict-free loads), so the
x table entries of a column serve all of a thread's rows; partial sums stay per column until
the end, where one cross-lane (and, with warps along K, cross-warp) sum per row is left.

Gluon cannot run under TRITON_INTERPRET: on CPU this module only compiles (``compile_sm90``).
It imports without triton, and with a triton whose Gluon API differs (3.6's names are used,
3.9's where they were renamed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.kernels import _gluon
from kiln.kernels._gluon import (
    HAS_GLUON,
    SMEM_BUDGET,
    TensorDescriptor,
    async_copy,
    axis_layout,
    cp_async,
    cta_barrier,
    fence_async_shared,
    gdc,
    jit,
    mbarrier,
    memdesc_reinterpret,
    tma_load,
    ttgl,
)
from kiln.kernels._triton import next_power_of_2, pdl, use_triton

GROUP = 128  # codes per scale group (the only group size this kernel takes)
MAX_M = 2  # rows of x (programs along grid axis 0: the second row reads the weights from L2)
# code j of a word sits at mantissa bit 19 - X_SHIFTS[j] after the decode's shifts; its x is
# stored times 2^X_SHIFTS[j] (the kernel computes the same list from j)
X_SHIFTS = (8, 4, 0, 7, 3, 8, 4, 0)


@dataclass(frozen=True)
class W4GemvConfig:
    """Tiles of ``_w4_gemv_kernel``.

    block_n rows a program; chunk_kw int32 words of each row a ring stage (16 to 256, a
    multiple of 16: whole scale groups); stages ring buffers; split_k programs sharing a row's K
    (> 1: float32 partials added after, in split order). Lanes run along K (chunk_kw / 4 of
    them, at most 32), then warps along K (chunk_kw / 128), the rest along rows; each thread
    takes rows_per_thread = block_n / (lanes along rows x warps along rows) rows."""

    block_n: int = 16
    chunk_kw: int = 128
    stages: int = 4
    num_warps: int = 4
    split_k: int = 1

    def __post_init__(self):
        if self.chunk_kw not in (16, 32, 64, 128, 256):
            raise ValueError(f"chunk_kw={self.chunk_kw}: one of 16, 32, 64, 128, 256 words")
        if self.num_warps not in (1, 2, 4, 8) or self.num_warps % self.warps_k:
            raise ValueError(f"num_warps={self.num_warps}: 1, 2, 4 or 8 and a multiple of "
                             f"warps_k={self.warps_k} (chunk_kw / 128)")
        if self.block_n % (self.lanes_n * self.warps_n) or self.block_n > 256:
            raise ValueError(f"block_n={self.block_n}: a multiple of {self.lanes_n * self.warps_n} "
                             f"(lanes x warps along rows at chunk_kw={self.chunk_kw}, "
                             f"num_warps={self.num_warps}), at most 256")
        if self.stages < 1 or self.split_k < 1:
            raise ValueError(f"stages={self.stages}, split_k={self.split_k}: both >= 1")

    @property
    def lanes_k(self) -> int:
        return min(32, self.chunk_kw // 4)

    @property
    def lanes_n(self) -> int:
        return 32 // self.lanes_k

    @property
    def warps_k(self) -> int:
        return max(1, self.chunk_kw // 128)

    @property
    def warps_n(self) -> int:
        return self.num_warps // self.warps_k

    @property
    def rows_per_thread(self) -> int:
        return self.block_n // (self.lanes_n * self.warps_n)


@dataclass(frozen=True)
class W4GemvPlan:
    """What a launch of ``config`` over K = k takes: steps a program, programs along K."""

    config: W4GemvConfig
    num_steps: int
    split: int
    smem_bytes: int


def plan(config: W4GemvConfig, k: int) -> W4GemvPlan:
    kw = k // 8
    split = min(config.split_k, -(-kw // config.chunk_kw))
    steps = -(-kw // (split * config.chunk_kw))
    split = -(-kw // (steps * config.chunk_kw))  # no program without words
    return W4GemvPlan(config, steps, split, _smem_bytes(config, steps))


def _smem_bytes(cfg: W4GemvConfig, steps: int) -> int:
    """Ring + x tables + x staging + scale table + mbarriers: an upper bound of what the
    compiler allocates, within 256 bytes (tests/kernels/test_w4_gemv.py checks it; separate
    mbarrier allocations are padded)."""
    nc = cfg.chunk_kw // 4
    buffers = min(cfg.stages, steps)
    ring = buffers * cfg.block_n * cfg.chunk_kw * 4
    table = steps * 9 * nc * 4 * 4  # xt and dt
    staging = next_power_of_2(steps) * cfg.chunk_kw * 8 * 2
    scales = next_power_of_2(steps) * cfg.block_n * nc * 2
    return ring + table + staging + scales + 16 * (buffers + 1)


@jit
def _code_fma(t, mask: ttgl.constexpr, one, xw, p):
    """p + f xw for the code under ``mask`` in t (its mantissa bits), f = 1 + u 2^(pos - 23)."""
    f = ((t & mask) | one).to(ttgl.float32, bitcast=True)
    f, xw = ttgl.broadcast(f, xw)
    f, p = ttgl.broadcast(f, p)
    return ttgl.fma(f, xw, p)  # explicit: triton 3.10 stops fusing a * b + c by default


@jit
def _split8(t):
    """[..., 8] -> its 8 planes [...], in order (in-register splits)."""
    even, odd = ttgl.split(ttgl.reshape(t, t.shape[:-1] + [2, 2, 2]))
    e0, e1 = ttgl.split(even)  # codes 4 p, 4 p + 2
    o0, o1 = ttgl.split(odd)  # codes 4 p + 1, 4 p + 3
    c0, c4 = ttgl.split(e0)
    c2, c6 = ttgl.split(e1)
    c1, c5 = ttgl.split(o0)
    c3, c7 = ttgl.split(o1)
    return c0, c1, c2, c3, c4, c5, c6, c7


@jit
def _decode_step(acc, words, xt, dt, st, i, one, L3: ttgl.constexpr, LOAD_ONLY: ttgl.constexpr):
    """acc [BLOCK_N, NC] += s (sum over a column's 4 words of sum_j (u_j - 8) x_j / 16) for
    chunk i's words [BLOCK_N, NC, 4]. LOAD_ONLY (benchmarks: the floor of this structure, wrong
    results): the words only summed as integers."""
    if LOAD_ONLY:
        return acc + ttgl.sum(words, axis=2).to(ttgl.float32)
    LX: ttgl.constexpr = ttgl.SliceLayout(0, L3)
    t0 = words << 11
    t2 = words >> 9
    p = dt.index(i).load(LX)[None, :, :]  # the chains start at -D
    p = _code_fma(t0, 0x7800, one, xt.index(i * 8 + 0).load(LX)[None, :, :], p)
    p = _code_fma(t0, 0x78000, one, xt.index(i * 8 + 1).load(LX)[None, :, :], p)
    p = _code_fma(t0, 0x780000, one, xt.index(i * 8 + 2).load(LX)[None, :, :], p)
    p = _code_fma(words, 0xF000, one, xt.index(i * 8 + 3).load(LX)[None, :, :], p)
    p = _code_fma(words, 0xF0000, one, xt.index(i * 8 + 4).load(LX)[None, :, :], p)
    p = _code_fma(t2, 0x7800, one, xt.index(i * 8 + 5).load(LX)[None, :, :], p)
    p = _code_fma(t2, 0x78000, one, xt.index(i * 8 + 6).load(LX)[None, :, :], p)
    p = _code_fma(t2, 0x780000, one, xt.index(i * 8 + 7).load(LX)[None, :, :], p)
    # p = sum_j (u_j - 8) x_j / 16 per word; a column's 4 words share their scale
    scale = st.index(i).load(ttgl.SliceLayout(2, L3)).to(ttgl.float32)
    return ttgl.fma(scale, ttgl.sum(p, axis=2), acc)


@jit
def _w4_gemv_kernel(
    w_desc, x_ptr, s_ptr, out_ptr,
    N, K, stride_xm, stride_sn, stride_om, stride_os,
    BLOCK_N: ttgl.constexpr, CHUNK_KW: ttgl.constexpr, NUM_STEPS: ttgl.constexpr,
    NUM_STAGES: ttgl.constexpr, ROWS_T: ttgl.constexpr, LANES_N: ttgl.constexpr,
    WARPS_N: ttgl.constexpr, WARPS_K: ttgl.constexpr, SCALE_STEPS: ttgl.constexpr,
    EVEN_K: ttgl.constexpr, LOAD_ONLY: ttgl.constexpr, USE_PDL: ttgl.constexpr,
):  # fmt: skip
    """y[m, rows] over this program's K range (program ids: m, row tile, K split); stores y,
    or with split K the float32 partial at out_ptr + pid_k stride_os."""
    NC: ttgl.constexpr = CHUNK_KW // 4  # 4-word columns in a chunk row
    GPS: ttgl.constexpr = CHUNK_KW // 16  # scale groups in a chunk row
    LANES_K: ttgl.constexpr = 32 // LANES_N
    NUM_WARPS: ttgl.constexpr = WARPS_N * WARPS_K
    CHUNK_BYTES: ttgl.constexpr = BLOCK_N * CHUNK_KW * 4
    # the decode: [rows, columns, 4 words]; a thread: ROWS_T rows x one column
    L2: ttgl.constexpr = ttgl.BlockedLayout([ROWS_T, 4], [LANES_N, LANES_K], [WARPS_N, WARPS_K],
                                            [1, 0])
    L3: ttgl.constexpr = ttgl.BlockedLayout([ROWS_T, 1, 4], [LANES_N, LANES_K, 1],
                                            [WARPS_N, WARPS_K, 1], [2, 1, 0])
    LP: ttgl.constexpr = ttgl.SliceLayout(2, L3)  # [BLOCK_N, NC]: column partials, scales
    # the prologue's x tiles [NC, 4, 8] (a thread: the 8 codes of one word) and scales
    LB: ttgl.constexpr = ttgl.BlockedLayout([1, 1, 8], [8, 4, 1], [NUM_WARPS, 1, 1], [2, 1, 0])
    LC: ttgl.constexpr = ttgl.BlockedLayout([1, 1, 1, 8], [1, 8, 4, 1], [1, NUM_WARPS, 1, 1],
                                            [3, 2, 1, 0])
    LS: ttgl.constexpr = ttgl.BlockedLayout([1, 1, GPS], [2, 16, 1], [NUM_WARPS, 1, 1],
                                            [2, 1, 0])
    # unswizzled shared layouts: of a buffer's full rank (stored whole) or one below (indexed)
    PLAIN2: ttgl.constexpr = ttgl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    PLAIN3: ttgl.constexpr = ttgl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    PLAIN4: ttgl.constexpr = ttgl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])

    pid_m = ttgl.program_id(0)
    row0 = ttgl.program_id(1) * BLOCK_N
    pid_k = ttgl.program_id(2)
    kw0 = pid_k * (NUM_STEPS * CHUNK_KW)

    # 1. the weights: the first NUM_STAGES chunks requested before anything else
    if NUM_STEPS <= NUM_STAGES:  # every chunk its own buffer and mbarrier, all requested now
        # (separate allocations: the compiler's barriers see them as independent)
        bars = ()
        bufs = ()
        for _ in ttgl.static_range(NUM_STEPS):
            bars = bars + (ttgl.allocate_shared_memory(ttgl.int64, [1],
                                                       mbarrier.MBarrierLayout()),)
            bufs = bufs + (ttgl.allocate_shared_memory(ttgl.int32, [BLOCK_N, CHUNK_KW],
                                                       w_desc.layout),)
        for s in ttgl.static_range(NUM_STEPS):
            mbarrier.init(bars[s], count=1)
        for s in ttgl.static_range(NUM_STEPS):
            mbarrier.expect(bars[s], CHUNK_BYTES)
        for s in ttgl.static_range(NUM_STEPS):
            tma_load(w_desc, [row0, kw0 + s * CHUNK_KW], bars[s], bufs[s])
    else:  # a ring of NUM_STAGES buffers
        ring = ttgl.allocate_shared_memory(ttgl.int32, [NUM_STAGES, BLOCK_N, CHUNK_KW],
                                           w_desc.layout)
        ring_bars = ttgl.allocate_shared_memory(ttgl.int64, [NUM_STAGES, 1],
                                                mbarrier.MBarrierLayout())
        for s in ttgl.static_range(NUM_STAGES):
            mbarrier.init(ring_bars.index(s), count=1)
        for s in ttgl.static_range(NUM_STAGES):
            mbarrier.expect(ring_bars.index(s), CHUNK_BYTES)
            tma_load(w_desc, [row0, kw0 + s * CHUNK_KW], ring_bars.index(s), ring.index(s))
    # scales (weights too: before the PDL wait) into registers: [step, row, group of the step]
    si = ttgl.arange(0, SCALE_STEPS, layout=axis_layout(LS, 0))
    sr = ttgl.arange(0, BLOCK_N, layout=axis_layout(LS, 1))
    sg = ttgl.arange(0, GPS, layout=axis_layout(LS, 2))
    g = (pid_k * (NUM_STEPS * GPS) + si * GPS)[:, None, None] + sg[None, None, :]
    rows_s = row0 + sr[None, :, None]
    s_mask = (si < NUM_STEPS)[:, None, None] & (rows_s < N)
    if not EVEN_K:  # else every step's groups are in the row, and the loads vectorize
        s_mask = s_mask & (g < K // 128)
    s_vals = ttgl.load(s_ptr + rows_s.to(ttgl.int64) * stride_sn + g, mask=s_mask, other=0.0)

    if USE_PDL:
        gdc(True)
        gdc(False)

    # 2. x (written by the previous kernel), staged by cp.async in one go (steps padded to a
    # power of two, zero-filled): [step, column, word, code]
    xs = ttgl.allocate_shared_memory(ttgl.bfloat16, [SCALE_STEPS, NC, 4, 8], PLAIN4)
    bi = ttgl.arange(0, SCALE_STEPS, layout=axis_layout(LC, 0))
    bc = ttgl.arange(0, NC, layout=axis_layout(LC, 1))
    bv = ttgl.arange(0, 4, layout=axis_layout(LC, 2))
    bw = ttgl.arange(0, 8, layout=axis_layout(LC, 3))
    k = ((kw0 + bi[:, None, None, None] * CHUNK_KW + bc[None, :, None, None] * 4
          + bv[None, None, :, None]) * 8 + bw[None, None, None, :])
    cp_async(xs, x_ptr + pid_m * stride_xm + k,
              mask=(bi < NUM_STEPS)[:, None, None, None] & (k < K))
    xs = memdesc_reinterpret(xs, ttgl.bfloat16, [SCALE_STEPS, NC, 4, 8], PLAIN3)
    bj = ttgl.arange(0, 8, layout=axis_layout(LB, 2))
    async_copy.commit_group()
    # meanwhile the scales, each repeated for the 4 columns of its group: [step, row, column]
    s2 = ttgl.join(s_vals, s_vals)
    st = ttgl.allocate_shared_memory(ttgl.bfloat16, [SCALE_STEPS, BLOCK_N, NC], PLAIN3,
                                     ttgl.reshape(ttgl.join(s2, s2), [SCALE_STEPS, BLOCK_N, NC]))
    st = memdesc_reinterpret(st, ttgl.bfloat16, [SCALE_STEPS, BLOCK_N, NC], PLAIN2)
    async_copy.wait_group(0)
    cta_barrier()

    # the decode's x tables: xt [step * 8 + code j, column, word] = x_j 2^X_SHIFTS[j]
    # (built as [step][column, word, j] through a permuted view), dt [step, column, word] = -D
    xt = ttgl.allocate_shared_memory(ttgl.float32, [NUM_STEPS * 8, NC, 4], PLAIN2)
    xt_build = memdesc_reinterpret(xt, ttgl.float32, [NUM_STEPS, 8, NC, 4], PLAIN3)
    dt = ttgl.allocate_shared_memory(ttgl.float32, [NUM_STEPS, NC, 4], PLAIN2)
    shift = ttgl.where(bj < 3, 8 - 4 * bj, ttgl.where(bj < 5, 19 - 4 * bj, 28 - 4 * bj))
    mult = (1 << shift).to(ttgl.float32)[None, None, :]
    for i in range(NUM_STEPS):
        xv = xs.index(i).load(LB).to(ttgl.float32)
        xw = xv * mult
        xt_build.index(i).permute([1, 2, 0]).store(xw)
        dt.index(i).store(-ttgl.sum(xw + 0.5 * xv, axis=2))
    cta_barrier()

    # 3. decode chunk i while chunks i + 1 .. i + NUM_STAGES - 1 land
    # 1.0f's bits as a run-time value (K > 0): an immediate is re-materialized before every use
    one = (K >> 31) + 0x3F800000
    acc = ttgl.zeros([BLOCK_N, NC], ttgl.float32, LP)
    if NUM_STEPS <= NUM_STAGES:  # unrolled: static buffers
        for i in ttgl.static_range(NUM_STEPS):
            mbarrier.wait(bars[i], 0)
            words = ttgl.convert_layout(
                ttgl.reshape(bufs[i].load(L2), [BLOCK_N, NC, 4]), L3, assert_trivial=True)
            acc = _decode_step(acc, words, xt, dt, st, i, one, L3, LOAD_ONLY)
        for s in ttgl.static_range(NUM_STEPS):
            mbarrier.invalidate(bars[s])
    else:
        for i in range(NUM_STEPS):
            stage = i % NUM_STAGES
            mbarrier.wait(ring_bars.index(stage), (i // NUM_STAGES) & 1)
            words = ttgl.convert_layout(
                ttgl.reshape(ring.index(stage).load(L2), [BLOCK_N, NC, 4]), L3,
                assert_trivial=True)
            # refill the buffer with chunk i + NUM_STAGES once every warp's words are in
            # registers (the compiler inserts the same barrier and fence: explicit here)
            cta_barrier()
            fence_async_shared()
            refill = i + NUM_STAGES < NUM_STEPS
            mbarrier.expect(ring_bars.index(stage), CHUNK_BYTES, pred=refill)
            tma_load(w_desc, [row0, kw0 + (i + NUM_STAGES) * CHUNK_KW], ring_bars.index(stage),
                      ring.index(stage), pred=refill)
            acc = _decode_step(acc, words, xt, dt, st, i, one, L3, LOAD_ONLY)
        for s in ttgl.static_range(NUM_STAGES):
            mbarrier.invalidate(ring_bars.index(s))

    y = ttgl.sum(acc, axis=1) * 16.0
    rows = row0 + ttgl.arange(0, BLOCK_N, layout=ttgl.SliceLayout(1, LP))
    out = out_ptr + pid_k * stride_os + pid_m * stride_om + rows
    ttgl.store(out, y.to(out_ptr.dtype.element_ty), mask=rows < N)


def _word_layout():
    """The chunks' shared layout: plain row-major (16-byte loads along a row conflict-free)."""
    return ttgl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _constexprs(cfg: W4GemvConfig, k: int, steps: int, split: int, use_pdl: bool,
                load_only: bool = False) -> dict:
    return dict(BLOCK_N=cfg.block_n, CHUNK_KW=cfg.chunk_kw, NUM_STEPS=steps,
                NUM_STAGES=min(cfg.stages, steps), ROWS_T=cfg.rows_per_thread, LANES_N=cfg.lanes_n,
                WARPS_N=cfg.warps_n, WARPS_K=cfg.warps_k, SCALE_STEPS=next_power_of_2(steps),
                EVEN_K=steps * split * cfg.chunk_kw * 8 == k, LOAD_ONLY=load_only,
                USE_PDL=use_pdl)


def w4_gemv_config(n: int, k: int) -> W4GemvConfig:
    """From the H100 sweeps (benchmarks/results/h100/w4_gemv.txt): 16 rows and 128-word chunks
    in 4 warps through 3 stages, at qkv 6.34 us (72.5% of copy; 7.28 with 4 stages, every chunk
    of K = 4096 in flight, but fewer programs an SM) and o_proj 4.13 us (74.1%; 4.41 for the
    next best, 32 rows in 8 warps). K split in two where one program's tables would leave room
    for fewer than two programs an SM (down_proj's K; quant_gemm keeps that shape)."""
    cfg = W4GemvConfig(16, 128, 3, 4)
    if plan(cfg, k).smem_bytes > SMEM_BUDGET // 2:
        cfg = W4GemvConfig(16, 128, 3, 4, split_k=2)
    return cfg


def w4_gemv_applies(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                    config: W4GemvConfig | None = None) -> bool:
    """Whether ``w4_gemv`` takes x [M, K] against int4 words [N, K / 8] with g128 scales: Gluon
    importable, CUDA sm_90+, bf16 x with M <= MAX_M, 16-byte aligned rows and unit stride,
    contiguous 16-byte aligned int32 words (TMA), bf16 scales [N, K / 128] with unit stride, K
    a multiple of 128, and the program's shared memory within one SM's."""
    if not (HAS_GLUON and use_triton(x, words, scales)):
        return False
    if torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    if x.dim() != 2 or words.dim() != 2 or scales.dim() != 2:
        return False
    m, k = x.shape
    n, kw = words.shape
    return (x.dtype == torch.bfloat16 and 1 <= m <= MAX_M and x.stride(1) == 1 and k % GROUP == 0
            and x.data_ptr() % 16 == 0 and (m == 1 or x.stride(0) % 8 == 0)  # 16-byte cp.async
            and words.dtype == torch.int32 and kw * 8 == k and words.is_contiguous()
            and words.data_ptr() % 16 == 0 and scales.dtype == torch.bfloat16
            and scales.shape == (n, k // GROUP) and scales.stride(1) == 1
            and plan(config or w4_gemv_config(n, k), k).smem_bytes <= SMEM_BUDGET)


def w4_gemv(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
            out_dtype: torch.dtype | None = None,
            config: W4GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] bf16 (M <= 2) @ dequantized W^T -> [M, N] in ``out_dtype`` (x's by default).
    W's codes as int32 words [N, K / 8], scales bf16 [N, K / 128] (see w4_gemv_applies)."""
    return _launch(x, words, scales, out_dtype, config)


def _launch(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
            out_dtype: torch.dtype | None, config: W4GemvConfig | None,
            load_only: bool = False) -> torch.Tensor:
    """w4_gemv; load_only: the kernel without its decode (benchmarks/w4_gemv_bench.py's floor)."""
    m, k = x.shape
    n, kw = words.shape
    cfg = config or w4_gemv_config(n, k)
    p = plan(cfg, k)
    assert w4_gemv_applies(x, words, scales, cfg), "w4_gemv does not take these inputs"
    out_dtype = out_dtype or x.dtype
    if p.split > 1:
        out = torch.empty(p.split, m, n, device=x.device, dtype=torch.float32)
    else:
        out = torch.empty(m, n, device=x.device, dtype=out_dtype)
    desc = TensorDescriptor(words, [n, kw], [kw, 1], [cfg.block_n, cfg.chunk_kw],
                                 _word_layout())
    launch = pdl(x.device)
    grid = (m, -(-n // cfg.block_n), p.split)
    _w4_gemv_kernel[grid](
        desc, x, scales, out, n, k, x.stride(0), scales.stride(0), out.stride(-2),
        out.stride(0) if p.split > 1 else 0,
        **_constexprs(cfg, k, p.num_steps, p.split, launch["USE_PDL"], load_only),
        num_warps=cfg.num_warps, launch_pdl=launch["launch_pdl"],
    )  # fmt: skip
    return out.sum(0).to(out_dtype) if p.split > 1 else out


def compile_sm90(config: W4GemvConfig, k: int, out_dtype: str = "bf16", use_pdl: bool = True,
                 load_only: bool = False):
    """The kernel compiled for sm_90 on any host (no GPU needed): triton's CompiledKernel, whose
    asm holds ttgir / ptx / cubin. Integer arguments specialized as a launch would (divisible by
    16) except N, for odd row counts."""
    p = plan(config, k)
    layout = _word_layout()
    sig = {"w_desc": f"tensordesc<i32[{config.block_n}, {config.chunk_kw}],{layout!r}>",
           "x_ptr": "*bf16", "s_ptr": "*bf16",
           "out_ptr": "*fp32" if p.split > 1 else f"*{out_dtype}",
           "N": "i32", "K": "i32", "stride_xm": "i32", "stride_sn": "i32", "stride_om": "i32",
           "stride_os": "i32"}
    consts = _constexprs(config, k, p.num_steps, p.split, use_pdl, load_only)
    return _gluon.compile_sm90(_w4_gemv_kernel, sig, consts, config.num_warps, unspecialized=("N",))

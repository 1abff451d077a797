"""The decode-batch GEMM on Hopper (sm_90), Gluon: weights streamed by TMA into wgmma, the
(tile, K step) work split evenly over one program per SM (stream-K).

    y[m, n] = sum_k x[m, k] w[n, k] (+ b[n])        x: [M, K], w: [N, K], 16-bit, M <= 64
    gated (w a merged [gate; up] projection): y[m, j] = silu(gate) * up, as gemm.py's epilogue

At a few dozen rows a GEMM is bound by streaming the weights, and gemm.py's Triton kernel falls
short of it in two ways (benchmarks/results/h100/gemm_sweep.txt): each program re-reads the
activation block [M, K] through L2 for every BLOCK_N weight rows, so its narrow tiles (32-64
rows, for enough programs on N = 4096) move 1-2 bytes of activations per weight byte and the L2
saturates (o_proj at 2.3 TB/s); and its tiles fill the SMs unevenly (qkv: 96 tiles on 132 SMs).

Here the product is computed transposed (swap-AB): y^T tile [BLOCK_N, BM] = W tile [BLOCK_N, BK]
(wgmma's A, from shared memory) @ x^T [BK, BM] (B: x's [BM, BK] tile, a transposed view), BM =
16, 32 or 64 rows of x, so a 128-row weight tile moves at most half a byte of activations per
weight byte. The work is the list of (output tile, K step) units, tile-major; program p of P
(P = SMs) takes units [p U / P, (p + 1) U / P), so every SM streams the same number of weight
bytes whatever N is. Its units pass through one TMA ring (STAGES deep, one mbarrier a stage)
without a break at tile boundaries: the next tile's first steps are in flight while the last
ones of the current tile are multiplied.

A tile whose K steps one program covers is stored from its accumulator. A tile shared by
programs (at most the first and last tile of a program's range) is finished by the last of them
to arrive: each stores its float32 partial (slot 0: its range's first tile, 1: its last), counts
its arrival in the tile's counter (kiln.kernels._triton.arrival_counters), and the last sums the
partials of the tile's programs in program order and resets the counter. The split depends on
N, K and the SM count only, never on M or timing: the same bits for a row at any batch size, on
every run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kiln.kernels._gluon import (
    HAS_GLUON,
    GluonTensorDescriptor,
    compile_sm90,
    constexpr_function,
    cta_barrier,
    gdc,
    mbarrier,
    tma_load,
    ttgl,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from kiln.kernels._gluon import jit as _jit
from kiln.kernels._triton import COUNTER_CAPACITY, arrival_counters, num_sms, pdl, use_triton
from kiln.kernels.activation import silu_mul

BOX_K = 64  # K of a TMA box: a 128-byte row of 16-bit elements (the widest swizzle)
# K steps into its next tile after which a program counts the partial it stored at the end of
# its first one (by then the stores have landed, and the count's fence does not wait for them)
ARRIVE_AFTER = ttgl.constexpr(2) if HAS_GLUON else 2
MAX_M = BLOCK_M = 64  # rows of x this kernel takes (wgmma's M: one warpgroup)
SMEM_BUDGET = 227 * 1024  # shared memory an H100 block may use
_GL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Sm90Tiles:
    """block_n rows of the wgmma's B (its N) and ``rows`` the weight rows an output tile takes
    (0: block_n; gated: ``rows`` gate rows in the first half of block_n, as many up rows in the
    second; fewer rows than block_n leave the rest of the wgmma unused), stages TMA ring depth
    (a stage: BOX_K of K), num_warps 4 (one warpgroup: x's BM = 64 rows)."""

    block_n: int = 64
    stages: int = 24
    num_warps: int = 4
    rows: int = 0

    def __post_init__(self):
        if self.block_n not in (64, 128, 256):
            raise ValueError(f"block_n={self.block_n}: 64, 128 or 256")
        if self.num_warps != 4 or self.stages < 2:
            raise ValueError(f"num_warps={self.num_warps}, stages={self.stages}: 4 warps (x's "
                             f"64 rows), at least 2 stages")
        if self.rows % 16 or self.rows > self.block_n:
            raise ValueError(f"rows={self.rows}: a multiple of 16 (TMA boxes of 16 rows), at "
                             f"most block_n={self.block_n}")

    def tile_rows(self, gated: bool) -> int:
        """Output columns a tile: weight rows, or gate / up row pairs."""
        full = self.block_n // 2 if gated else self.block_n
        return min(self.rows, full) if self.rows else full

    def smem_bytes(self) -> int:
        """The weight ring and its mbarriers."""
        return self.stages * (self.block_n * BOX_K * 2 + 8)


@constexpr_function
def _loads_in_flight(tile_elements, num_warps):
    """Partial tiles a thread may load at once: 64 registers of values (and twice that of
    addresses)."""
    return max(1, 64 * 32 * num_warps // tile_elements)


@constexpr_function
def _acc_layout(block_n, num_warps):
    """wgmma's accumulator [BM, BN]: warps along x's rows, one instruction as wide as the
    tile's weight rows."""
    return ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                       instr_shape=[16, block_n, 16])


if HAS_GLUON:

    @_jit
    def _issue(w_desc, w_bufs, bars, unit, i, k_steps, half_n, ROWS: ttgl.constexpr,
               GATED: ttgl.constexpr, STAGES: ttgl.constexpr, pred):
        """TMA copies of work unit ``unit``'s ROWS weight rows (tile unit // k_steps, K step
        unit % k_steps) into ring stage i % STAGES, in boxes of the descriptor's rows. Gated:
        gate rows into the wgmma tile's first half, up rows (half_n further) into its second."""
        stage = i % STAGES
        bar = bars.index(stage)
        BOX_ROWS: ttgl.constexpr = w_desc.block_type.shape[0]
        BOXES: ttgl.constexpr = ROWS // BOX_ROWS
        BN: ttgl.constexpr = w_bufs.shape[1]  # rows of the wgmma
        W_BYTES: ttgl.constexpr = w_desc.block_type.nbytes * BOXES * (2 if GATED else 1)
        mbarrier.expect(bar, W_BYTES, pred=pred)
        row = (unit // k_steps) * ROWS
        k = (unit % k_steps) * w_desc.block_type.shape[1]
        w_buf = w_bufs.index(stage)
        for b in ttgl.static_range(BOXES):
            tma_load(w_desc, [row + b * BOX_ROWS, k], bar, w_buf.slice(b * BOX_ROWS, BOX_ROWS),
                     pred)
            if GATED:
                tma_load(w_desc, [half_n + row + b * BOX_ROWS, k], bar,
                         w_buf.slice(BN // 2 + b * BOX_ROWS, BOX_ROWS), pred)

    @_jit
    def _load_x(x_ptr, stride_xm, M, unit, k_steps, lo, BM: ttgl.constexpr, BK: ttgl.constexpr,
                A: ttgl.constexpr):
        """x's [BM, BK] tile of work unit ``unit`` (zeros past M, or for a unit before lo) into
        registers, as wgmma's A operand."""
        rows = ttgl.arange(0, BM, layout=ttgl.SliceLayout(1, A))
        cols = (unit % k_steps) * BK + ttgl.arange(0, BK, layout=ttgl.SliceLayout(0, A))
        mask = (rows < M)[:, None] & ((cols >= 0) & (unit >= lo))[None, :]
        return ttgl.load(x_ptr + rows[:, None].to(ttgl.int64) * stride_xm + cols[None, :],
                         mask=mask, other=0.0)

    @_jit
    def _store_tile(acc, tile, bias_ptr, y_ptr, M, N, stride_ym, ROWS: ttgl.constexpr,
                    HAS_BIAS: ttgl.constexpr, GATED: ttgl.constexpr):
        """acc [BM, BN] float32 (output tile ``tile``, its first ROWS columns) -> y [M, N or
        N / 2], straight from the registers. Gated, acc's first half of columns holds the gate
        rows' and its second the up rows', and a thread holds column c of each (the wgmma
        layout repeats every 8 columns)."""
        BM: ttgl.constexpr = acc.shape[0]
        BN: ttgl.constexpr = acc.shape[1]
        dt: ttgl.constexpr = y_ptr.dtype.element_ty
        if GATED:
            gate, up = ttgl.split(ttgl.permute(ttgl.reshape(acc, [BM, 2, BN // 2]), (0, 2, 1)))
            L: ttgl.constexpr = gate.type.layout
            local = ttgl.arange(0, BN // 2, layout=ttgl.SliceLayout(0, L))
            cols = tile * ROWS + local
            rows = ttgl.arange(0, BM, layout=ttgl.SliceLayout(1, L))
            n_valid = N // 2
            if HAS_BIAS:
                gate += ttgl.load(bias_ptr + cols, mask=cols < n_valid, other=0.0).to(
                    ttgl.float32)[None, :]
                up += ttgl.load(bias_ptr + n_valid + cols, mask=cols < n_valid, other=0.0).to(
                    ttgl.float32)[None, :]
            y = silu_mul(gate, up, dt)
        else:
            ACC: ttgl.constexpr = acc.type.layout
            local = ttgl.arange(0, BN, layout=ttgl.SliceLayout(0, ACC))
            cols = tile * ROWS + local
            rows = ttgl.arange(0, BM, layout=ttgl.SliceLayout(1, ACC))
            y = acc
            n_valid = N
            if HAS_BIAS:
                y += ttgl.load(bias_ptr + cols, mask=cols < n_valid, other=0.0).to(
                    ttgl.float32)[None, :]
        ptrs = y_ptr + rows[:, None].to(ttgl.int64) * stride_ym + cols[None, :]
        col_mask = (local < ROWS) & (cols < n_valid)
        ttgl.store(ptrs, y.to(dt), mask=(rows < M)[:, None] & col_mask[None, :])

    @_jit
    def _tile_offsets(R: ttgl.constexpr, C: ttgl.constexpr, L: ttgl.constexpr):
        """[R, C] offsets of a partial tile's elements in layout L (rebuilt where needed: kept
        live through the K loop they would take registers from it)."""
        return (ttgl.arange(0, R, layout=ttgl.SliceLayout(1, L))[:, None] * C
                + ttgl.arange(0, C, layout=ttgl.SliceLayout(0, L))[None, :])

    @_jit
    def _part_ptrs(part_ptr, q, tile_lo, num_units, num_programs, local):
        """Where program q keeps its partial of the tile starting at unit tile_lo: slot 0 if
        the tile holds the start of q's range, else slot 1 (it holds the end)."""
        slot = ((q * num_units) // num_programs < tile_lo).to(ttgl.int32)
        return part_ptr + (q * 2 + slot).to(ttgl.int64) * (local.shape[0] * local.shape[1]) + local

    @_jit
    def _arrive(tile, count_ptr):
        """Count this program's stored partial of ``tile`` (release: the stores before it)."""
        cta_barrier()  # every thread's partial stored before the arrival is counted
        ttgl.atomic_add(count_ptr + tile, 1, sem="release")

    @_jit
    def _finish_tile(acc, seg_lo, seg_hi, lo, pid, num_programs, num_units, k_steps,
                     part_ptr, count_ptr, bias_ptr, y_ptr, M, N, stride_ym, ROWS: ttgl.constexpr,
                     HAS_BIAS: ttgl.constexpr, GATED: ttgl.constexpr):
        """The program's units [seg_lo, seg_hi) of one tile are in acc: store the tile if they
        are all of its K steps, else take part in summing the tile's partials. Returns the tile
        if this program stored its partial and has yet to count it (_arrive), else -1.

        The tile's programs are first..last (those holding its first and its last unit). Each
        runs its range backwards, so ``last`` reaches the tile at the end of its run and every
        other one earlier (the tile holds the end of their ranges). Each but ``last`` stores its
        partial and counts it, a few K steps into its next tile, once the stores have landed (so
        that the count's fence does not stall the stream). ``last`` waits for the count, then
        adds the partials in program order and its own accumulator after them. It waits only
        on programs of lower index, which the GPU starts no later than itself: no deadlock
        even where the programs do not all fit on the GPU at once."""
        ACC: ttgl.constexpr = acc.type.layout
        tile = seg_lo // k_steps
        tile_lo = tile * k_steps
        pending = -1
        if (seg_lo == tile_lo) & (seg_hi == tile_lo + k_steps):
            _store_tile(acc, tile, bias_ptr, y_ptr, M, N, stride_ym, ROWS, HAS_BIAS, GATED)
        else:
            first = ((tile_lo + 1) * num_programs - 1) // num_units
            last = ((tile_lo + k_steps) * num_programs - 1) // num_units
            local = _tile_offsets(acc.shape[0], acc.shape[1], ACC)
            if pid == last:
                counter = count_ptr + tile
                while ttgl.atomic_add(counter, 0, sem="acquire") < last - first:
                    pass
                UNROLL: ttgl.constexpr = _loads_in_flight(acc.shape[0] * acc.shape[1],
                                                          ttgl.num_warps())
                total = ttgl.zeros(acc.shape, ttgl.float32, ACC)
                for base in range(first, last, UNROLL):  # UNROLL loads in flight at a time
                    for j in ttgl.static_range(UNROLL):
                        q = base + j
                        total += ttgl.load(
                            _part_ptrs(part_ptr, q, tile_lo, num_units, num_programs, local),
                            mask=(local >= 0) & (q < last), other=0.0, cache_modifier=".cg")
                _store_tile(total + acc, tile, bias_ptr, y_ptr, M, N, stride_ym, ROWS,
                            HAS_BIAS, GATED)
                ttgl.atomic_xchg(counter, 0)
            else:
                ttgl.store(_part_ptrs(part_ptr, pid, tile_lo, num_units, num_programs, local),
                           acc)
                pending = tile
        return pending

    # the batch size changes every step and the unit counts with the layer: one compile serves
    @_jit(do_not_specialize=["M", "N", "num_tiles", "k_steps"])
    def _gemm_sm90_kernel(
        w_desc, x_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, M, N, num_tiles, k_steps,
        stride_xm, stride_ym, HAS_BIAS: ttgl.constexpr, GATED: ttgl.constexpr,
        STAGES: ttgl.constexpr, BN: ttgl.constexpr, ROWS: ttgl.constexpr, BM: ttgl.constexpr,
        USE_PDL: ttgl.constexpr,
    ):  # fmt: skip
        """Program p's units [p U / P, (p + 1) U / P) of the U = num_tiles x k_steps units."""
        BK: ttgl.constexpr = w_desc.block_type.shape[1]
        dt: ttgl.constexpr = w_desc.dtype
        ACC: ttgl.constexpr = _acc_layout(BN, ttgl.num_warps())
        A: ttgl.constexpr = ttgl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)

        w_bufs = ttgl.allocate_shared_memory(dt, [STAGES, BN, BK], w_desc.layout)
        bars = ttgl.allocate_shared_memory(ttgl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in ttgl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)

        pid = ttgl.program_id(0)
        num_programs = ttgl.num_programs(0)
        num_units = num_tiles * k_steps
        lo = pid * num_units // num_programs
        count = (pid + 1) * num_units // num_programs - lo  # >= 1: the host's P <= U
        hi = lo + count
        half_n = N // 2
        # the first units' weights before the PDL wait (they never depend on the kernel before)
        for j in ttgl.static_range(STAGES - 1):
            _issue(w_desc, w_bufs, bars, hi - 1 - j, j, k_steps, half_n, ROWS, GATED, STAGES,
                   j < count)
        if USE_PDL:  # x and the counters are the kernel before's to finish with
            gdc(True)
            gdc(False)
        # x comes straight into registers (wgmma's A), X_AHEAD units ahead: no shared memory
        # for it, so that all of it holds weights in flight
        x_next = _load_x(x_ptr, stride_xm, M, hi - 1, k_steps, lo, BM, BK, A)
        x_after = _load_x(x_ptr, stride_xm, M, hi - 2, k_steps, lo, BM, BK, A)
        pending = -1  # a tile whose partial this program stored and has yet to count
        # the range backwards, one tile's units at a time (a branch inside the K loop that took
        # the accumulator would make the compiler wait for every wgmma before the next step)
        for tile in range((hi - 1) // k_steps, lo // k_steps - 1, -1):
            seg_lo = ttgl.maximum(lo, tile * k_steps)
            seg_hi = ttgl.minimum(hi, (tile + 1) * k_steps)
            acc = ttgl.zeros([BM, BN], ttgl.float32, ACC)
            for unit in range(seg_hi - 1, seg_lo - 1, -1):
                i = hi - 1 - unit  # units done before this one
                stage = i % STAGES
                x_cur = x_next
                x_next = x_after
                x_after = _load_x(x_ptr, stride_xm, M, unit - 2, k_steps, lo, BM, BK, A)
                mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
                acc = warpgroup_mma(x_cur, w_bufs.index(stage).permute((1, 0)), acc,
                                    is_async=True)
                # step i - 1's wgmma is done: its stage takes unit i + STAGES - 1
                acc = warpgroup_mma_wait(1, deps=(acc,))
                ahead = i + STAGES - 1
                _issue(w_desc, w_bufs, bars, hi - 1 - ahead, ahead, k_steps, half_n, ROWS, GATED,
                       STAGES, ahead < count)
                if (pending >= 0) & (unit == seg_hi - 1 - ARRIVE_AFTER):
                    _arrive(pending, count_ptr)
                    pending = -1
            acc = warpgroup_mma_wait(0, deps=(acc,))
            if pending >= 0:  # the segment was too short to count it in
                _arrive(pending, count_ptr)
            pending = _finish_tile(acc, seg_lo, seg_hi, lo, pid, num_programs, num_units,
                                   k_steps, part_ptr, count_ptr, bias_ptr, y_ptr, M, N,
                                   stride_ym, ROWS, HAS_BIAS, GATED)
        if pending >= 0:
            _arrive(pending, count_ptr)
        for s in ttgl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))


def _shared_layout(block: list[int], dtype: str):
    return ttgl.NVMMASharedLayout.get_default_for(block, getattr(ttgl, {"bf16": "bfloat16",
                                                                       "fp16": "float16"}[dtype]))


def default_tiles(n_out: int, gated: bool, sms: int) -> Sm90Tiles:
    """From the H100 sweeps (benchmarks/results/h100/gemm_sm90.txt): 64 wgmma rows, 128-deep K
    steps in 6 stages (gated: 128 rows, 64 gate and 64 up, 4 stages), and as many weight rows a
    tile, from those down to half, as make the tiles a multiple of a program count within 10%
    of the SMs:
    every program then takes whole tiles and no partial sums are needed (Llama-3.1-8B: qkv 48
    rows, 128 tiles; o_proj and down_proj 32, 128; gate_up 56, 256)."""
    base = Sm90Tiles(128, 12) if gated else Sm90Tiles(64, 24)
    full = base.tile_rows(gated)
    for rows in range(full, full // 2 - 1, -16):  # (narrower: more x per weight byte)
        if even_programs(-(-n_out // rows), sms):
            return replace(base, rows=rows)
    return base


def _box_rows(rows: int) -> int:
    """Rows of a weight TMA box: the tile's, or 16 where they are no power of two (a
    descriptor's block is)."""
    return rows if rows & (rows - 1) == 0 else 16


def even_programs(num_tiles: int, sms: int) -> int | None:
    """The most programs, at most ``sms`` and at least 90% of them, that share num_tiles
    evenly; None if none do."""
    return next((p for p in range(sms, -(-9 * sms // 10) - 1, -1) if num_tiles % p == 0), None)


def gemm_sm90_applies(x: torch.Tensor, w: torch.Tensor, tiles: Sm90Tiles | None = None,
                      gated: bool = False) -> bool:
    """Whether ``gemm_sm90`` takes x [M, K] @ w [N, K]^T: Gluon importable, an sm_90 GPU, 16-bit
    x and w of one dtype with unit-stride rows 16-byte aligned (TMA), 1 <= M <= MAX_M, K a
    multiple of block_k, and the program's shared memory within one SM's."""
    if not (HAS_GLUON and use_triton(x, w)) or x.dim() != 2 or w.dim() != 2:
        return False
    if torch.cuda.get_device_capability(x.device)[0] != 9:  # wgmma is Hopper's
        return False
    m, k = x.shape
    tiles = tiles or default_tiles(w.shape[0] // 2 if gated else w.shape[0], gated,
                                   num_sms(x.device))
    return (x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and 1 <= m <= MAX_M and w.shape[1] == k and k % BOX_K == 0
            and x.stride(1) == 1 and w.stride(1) == 1
            and w.data_ptr() % 16 == 0 and w.stride(0) % 8 == 0
            and tiles.smem_bytes() <= SMEM_BUDGET)


def gemm_sm90(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None, *, gated: bool = False,
              tiles: Sm90Tiles | None = None, programs: int | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (+ bias) -> y [M, N] in out_dtype (x.dtype by default); gated:
    w is a merged [gate; up] projection and y [M, N / 2] = silu(gate) * up. programs: how many
    share the work (default: as many as share the tiles evenly (even_programs), else one per
    SM; tests take other counts to exercise shared tiles)."""
    m, k = x.shape
    n = w.shape[0]
    n_out = n // 2 if gated else n
    sms = num_sms(x.device)
    tiles = tiles or default_tiles(n_out, gated, sms)
    assert gemm_sm90_applies(x, w, tiles), "gemm_sm90 does not take these inputs"
    assert not gated or n % 2 == 0, f"a gated projection has an even number of rows, not {n}"
    out_dtype = out_dtype or x.dtype
    y = torch.empty(m, n_out, dtype=out_dtype, device=x.device)
    rows_out = tiles.tile_rows(gated)  # output columns a tile
    num_tiles = -(-n_out // rows_out)
    k_steps = k // BOX_K
    assert num_tiles <= COUNTER_CAPACITY, f"N={n}: more tiles than the arrival counters"
    units = num_tiles * k_steps
    num_programs = min(programs or even_programs(num_tiles, sms) or sms, units)
    w_block = [_box_rows(rows_out), BOX_K]
    w_desc = GluonTensorDescriptor(w, [n, k], [w.stride(0), 1], w_block,
                                   _shared_layout(w_block, _GL_DTYPES[x.dtype]))
    parts = torch.empty(num_programs * 2 * BLOCK_M * tiles.block_n, device=x.device,
                        dtype=torch.float32)
    launch = pdl(x.device)
    _gemm_sm90_kernel[(num_programs,)](
        w_desc, x, bias if bias is not None else y, y, parts, arrival_counters(x.device),
        m, n, num_tiles, k_steps, x.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        GATED=gated, STAGES=tiles.stages, BN=tiles.block_n, ROWS=rows_out, BM=BLOCK_M,
        USE_PDL=launch["USE_PDL"], num_warps=tiles.num_warps, launch_pdl=launch["launch_pdl"],
    )  # fmt: skip
    return y


def compile_gemm_sm90(tiles: Sm90Tiles, dtype: str = "bf16", out_dtype: str = "bf16",
                      gated: bool = False, has_bias: bool = False, use_pdl: bool = True):
    """The kernel compiled for sm_90 on any host (_gluon.compile_sm90)."""
    w_block = [_box_rows(tiles.tile_rows(gated)), BOX_K]
    sig = {"w_desc": f"tensordesc<{dtype}{w_block},{_shared_layout(w_block, dtype)!r}>",
           "x_ptr": f"*{dtype}", "bias_ptr": f"*{dtype}", "y_ptr": f"*{out_dtype}",
           "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "num_tiles": "i32",
           "k_steps": "i32", "stride_xm": "i32", "stride_ym": "i32"}
    consts = dict(HAS_BIAS=has_bias, GATED=gated, STAGES=tiles.stages, BN=tiles.block_n,
                  ROWS=tiles.tile_rows(gated), BM=BLOCK_M, USE_PDL=use_pdl)
    return compile_sm90(_gemm_sm90_kernel, sig, consts, tiles.num_warps,
                        unspecialized=("M", "N", "num_tiles", "k_steps"))

"""Weight-only GEMM for large batches on Hopper, in Gluon: x through TMA, codes decoded into
shared memory, asynchronous wgmma with both operands there.

    y[m, n] = sum_k x[m, k] (u[n, k] - 2^(b - 1)) s[n, k // G]

The same formats as kiln/kernels/wint_mma.py (symmetric int4 codes packed 8 to an int32 word,
8-bit codes 4 to a word; scales group-wise or per channel), for the batches where that kernel
loses to bf16 cuBLAS: there the weights are decoded in registers into the dot's A operand, and
each warp issues ~360 instructions per 128-code step, more than the step's tensor-core time
(results/h100/wint_mma_clamp.txt). Here a K step of one program is:

  1. wait for the step's TMA copies: x [BM, BK] and the codes [BN, BK / codes per word] land in
     stage ``i % STAGES`` of a ring (issued STAGES - 2 steps ahead);
  2. decode the codes (prmt + lop3 + one packed FMA a pair, wint_mma's asm, and one packed
     multiply by the group scale) and store the [BN, BK] tile to one of three buffers;
  3. fence, barrier, then wgmma(x, decoded^T) asynchronously; wait until only this step's is in
     flight, so the next step decodes while it runs.

Three decoded buffers, because a warpgroup may still be reading the previous step's while
another, past the barrier, writes the next; STAGES - 2 copies ahead, because a stage is
refilled only once every warpgroup's wgmma of two steps ago has finished (which the barrier of
this step guarantees).

The decoded weights are (u - 2^(b - 1)) s rounded to x's dtype, as kiln/quant's dequantized
reference; per-channel scales multiply the float32 accumulator at the end (as wint_mma). K is
split over ``split`` programs when the output tiles alone leave SMs idle; the last program of a
tile to arrive adds the float32 partials in split order, so the result does not depend on the
arrival order (wint_mma's scheme and counters).

Gluon has no interpreter: the CPU tests compile this kernel for sm_90, the GPU tests compare it
with the dequantized reference (tests/kernels/test_wint_wgmma.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.kernels._triton import HAS_TRITON, num_sms, triton
from kiln.kernels.wint_mma import (
    _COUNTER_CAPACITY,
    _DECODE4_BF16,
    _DECODE4_F16,
    _DECODE8_BF16,
    _DECODE8_F16,
    _arrival_counters,
)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # triton 3.6 (the GPU machine's) names these async_copy_global_to_shared and thread_barrier;
    # newer ones (CI's, for the sm_90 compile test) async_load and barrier
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    HAS_GLUON = HAS_TRITON
except ImportError:  # no triton, or one without Gluon's Hopper API: wint_wgmma_applies is False
    HAS_GLUON = False

BLOCK_K = 64  # codes of K a step (one 128-byte row of decoded bf16 weights)
GROUPS = (64, 128)  # group sizes a step lies inside (per channel: any K multiple of BLOCK_K)


@dataclass(frozen=True)
class WgmmaTiles:
    block_m: int  # rows of x a program takes (the wgmma's M: 64, 128 or 256)
    block_n: int  # rows of W a program takes (the wgmma's N: 64..256)
    stages: int = 4  # TMA ring depth
    split: int = 0  # programs sharing a tile's K; 0: as many as _split picks
    num_warps: int = 8


def _mul_asm(decode: str, op: str) -> str:
    """wint_mma's decode asm with the pair multiplied by $7 (the scale twice, packed)."""
    body = decode.replace("fma.rn." + op + " $0,", "fma.rn." + op + " t,")
    return body[:-1] + f"mul.rn.{op} $0, t, $7; }}"


if HAS_GLUON:
    _SCALED4_BF16 = gl.constexpr(_mul_asm(_DECODE4_BF16.value, "bf16x2"))
    _SCALED4_F16 = gl.constexpr(_mul_asm(_DECODE4_F16.value, "f16x2"))
    _SCALED8_BF16 = gl.constexpr(_mul_asm(_DECODE8_BF16.value, "bf16x2"))
    _SCALED8_F16 = gl.constexpr(_mul_asm(_DECODE8_F16.value, "f16x2"))

    @gluon.constexpr_function
    def _code_layout(block_n, block_kw, codes_per_word, num_warps):
        """[BN, BKW, pairs a word, 2]: a thread holds whole words of one row, all their pairs."""
        rows_per_warp = max(block_n // num_warps, 1)
        tn = min(32, rows_per_warp)
        tw = 32 // tn
        return gl.BlockedLayout([1, block_kw // tw, codes_per_word // 2, 2], [tn, tw, 1, 1],
                                [num_warps, 1, 1, 1], [3, 2, 1, 0])

    @gluon.constexpr_function
    def _acc_layout(block_m, block_n, num_warps):
        """The wgmma accumulator: warps along M first (16 rows each), the widest N instruction."""
        warps = [4, 1]
        while warps[0] * warps[1] != num_warps:
            if block_m > 16 * warps[0]:
                warps[0] *= 2
            else:
                warps[1] *= 2
        max_n = max(block_n // warps[1], 8)
        n = 256
        while n > max_n or block_n % n:
            n -= 8
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps,
                                         instr_shape=[16, n, 16])

    @gluon.jit
    def _decode_tile(words, scale2, BITS: gl.constexpr, GROUPED: gl.constexpr,
                     L4: gl.constexpr, dt: gl.constexpr):
        """words [BN, BKW] int32 -> decoded [BN, BKW * codes per word] in dt, times the row's
        group scale (scale2: [BN] int32, the scale's bits in both halves) if GROUPED."""
        BN: gl.constexpr = words.shape[0]
        BKW: gl.constexpr = words.shape[1]
        H: gl.constexpr = 16 // BITS  # pairs a word
        pair = gl.arange(0, H, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4))))
        if BITS == 4:  # bytes p of the word and of the word >> 4: codes 2 p and 2 p + 1
            second = words >> 4
            sel = pair * 0x101 + 0x400
        else:  # bytes 2 p and 2 p + 1 of the word
            second = words
            sel = pair * 0x202 + 0x100
        twice = gl.full([1, 1, 1, 2], 0, gl.int32, L4)  # each asm instance takes two elements
        w4 = gl.expand_dims(gl.expand_dims(words, 2), 3) + twice  # [BN, BKW, 1, 2]
        s4 = gl.expand_dims(gl.expand_dims(second, 2), 3) + twice
        sel4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(sel, 0), 1), 3)  # [1, 1, H, 1]
        # (inline asm takes literal strings and dtypes: one call per case, each folded at
        # compile time)
        if GROUPED:
            sc4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(scale2, 1), 2), 3)
            args = [w4, s4, sel4, sc4]
            if dt == gl.bfloat16:
                asm: gl.constexpr = _SCALED4_BF16 if BITS == 4 else _SCALED8_BF16
                pairs = gl.inline_asm_elementwise(asm, "=r,r,r,r,r,r,r,r,r", args,
                                                  dtype=gl.bfloat16, is_pure=True, pack=2)
            else:
                asm: gl.constexpr = _SCALED4_F16 if BITS == 4 else _SCALED8_F16
                pairs = gl.inline_asm_elementwise(asm, "=r,r,r,r,r,r,r,r,r", args,
                                                  dtype=gl.float16, is_pure=True, pack=2)
        else:
            args = [w4, s4, sel4]
            if dt == gl.bfloat16:
                asm: gl.constexpr = _DECODE4_BF16 if BITS == 4 else _DECODE8_BF16
                pairs = gl.inline_asm_elementwise(asm, "=r,r,r,r,r,r,r", args,
                                                  dtype=gl.bfloat16, is_pure=True, pack=2)
            else:
                asm: gl.constexpr = _DECODE4_F16 if BITS == 4 else _DECODE8_F16
                pairs = gl.inline_asm_elementwise(asm, "=r,r,r,r,r,r,r", args,
                                                  dtype=gl.float16, is_pure=True, pack=2)
        return gl.reshape(pairs, [BN, BKW * H * 2])  # [BN, BKW, H, 2] -> K order

    @gluon.jit
    def _issue_copies(x_desc, w_desc, x_bufs, w_bufs, bars, off_m, off_n, step, j,
                      STAGES: gl.constexpr, pred):
        """TMA copies of the program's step j (K step ``step`` of the weight) into its stage."""
        stage = j % STAGES
        bar = bars.index(stage)
        mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
        _tma_load(x_desc, [off_m, step * x_desc.block_type.shape[1]], bar, x_bufs.index(stage),
                  pred)
        _tma_load(w_desc, [off_n, step * w_desc.block_type.shape[1]], bar, w_bufs.index(stage),
                  pred)

    # M, the step counts and the split change with the batch and the layer: one compile serves
    @gluon.jit(do_not_specialize=["M", "num_steps", "steps_per_split", "num_splits"])
    def _wint_wgmma_kernel(
        x_desc, w_desc, s_ptr, out_ptr, part_ptr, count_ptr,
        M, N, num_steps, steps_per_split, num_splits, stride_sn, stride_om,
        BITS: gl.constexpr, GROUP_STEPS: gl.constexpr, STAGES: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """out [BM, BN] of one (x tile, W tile) over its share of K. GROUP_STEPS: K steps a scale
        group spans (0: per-channel scales, applied at the end)."""
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BKW: gl.constexpr = w_desc.block_type.shape[1]
        dt: gl.constexpr = x_desc.dtype
        GROUPED: gl.constexpr = GROUP_STEPS > 0
        L4: gl.constexpr = _code_layout(BN, BKW, 32 // BITS, num_warps)
        WORDS: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L4))  # [BN, BKW]
        ACC: gl.constexpr = _acc_layout(BM, BN, num_warps)

        x_bufs = gl.allocate_shared_memory(dt, [STAGES, BM, BK], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BKW], w_desc.layout)
        dec_bufs = gl.allocate_shared_memory(
            dt, [3, BN, BK], gl.NVMMASharedLayout.get_default_for([BN, BK], dt))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)

        pid_m = gl.program_id(0)
        pid_n = gl.program_id(1)
        pid_k = gl.program_id(2)
        off_m = pid_m * BM
        off_n = pid_n * BN
        step0 = pid_k * steps_per_split
        steps = gl.minimum(steps_per_split, num_steps - step0)  # >= 1: the host's split
        for j in gl.static_range(STAGES - 2):
            _issue_copies(x_desc, w_desc, x_bufs, w_bufs, bars, off_m, off_n, step0 + j, j,
                          STAGES, j < steps)
        rows = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, WORDS))
        row_scales = s_ptr + rows.to(gl.int64) * stride_sn
        # a step's group scales are loaded a step ahead (an L2 round trip would stall the decode)
        scale_mask = rows < N
        if GROUPED:
            next_scales = gl.load(row_scales + step0 // GROUP_STEPS, mask=scale_mask, other=0.0)
        else:
            next_scales = gl.zeros([BN], s_ptr.dtype.element_ty, gl.SliceLayout(1, WORDS))
        scale2 = gl.zeros([BN], gl.int32, gl.SliceLayout(1, WORDS))
        acc = gl.zeros([BM, BN], gl.float32, ACC)
        for i in range(steps):
            stage = i % STAGES
            if GROUPED:
                bits = next_scales.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
                scale2 = bits | (bits << 16)  # [BN]: the scale's bits in both halves of a word
                next_scales = gl.load(row_scales + (step0 + i + 1) // GROUP_STEPS,
                                      mask=scale_mask & (i + 1 < steps), other=0.0)
            mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
            words = w_bufs.index(stage).load(WORDS)
            dec = dec_bufs.index(i % 3)
            dec.store(_decode_tile(words, scale2, BITS, GROUPED, L4, dt))
            fence_async_shared()
            _cta_barrier()  # the tile written; every warpgroup done with step i - 2's wgmma
            ahead = i + STAGES - 2  # refill the stage step i - 2 used
            _issue_copies(x_desc, w_desc, x_bufs, w_bufs, bars, off_m, off_n, step0 + ahead,
                          ahead, STAGES, ahead < steps)
            acc = warpgroup_mma(x_bufs.index(stage), dec.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
        acc = warpgroup_mma_wait(0, deps=(acc,))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))
        offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, ACC))
        if not GROUPED:
            col_scales = gl.load(s_ptr + offs_n.to(gl.int64) * stride_sn, mask=offs_n < N,
                                 other=0.0)
            acc = acc * gl.expand_dims(col_scales.to(gl.float32), 0)
        out_ptrs = (out_ptr + gl.expand_dims(offs_m.to(gl.int64) * stride_om, 1)
                    + gl.expand_dims(offs_n, 0))
        out_mask = gl.expand_dims(offs_m < M, 1) & gl.expand_dims(offs_n < N, 0)
        if num_splits == 1:
            gl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            tile = pid_n * gl.num_programs(0) + pid_m
            local = (gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(1, ACC)) * BN, 1)
                     + gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(0, ACC)), 0))
            tile_parts = part_ptr + tile.to(gl.int64) * num_splits * (BM * BN)
            gl.store(tile_parts + pid_k * (BM * BN) + local, acc)
            _cta_barrier()  # every thread's partial stored before the arrival is counted
            arrived = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
            if arrived == num_splits - 1:  # the tile's last program: add the splits in order
                total = gl.zeros([BM, BN], gl.float32, ACC)
                for part in range(num_splits):
                    total += gl.load(tile_parts + part * (BM * BN) + local, cache_modifier=".cg")
                gl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
                gl.atomic_xchg(count_ptr + tile, 0)


MIN_STEPS_PER_SPLIT = 8  # K steps a program keeps when K is split (fewer: no further split)
# rows of x from which this kernel takes a layer (below: wint_mma), per code width; set from the
# H100 sweep (benchmarks/wint_mma_sweep.py)
WGMMA_MIN_M = {4: 129, 8: 65}


def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def wint_wgmma_applies(x: torch.Tensor, scales: torch.Tensor, bits: int, group: int) -> bool:
    """Whether this kernel takes x [M, K] @ W^T for a format wint_mma takes (the caller checks
    that: symmetric codes, no act-order, no AWQ smoothing): on an sm_90 GPU (wgmma is
    Hopper's), 16-bit x with rows TMA can read (16-byte aligned), K a multiple of BLOCK_K,
    groups of GROUPS (group-wise scales in x's dtype) or per channel, M >= WGMMA_MIN_M[bits]."""
    m, k = x.shape
    grouped = group < k
    return (HAS_GLUON and bits in WGMMA_MIN_M and m >= WGMMA_MIN_M[bits] and x.is_cuda
            and _hopper(x.device) and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(1) == 1 and x.data_ptr() % 16 == 0 and (x.stride(0) * 2) % 16 == 0
            and k % BLOCK_K == 0
            and (not grouped or group in GROUPS and k % group == 0 and scales.dtype == x.dtype))


def wint_wgmma_tiles(m: int, n: int, bits: int) -> WgmmaTiles:
    """x tiles of up to 256 rows against 128 rows of W (each weight decoded once per x tile)."""
    block_m = min(256, max(64, 1 << (m - 1).bit_length()))
    return WgmmaTiles(block_m, 128)


def _split(tiles: WgmmaTiles, out_tiles: int, steps: int, device: torch.device) -> int:
    """K split until the programs cover the SMs, each keeping MIN_STEPS_PER_SPLIT steps."""
    split = 1
    while out_tiles * split < num_sms(device) and steps // (split * 2) >= MIN_STEPS_PER_SPLIT:
        split *= 2
    return split


def wint_wgmma_gemm(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, bits: int,
                    group: int, out_dtype: torch.dtype | None = None,
                    tiles: WgmmaTiles | None = None) -> torch.Tensor:
    """x [M, K] (16-bit, rows 16-byte aligned) @ dequantized W^T -> [M, N] in ``out_dtype``; W's
    codes as int32 words [N, K bits / 32], scales [N, K / group] (group >= K: per channel)."""
    m, k = x.shape
    n, kw = words.shape
    cpw = 32 // bits
    grouped = group < k
    assert words.dtype == torch.int32 and kw * cpw == k and words.stride(1) == 1
    assert scales.shape == (n, k // group if grouped else 1) and scales.stride(1) == 1
    assert k % BLOCK_K == 0 and (not grouped or group % BLOCK_K == 0 and scales.dtype == x.dtype)
    tiles = tiles or wint_wgmma_tiles(m, n, bits)
    x_tiles, row_tiles = triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n)
    assert x_tiles * row_tiles <= _COUNTER_CAPACITY, \
        f"{m} x {n}: more output tiles than the split-K counters"
    num_steps = k // BLOCK_K
    split = tiles.split or _split(tiles, x_tiles * row_tiles, num_steps, x.device)
    steps_per_split = triton.cdiv(num_steps, split)
    split = triton.cdiv(num_steps, steps_per_split)  # every split has at least one step
    el = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    x_block, w_block = [tiles.block_m, BLOCK_K], [tiles.block_n, BLOCK_K // cpw]
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], x_block,
                              gl.NVMMASharedLayout.get_default_for(x_block, el))
    w_desc = TensorDescriptor(words, [n, kw], [words.stride(0), 1], w_block,
                              gl.NVMMASharedLayout.get_default_for(w_block, gl.int32))
    out = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    # (unsplit: a placeholder, so that one compiled kernel serves every split)
    parts = torch.empty(x_tiles * row_tiles * tiles.block_m * tiles.block_n * split
                        if split > 1 else 1, device=x.device, dtype=torch.float32)
    _wint_wgmma_kernel[(x_tiles, row_tiles, split)](
        x_desc, w_desc, scales, out, parts, _arrival_counters(x.device),
        m, n, num_steps, steps_per_split, split, scales.stride(0), out.stride(0),
        BITS=bits, GROUP_STEPS=group // BLOCK_K if grouped else 0, STAGES=tiles.stages,
        num_warps=tiles.num_warps,
    )  # fmt: skip
    return out

"""Weight-only GEMM for large batches on Hopper, in Gluon: the codes decoded straight into
wgmma's register operand, x^T through TMA into shared memory, a warp issuing the copies.

    y[m, n] = sum_k x[m, k] (u[n, k] - 2^(b - 1)) s[n, k // G]

The same formats as kiln/kernels/wint_mma.py (symmetric int4 codes packed 8 to an int32 word,
8-bit codes 4 to a word; scales group-wise or per channel), for the batches where that kernel
loses to bf16 cuBLAS. A program computes out^T [BN, BM] = W [BN, K] @ x^T [K, BM] for BN rows of
W (64 per warpgroup of the MMA partition, one or two) against BM rows of x (the wgmma's N, up
to 256), in K steps of 64 codes:

  - the loader (one warp) copies x [BM, 64], the codes [BN, 64 / codes per word] and, for
    group-wise scales, the [BN, 8] block of scales the step's group lies in, into a ring of
    STAGES stages (mbarriers: ready when the bytes land, empty when the MMA warps are done);
  - the MMA warps load each thread's words of its wgmma A fragment from shared memory (the
    fragment of rows g, g + 8 and codes 2c, 2c + 1, 2c + 8, 2c + 9 of every 16 needs one pair of
    each word it touches: int4 pair c of two words, 8-bit codes pair c % 2 of words c / 2 and
    2 + c / 2), decode them with wint_mma's prmt + lop3 + packed FMA and multiply by the group
    scale (one packed multiply, rounded to x's dtype as the dequantized reference's weights),
    and issue wgmma(A in registers, x^T in shared memory) asynchronously: the next step decodes
    while it runs. Each thread decodes only its own fragment (1/4 of the codes a warp reads).

(The earlier form decoded whole tiles into shared memory for wgmma to read there: shared
memory traffic, not the decoding, capped it at ~60% of the tensor cores:
benchmarks/results/h100/wint_wgmma.txt.) Per-channel scales multiply the float32 accumulator
at the end (as wint_mma). K is split over ``split`` programs when the output tiles alone leave
SMs idle; the last program of a tile to arrive adds the float32 partials in split order, so the
result does not depend on the arrival order (wint_mma's scheme and counters).

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

BLOCK_K = 64  # codes of K a step
GROUPS = (64, 128)  # group sizes a step lies inside (per channel: any K multiple of BLOCK_K)


@dataclass(frozen=True)
class WgmmaTiles:
    block_m: int  # rows of x a program takes (the wgmma's N: 64 to 256)
    block_n: int  # rows of W a program takes (64 per MMA warpgroup: 64 to 256)
    stages: int = 4  # TMA ring depth
    split: int = 0  # programs sharing a tile's K; 0: as many as _split picks


def _mul_asm(decode: str, op: str) -> str:
    """wint_mma's decode asm with the pair multiplied by $7 (the scale twice, packed)."""
    body = decode.replace("fma.rn." + op + " $0,", "fma.rn." + op + " t,")
    return body[:-1] + f"mul.rn.{op} $0, t, $7; }}"


if HAS_GLUON:
    _SCALED4_BF16 = gl.constexpr(_mul_asm(_DECODE4_BF16.value, "bf16x2"))
    _SCALED4_F16 = gl.constexpr(_mul_asm(_DECODE4_F16.value, "f16x2"))
    _SCALED8_BF16 = gl.constexpr(_mul_asm(_DECODE8_BF16.value, "bf16x2"))
    _SCALED8_F16 = gl.constexpr(_mul_asm(_DECODE8_F16.value, "f16x2"))
    _NO_SWIZZLE = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))

    @gluon.constexpr_function
    def _acc_layout(block_m, num_warps):
        """out^T [BN, BM]: 16 rows of W a warp, x's BM rows the instruction's N."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                         instr_shape=[16, block_m, 16])

    @gluon.constexpr_function
    def _row_bases(num_warps):
        """A wgmma A fragment's rows in a 16-row warp block: lanes 4 g + c hold rows g and g + 8
        (a register bit), warps the blocks. Returns (register, lane, warp) row bases."""
        warps = [16 << i for i in range(num_warps.bit_length() - 1)]
        return [8], [0, 0, 1, 2, 4], warps

    @gluon.constexpr_function
    def _code_layout(block_kw, bits, num_warps):
        """[BN, BKW, pairs a word, 2] over the A fragments: a thread's pairs are those of codes
        2c, 2c + 1 (+ 8) of every 16. int4 (4 pairs a word): pair c of every word, the words in
        registers; 8-bit codes (2 pairs): pair c % 2 of every other word, lane bit 1 picking
        which (word bit 0), the remaining word bits in registers."""
        row_reg, row_lane, row_warp = _row_bases(num_warps)
        pair_bits = 2 if bits == 4 else 1  # log2(pairs a word)
        lane_word_bits = 2 - pair_bits  # c's bits that pick a word (8-bit: c / 2)
        lane = []
        for i, r in enumerate(row_lane):
            if i < 2:  # c's bits
                lane.append([0, 0, 1 << i, 0] if i < pair_bits else [0, 1 << (i - pair_bits), 0, 0])
            else:
                lane.append([r, 0, 0, 0])
        reg = [[0, 0, 0, 1]]  # the pair's two codes
        reg += [[0, 1 << b, 0, 0] for b in range(lane_word_bits, block_kw.bit_length() - 1)]
        reg += [[r, 0, 0, 0] for r in row_reg]
        warp = [[r, 0, 0, 0] for r in row_warp]
        shape = [16 * num_warps, block_kw, 1 << pair_bits, 2]
        return gl.DistributedLinearLayout(reg, lane, warp, [], shape)

    @gluon.constexpr_function
    def _scale_layout(num_warps):
        """[BN, 8] group scales, each thread its fragment rows' 8 (lanes c replicate)."""
        row_reg, row_lane, row_warp = _row_bases(num_warps)
        reg = [[0, 1], [0, 2], [0, 4]] + [[r, 0] for r in row_reg]
        return gl.DistributedLinearLayout(reg, [[r, 0] for r in row_lane],
                                          [[r, 0] for r in row_warp], [], [16 * num_warps, 8])

    @gluon.jit
    def _decode_fragment(words, scale2, BITS: gl.constexpr, GROUPED: gl.constexpr,
                         L4: gl.constexpr, dt: gl.constexpr):
        """words [BN, BKW] int32 (L4 sliced: each thread its fragment's words) -> its fragment
        pairs [BN, BKW * codes per word] in dt, times the row's group scale (scale2: [BN] int32,
        the scale's bits in both halves of a word) if GROUPED."""
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
        zero = gl.full([1, 1, H, 2], 0, gl.int32, L4)  # broadcast to a pair per thread...
        w4 = gl.expand_dims(gl.expand_dims(words, 2), 3) + zero  # [BN, BKW, H, 2]
        s4 = gl.expand_dims(gl.expand_dims(second, 2), 3) + zero
        sel4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(sel, 0), 1), 3) + zero
        # (inline asm takes literal strings and dtypes: one call per case, each folded at
        # compile time; an instance takes the two elements of a pair: $1 $2 the word, ...)
        if GROUPED:
            sc4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(scale2, 1), 2), 3) + zero
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
    def _barriers(count: gl.constexpr):
        """count mbarriers, each completed by one arrival (or a TMA copy's bytes)."""
        bars = gl.allocate_shared_memory(gl.int64, [count, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(count):
            mbarrier.init(bars.index(j), count=1)
        return bars

    @gluon.jit
    def _load_partition(descs, bars, bufs, off_m, off_n, step0, steps, group_steps):
        """One warp: the TMA copies of every step into a stage the MMA warps have freed."""
        x_desc, w_desc, s_desc = descs
        ready, empty = bars
        x_bufs, w_bufs, s_bufs = bufs
        STAGES: gl.constexpr = x_bufs.shape[0]
        # (worker partitions receive scalars as values, not constexprs: compile-time facts
        # travel in buffer shapes; group-wise scale blocks are [STAGES, BN, 8])
        GROUPED: gl.constexpr = s_bufs.shape[2] == 8
        for i in range(steps):
            stage = i % STAGES
            step = step0 + i
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)  # (fresh: phase 1 passes)
            bar = ready.index(stage)
            if GROUPED:
                mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes
                                + s_desc.block_type.nbytes)
                _tma_load(s_desc, [off_n, step // group_steps // 8 * 8], bar,
                          s_bufs.index(stage))
            else:
                mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            _tma_load(w_desc, [off_n, step * w_desc.block_type.shape[1]], bar,
                      w_bufs.index(stage))
            _tma_load(x_desc, [off_m, step * x_desc.block_type.shape[1]], bar,
                      x_bufs.index(stage))

    @gluon.jit
    def _mma_partition(bars, bufs, step0, steps, group_steps, BITS: gl.constexpr,
                       num_warps: gl.constexpr):
        """The kernel's warps: decode each step's A fragments, wgmma(A, x^T) asynchronously with
        one in flight; a finished wgmma frees its stage. Returns the float32 accumulator
        [BN, BM] (out^T)."""
        ready, empty = bars
        x_bufs, w_bufs, s_bufs = bufs
        STAGES: gl.constexpr = x_bufs.shape[0]
        BM: gl.constexpr = x_bufs.shape[1]
        BN: gl.constexpr = w_bufs.shape[1]
        BKW: gl.constexpr = w_bufs.shape[2]
        dt: gl.constexpr = x_bufs.dtype
        GROUPED: gl.constexpr = s_bufs.shape[2] == 8
        ACC: gl.constexpr = _acc_layout(BM, num_warps)
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        L4: gl.constexpr = _code_layout(BKW, BITS, num_warps)
        WORDS: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L4))  # [BN, BKW]
        ROWS: gl.constexpr = gl.SliceLayout(1, WORDS)
        SCALES: gl.constexpr = _scale_layout(num_warps)
        scale2 = gl.zeros([BN], gl.int32, ROWS)
        acc = gl.zeros([BN, BM], gl.float32, ACC)
        for i in range(steps):
            stage = i % STAGES
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            words = w_bufs.index(stage).load(WORDS)
            if GROUPED:  # the step's group: a column of the block
                block = s_bufs.index(stage).load(SCALES).to(gl.float32)
                col = gl.arange(0, 8, layout=gl.SliceLayout(0, SCALES))
                pick = gl.expand_dims(col == (step0 + i) // group_steps % 8, 0)
                s = gl.sum(gl.where(pick, block, 0.0), axis=1).to(dt)
                bits = gl.convert_layout(s, ROWS).to(gl.int16, bitcast=True).to(gl.int32)
                bits = bits & 0xFFFF
                scale2 = bits | (bits << 16)  # the scale's bits in both halves of a word
            a = gl.convert_layout(_decode_fragment(words, scale2, BITS, GROUPED, L4, dt), A)
            # (the next step's decode may overwrite a's registers: the hardware holds such writes
            # until the wgmma has read them, so they wait for it to start, not to finish)
            acc = warpgroup_mma(a, x_bufs.index(stage).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))  # step i - 1's has finished: free its stage
            # (no proxy fence for the codes read from the stage before TMA overwrites them, as
            # CUTLASS's TMA pipelines release such stages: a fence here also waits for the
            # wgmma in flight, which serialized the decode and the MMA)
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
        return (warpgroup_mma_wait(0, deps=(acc,)),)  # (warp_specialize returns a tuple)

    # M, the step counts and the split change with the batch and the layer: one compile serves
    @gluon.jit(do_not_specialize=["M", "num_steps", "steps_per_split", "num_splits"])
    def _wint_wgmma_kernel(
        x_desc, w_desc, s_desc, s_ptr, out_ptr, part_ptr, count_ptr,
        M, N, num_steps, steps_per_split, num_splits, stride_sn, stride_om,
        BITS: gl.constexpr, GROUP_STEPS: gl.constexpr, STAGES: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """out^T [BN, BM] of one (W tile, x tile) over its share of K. GROUP_STEPS: K steps a
        scale group spans (0: per-channel scales, applied at the end)."""
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        BKW: gl.constexpr = w_desc.block_type.shape[1]
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BKW], w_desc.layout)
        if GROUP_STEPS > 0:  # [BN, 8] blocks of group scales, with the codes
            s_bufs = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape,
                                               s_desc.layout)
        else:  # per-channel scales are read once, at the end (s_desc is w_desc, unused)
            s_bufs = gl.allocate_shared_memory(gl.int32, [1, 1, 1], _NO_SWIZZLE)
        bars = (_barriers(STAGES), _barriers(STAGES))  # ready, empty
        bufs = (x_bufs, w_bufs, s_bufs)

        pid_m = gl.program_id(0)  # x tiles the fastest axis: programs sharing a W tile run
        pid_n = gl.program_id(1)  # together, and read it from HBM once
        pid_k = gl.program_id(2)
        off_m = pid_m * BM
        off_n = pid_n * BN
        step0 = pid_k * steps_per_split
        steps = gl.minimum(steps_per_split, num_steps - step0)  # >= 1: the host's split
        acc = gl.warp_specialize([
            (_mma_partition, (bars, bufs, step0, steps, GROUP_STEPS, BITS, num_warps)),
            (_load_partition, ((x_desc, w_desc, s_desc), bars, bufs, off_m, off_n, step0, steps,
                               GROUP_STEPS)),
        ], [1], [24])[0]  # fmt: skip

        ACC: gl.constexpr = _acc_layout(BM, num_warps)
        if GROUP_STEPS == 0:
            offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, ACC))
            row_scales = gl.load(s_ptr + offs_n.to(gl.int64) * stride_sn, mask=offs_n < N,
                                 other=0.0)
            acc = acc * gl.expand_dims(row_scales.to(gl.float32), 1)
        # out [BM, BN] in rows of 8 consecutive outputs a thread: one 16- or 32-byte store (and
        # one address) each, where the wgmma layout would need one per pair of outputs
        OUT: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BN, BN // 8], [num_warps, 1],
                                             [1, 0])
        out = gl.convert_layout(gl.permute(acc, (1, 0)), OUT)
        rows = gl.arange(0, BM, layout=gl.SliceLayout(1, OUT))
        cols = gl.arange(0, BN, layout=gl.SliceLayout(0, OUT))
        out_ptrs = (out_ptr + gl.expand_dims((off_m + rows).to(gl.int64) * stride_om, 1)
                    + gl.expand_dims(off_n + cols, 0))
        out_mask = gl.expand_dims(off_m + rows < M, 1) & gl.expand_dims(off_n + cols < N, 0)
        if num_splits == 1:
            gl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            tile = pid_n * gl.num_programs(0) + pid_m
            local = gl.expand_dims(rows * BN, 1) + gl.expand_dims(cols, 0)
            tile_parts = part_ptr + tile.to(gl.int64) * num_splits * (BM * BN)
            gl.store(tile_parts + pid_k * (BM * BN) + local, out)
            _cta_barrier()  # every thread's partial stored before the arrival is counted
            arrived = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
            if arrived == num_splits - 1:  # the tile's last program: add the splits in order
                total = gl.zeros([BM, BN], gl.float32, OUT)
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
    groups of GROUPS (group-wise scales in x's dtype, rows of a multiple of 8 groups, read by
    TMA too) or per channel, M >= WGMMA_MIN_M[bits]."""
    m, k = x.shape
    grouped = group < k
    return (HAS_GLUON and bits in WGMMA_MIN_M and m >= WGMMA_MIN_M[bits] and x.is_cuda
            and _hopper(x.device) and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(1) == 1 and x.data_ptr() % 16 == 0 and (x.stride(0) * 2) % 16 == 0
            and k % BLOCK_K == 0
            and (not grouped or group in GROUPS and k % group == 0 and scales.dtype == x.dtype
                 and (k // group) % 8 == 0 and scales.stride(0) % 8 == 0
                 and scales.data_ptr() % 16 == 0))


def wint_wgmma_tiles(m: int, n: int, bits: int) -> WgmmaTiles:
    """x tiles of the next power of two >= M rows, 64 to 256 (the wgmma's N; each weight decoded
    once per x tile), against 128 rows of W (two MMA warpgroups)."""
    return WgmmaTiles(min(256, max(64, 1 << (m - 1).bit_length())), 128)


def _split(tiles: WgmmaTiles, out_tiles: int, steps: int, device: torch.device) -> int:
    """K split until the programs cover the SMs, each keeping MIN_STEPS_PER_SPLIT steps."""
    split = 1
    while out_tiles * split < num_sms(device) and steps // (split * 2) >= MIN_STEPS_PER_SPLIT:
        split *= 2
    return split


def launch_maxnreg(num_warps: int) -> int:
    """Registers a thread at launch: the MMA warps and the loader's (a warp, allocated as a
    warpgroup) share the SM's 64K; setmaxnreg then moves the loader's spare ones to the MMA
    warps."""
    return min(255, 65536 // (32 * (num_warps + 4))) // 8 * 8


def _descriptor(t: torch.Tensor, block: list[int], el) -> TensorDescriptor:
    """A TMA descriptor of a row-major matrix, the default swizzle for its block."""
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], block,
                            gl.NVMMASharedLayout.get_default_for(block, el))


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
    x_desc = _descriptor(x, [tiles.block_m, BLOCK_K], el)
    w_desc = _descriptor(words, [tiles.block_n, BLOCK_K // cpw], gl.int32)
    s_desc = _descriptor(scales, [tiles.block_n, 8], el) if grouped else w_desc
    out = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    # (unsplit: a placeholder, so that one compiled kernel serves every split)
    parts = torch.empty(x_tiles * row_tiles * tiles.block_m * tiles.block_n * split
                        if split > 1 else 1, device=x.device, dtype=torch.float32)
    num_warps = tiles.block_n // 16
    _wint_wgmma_kernel[(x_tiles, row_tiles, split)](
        x_desc, w_desc, s_desc, scales, out, parts, _arrival_counters(x.device),
        m, n, num_steps, steps_per_split, split, scales.stride(0), out.stride(0),
        BITS=bits, GROUP_STEPS=group // BLOCK_K if grouped else 0, STAGES=tiles.stages,
        num_warps=num_warps, maxnreg=launch_maxnreg(num_warps),
    )  # fmt: skip
    return out

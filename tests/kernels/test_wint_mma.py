"""Tensor-core weight-only GEMM for decode batches (kiln/kernels/wint_mma.py), int4 and 8-bit
codes: Triton (interpreted on CPU in fp16; compiled with its PTX decode on the GPU) against
float64 math on the dequantized weight, the split-K reduction, the arrival counters, and its
dispatch from quant_gemm."""

import importlib
import sys
from typing import NamedTuple

import pytest
import torch
from kernel_testing import assert_rel_close, gpu, needs_triton

if not torch.cuda.is_available():  # built for a GPU if imported before the conftest: rebuild
    for _name in ("kiln.kernels.wint_mma", "kiln.kernels.quant_gemm"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

from test_quant_gemm import make_weight, naive  # noqa: E402

from kiln.kernels import quant_gemm as qg  # noqa: E402
from kiln.kernels import wint_mma as mma  # noqa: E402


def _check(n, k, bits, group, m, dtype, device, tiles=None, smooth=False, seed=0, tol=3e-3):
    gen = torch.Generator().manual_seed(seed)
    qweight, scales, _, w64 = make_weight(n, k, bits, group, True, gen=gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    sm = (torch.rand(k, generator=gen) + 0.5).to(dtype) if smooth else None
    expected = naive(x, w64, smooth=sm)
    words = qg._words(qweight, bits)
    args = [t.to(device) if t is not None else None for t in (x, words, scales.to(dtype), sm)]
    out = mma.wint_mma_gemm(args[0], args[1], args[2], bits, k if group == -1 else group,
                            args[3], tiles=tiles)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_rel_close(out.cpu(), expected, tol, f"W{bits} {n}x{k} g{group} m={m} {tiles}")
    return out, args


@needs_triton
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("bits, n, k, group, m", [
    (4, 80, 256, 64, 3), (4, 64, 512, 128, 17), (4, 33, 128, 32, 5), (4, 40, 256, -1, 4),
    (8, 80, 256, -1, 3), (8, 33, 512, -1, 17), (4, 80, 256, 64, 40), (8, 40, 256, -1, 40),
])  # fmt: skip
def test_wint_mma_matches_float64(bits, n, k, group, m, split):
    """Row counts that are not a multiple of the 64-row tile (masked stores), K split into
    ranges of whole steps (groups, or 128 codes with per-channel scales), x rows padded to the
    dot's 16/32/64 (group scales after the dot up to 32 rows, folded into the weights past);
    8-bit codes cover all 256 values, the top bit included."""
    block_m = max(16, 1 << (m - 1).bit_length())
    _check(n, k, bits, group, m, torch.float16, "cpu", mma.MmaTiles(64, split, block_m))


@needs_triton
@pytest.mark.parametrize("m, block_m", [(4, 16), (40, 64)])
@pytest.mark.parametrize("bits, group", [(4, 64), (8, -1)])
def test_wint_mma_smooth(bits, group, m, block_m):
    _check(64, 256, bits, group, m, torch.float16, "cpu", mma.MmaTiles(64, 2, block_m),
           smooth=True)


@needs_triton
def test_wint_mma_default_split():
    """split 0: K split by the default rule (nominal 8 SMs off CUDA, 16 programs wanted: 2 row
    tiles of 64 steps split 8 ways; of 16 steps only 2 ways, each split keeping
    MIN_STEPS_PER_SPLIT = 8 steps)."""
    assert mma._split(mma.MmaTiles(64, 0, 16), 2, 64, torch.device("cpu")) == 8
    assert mma._split(mma.MmaTiles(64, 0, 16), 2, 16, torch.device("cpu")) == 2
    _check(72, 2048, 4, 128, 9, torch.float16, "cpu", mma.MmaTiles(64, 0, 16))


@needs_triton
def test_wint_mma_per_channel_k_step():
    """Per-channel scales at a K that 128 does not divide: 32-code steps, split over them."""
    assert mma.wint_mma_tiles(4, 48, 96, 96, 8, torch.device("cpu")).k_step == 32
    _check(48, 96, 8, -1, 5, torch.float16, "cpu", mma.MmaTiles(64, 3, 16, k_step=32))


@needs_triton
def test_wint_mma_split_sum_is_repeatable_and_counters_reset():
    """The last program of a tile adds the partials in split order and zeroes the tile's
    counter: a second launch (the counters reused) gives the same bits."""
    tiles = mma.MmaTiles(64, 4, 16)
    first, args = _check(130, 512, 4, 64, 6, torch.float16, "cpu", tiles)
    again = mma.wint_mma_gemm(args[0], args[1], args[2], 4, 64, tiles=tiles)
    assert torch.equal(first, again)
    assert int(mma.arrival_counters(torch.device("cpu")).abs().sum()) == 0


@needs_triton
@pytest.mark.parametrize("bits, group, split", [(4, 64, 1), (4, 64, 2), (8, -1, 3)])
def test_wint_mma_tiles_x_rows(bits, group, split):
    """More rows than a program's x tile: 40 rows in three 16-row tiles (the last one ragged),
    each with its own split-K partials and counters; the counters are back at zero after."""
    _check(80, 384, bits, group, 40, torch.float16, "cpu", mma.MmaTiles(64, split, 16),
           seed=split)
    assert int(mma.arrival_counters(torch.device("cpu")).abs().sum()) == 0


def _applies(m, bits=4, group=128, k=256, n=64, zeros=None, perm=None, fp8=False,
             dtype=torch.bfloat16):
    x = torch.zeros(m, k, dtype=dtype)
    return mma.wint_mma_applies(x, n, zeros, perm, bits, group, fp8)


def test_wint_mma_applies_only_to_its_formats():
    assert _applies(8) and _applies(8, group=256)  # group-wise, per channel
    assert _applies(100, bits=8, group=256)
    assert not _applies(100, bits=8, group=256, fp8=True)  # e4m3 weights
    assert not _applies(8, zeros=torch.zeros(4, 2, dtype=torch.uint8))  # asymmetric
    assert not _applies(8, perm=torch.arange(256))  # act-order
    assert not _applies(8, group=256, k=512)  # group wider than a K step
    assert not _applies(8, group=48, k=48)  # per channel, K not a multiple of 32
    assert not _applies(8, dtype=torch.float32)
    assert not _applies(2)  # the GEMV's rows


def test_wint_mma_applies_by_rows_and_size():
    """int4 at 3..1024 rows; 8-bit codes at 33..512, and at 3..MMA_W8_SMALL_MAX_M (32) only for
    weights of at most MMA_W8_SMALL_MAX_CODES codes (quant_gemm's tile kernel for larger ones);
    past the largest M, dequantize + cuBLAS."""
    assert _applies(1024) and not _applies(1025)
    assert _applies(65, bits=8, group=256) and _applies(512, bits=8, group=256)
    assert not _applies(513, bits=8, group=256)
    small_n = mma.MMA_W8_SMALL_MAX_CODES // 4096  # qkv-sized at K = 4096
    assert _applies(16, bits=8, group=4096, k=4096, n=small_n)
    assert not _applies(16, bits=8, group=4096, k=4096, n=small_n + 1)
    assert not _applies(32, bits=8, group=4096, k=4096, n=small_n + 1)
    assert _applies(33, bits=8, group=4096, k=4096, n=small_n + 1)
    assert _applies(100, bits=8, group=4096, k=4096, n=small_n + 1)


@needs_triton
@pytest.mark.parametrize("bits, group, m", [(4, 64, 5), (8, -1, 70)])
def test_wint_gemm_dispatches_decode_batches_to_wint_mma(monkeypatch, bits, group, m):
    """quant_gemm sends symmetric int4 at 3..MMA_MAX_M[4] (1024) rows and 8-bit codes at 33..512
    here (bias and the gated silu after)."""
    calls = []
    real = qg.wint_mma_gemm
    monkeypatch.setattr(qg, "wint_mma_gemm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(3)
    qweight, scales, _, w64 = make_weight(128, 256, bits, group, True, gen=gen)
    x = torch.randn(m, 256, generator=gen).half()
    bias = torch.randn(128, generator=gen).half()
    out = qg.wint_gemm_triton(x, qweight, scales.half(), None, bits, group, bias=bias,
                              gated=True)  # fmt: skip
    y = naive(x, w64) + bias.double()
    gate, up = y.chunk(2, dim=-1)
    assert calls == [1]
    assert_rel_close(out, torch.nn.functional.silu(gate) * up, 5e-3, f"gated W{bits} mma")


@needs_triton
@pytest.mark.parametrize("bits, group, rows", [(8, -1, 35), (4, 64, 100), (8, -1, 150),
                                               (4, 64, 300)])
def test_wint_linear_takes_wint_mma_past_the_tile_kernel_rows(monkeypatch, bits, group, rows):
    """65..MMA_MAX_M rows of a symmetric layer go to wint_mma, not to dequantize + cuBLAS: 70
    rows of 8-bit codes (one 128-row x tile), 200 of int4 (one 256-row x tile), 300 of 8-bit
    codes and 600 of int4 (two and three 256-row x tiles, the last ragged); the default tiles
    at that M, against float64."""
    calls = []
    real = qg.wint_mma_gemm
    monkeypatch.setattr(qg, "wint_mma_gemm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(4)
    qweight, scales, _, w64 = make_weight(64, 128, bits, group, True, gen=gen)
    x = torch.randn(2, rows, 128, generator=gen).half()
    out = qg.wint_linear_triton(x, qweight, scales.half(), None, bits, group)
    assert calls == [1] and out.shape == (2, rows, 64)
    assert_rel_close(out.reshape(2 * rows, 64), naive(x.reshape(2 * rows, 128), w64), 3e-3,
                     f"W{bits} {2 * rows} rows")  # fmt: skip


class Launch(NamedTuple):
    m: int  # rows of x
    n: int  # rows of W
    block_n: int
    even_m: bool  # x loaded without row masks


def _spy_launches(monkeypatch) -> list[Launch]:
    """Every launch of the kernel from here on."""
    seen = []
    real = mma._wint_mma_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(Launch(args[7], args[8], kwargs["BLOCK_N"], kwargs["EVEN_M"]))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(mma, "_wint_mma_kernel", Spy())
    return seen


@needs_triton
def test_wint_mma_takes_whole_x_tiles_then_the_rest(monkeypatch):
    """Up to half an x tile past whole 256-row tiles that fill the SMs: one launch for those,
    without row masks, one for the rest in tiles of its own size, into one output; further
    past, or with fewer whole tiles than SMs, one masked launch with a ragged last tile (here
    888 columns: rows padded to 16). 8-bit codes split only where their rest runs here anyway
    (_w8_small_m_lags)."""
    seen = _spy_launches(monkeypatch)
    sms = mma.num_sms(torch.device("cpu"))
    for n, m, expected in ((128 * sms, 261, [(256, True), (5, False)]),
                           (128 * sms, 400, [(400, False)]),
                           (128 * (sms - 1) - 8, 261, [(261, False)])):  # not every SM
        seen.clear()
        _check(n, 128, 4, 128, m, torch.float16, "cpu", seed=m)
        assert [(s.m, s.even_m) for s in seen] == expected, (n, m)
    # 8-bit codes: not where their rest would run slow here (a few rows of a large weight)
    launches = []
    monkeypatch.setattr(mma, "_launch", lambda x, *a: launches.append(x.shape[0]))
    n, k = mma.MMA_W8_SMALL_MAX_CODES // 4096 + 16, 4096
    words, scales = torch.zeros(n, k // 4, dtype=torch.int32), torch.ones(n, 1).half()
    for m, expected in ((264, [264]), (300, [256, 44])):
        launches.clear()
        mma.wint_mma_gemm(torch.zeros(m, k).half(), words, scales, 8, k)
        assert launches == expected


@needs_triton
def test_wint_mma_takes_w_rows_past_whole_waves_in_narrower_tiles(monkeypatch):
    """256-row x tiles, one program an SM (a nominal 8 off CUDA): 5 row tiles x 2 x tiles are
    one whole wave and 2 tiles more; W's first 4 row tiles (512 rows) take one launch, the
    last 128 rows a second in 64-row tiles, 4 programs for the 2 tiles (no K split), into the
    one output. A rest that would not fit one wave of those, or whole waves only: one launch."""
    seen = _spy_launches(monkeypatch)
    _check(640, 128, 4, 128, 512, torch.float16, "cpu", seed=5)
    assert seen == [Launch(512, 512, 128, True), Launch(512, 128, 64, True)]
    for n in (128 * 7, 128 * 8):  # 14 tiles: a rest of 3 row tiles; 16 tiles: two waves
        seen.clear()
        _check(n, 128, 4, 128, 512, torch.float16, "cpu", seed=n)
        assert seen == [Launch(512, n, 128, True)], n



def test_wint_mma_head_rows_on_132_sms(monkeypatch):
    """Which Llama-3.1-8B layers split W's rows on the H100's 132 SMs: gate_up at 512 rows (448
    tiles: 198 row tiles in 3 waves, 26 left as 104 programs) and qkv at 1024 (192 tiles: 33 row
    tiles a wave, 15 left as 120 programs); not gate_up at 256 or 1024 rows (92 / 26 row tiles
    left, 184 / 208 programs: more than a wave), nor layers of fewer tiles than SMs, nor x tiles
    under 256 rows."""
    monkeypatch.setattr(mma, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")

    def head(m, n, k=4096):
        return mma._head_rows(mma.wint_mma_tiles(m, n, k, 128, 4, cpu), m, n, cpu)

    assert head(512, 28672) == 198 * 128 and head(1024, 6144) == 33 * 128
    assert head(256, 28672) == head(1024, 28672) == 0
    assert head(512, 6144) == head(512, 4096) == head(512, 4096, 14336) == 0
    assert head(128, 28672) == 0

def test_wint_mma_tiles_past_one_x_tile():
    """Past MMA_X_TILE_MAX rows x is cut into 256-row tiles: int4 and 8-bit codes both take 128
    rows of W in 8 warps there (8-bit codes with 4 stages where every x tile is full, 2 where
    the last is ragged)."""
    cpu = torch.device("cpu")
    int4 = mma.wint_mma_tiles(700, 28672, 4096, 128, 4, cpu)
    w8 = mma.wint_mma_tiles(512, 28672, 4096, 4096, 8, cpu)
    assert (int4.block_n, int4.block_m, int4.num_warps, int4.num_stages) == (
        128, mma.MMA_X_TILE_MAX, 8, 2)
    assert (w8.block_n, w8.block_m, w8.num_warps, w8.num_stages) == (128, 256, 8, 4)
    assert mma.wint_mma_tiles(300, 28672, 4096, 4096, 8, cpu).num_stages == 2
    assert mma.wint_mma_tiles(100, 4096, 4096, 128, 4, cpu).num_stages == 2
    assert mma.wint_mma_tiles(128, 4096, 4096, 128, 4, cpu).num_stages == 3


@gpu
@pytest.mark.parametrize("bits, group, n, k, m, out_dtype", [
    (8, -1, 28672, 4096, 100, torch.float32), (8, -1, 8192, 128, 65, torch.float32),
    (4, 128, 28672, 4096, 40, torch.float32), (4, 128, 8192, 128, 200, torch.bfloat16),
])  # fmt: skip
def test_gpu_wint_mma_ragged_x_tiles_repeat_exactly(bits, group, n, k, m, out_dtype):
    """Eight warps against a ragged x tile: with 3-4 stages these returned wrong results that
    differed from run to run (an LM head's float32 logits at 65-127 rows, int4 NaNs at 40
    rows, kiln-tiny's K = 128); the default tiles give the float64 result, bit for bit again."""
    gen = torch.Generator().manual_seed(m)
    qweight, scales, _, w64 = make_weight(n, k, bits, group, True, gen=gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    words, s, xc = qg._words(qweight, bits).cuda(), scales.to(torch.bfloat16).cuda(), x.cuda()
    g = k if group == -1 else group
    assert mma.wint_mma_tiles(m, n, k, g, bits, xc.device).num_warps == 8
    runs = [mma.wint_mma_gemm(xc, words, s, bits, g, out_dtype=out_dtype) for _ in range(4)]
    assert_rel_close(runs[0].cpu(), naive(x, w64), 2e-2, f"W{bits} {n}x{k} m={m}")
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [3, 16, 64, 100, 200, 300, 1000])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336), (1000, 4096)])
def test_gpu_wint_mma_default_tiles(n, k, m, dtype):
    """The PTX decodes (prmt + lop3 + packed FMA) at Llama-3.1-8B shapes with the default tiles,
    x tiles of up to 32 rows (scales after the dot) and past (scales folded)."""
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    _check(n, k, 4, 128, m, dtype, "cuda", tol=tol, seed=m)
    _check(n, k, 4, 64, m, dtype, "cuda", tol=tol, seed=m + 1, smooth=True)
    _check(n, k, 8, -1, m, dtype, "cuda", tol=tol, seed=m + 2)
    _check(n, k, 4, -1, m, dtype, "cuda", tol=tol, seed=m + 3, smooth=True)


@gpu
@pytest.mark.parametrize("bits, group", [(4, 128), (8, -1)])
def test_gpu_wint_mma_wide_n_tiles(bits, group):
    """65-128 rows at the merged gate_up's N, the default tiles there: 128 rows of W in 8 warps
    against one 128-row x tile, group scales folded into the weights."""
    tiles = mma.wint_mma_tiles(100, 28672, 4096, group, bits, torch.device("cuda"))
    assert tiles.num_warps == 8 and tiles.block_n == 128 and tiles.block_m == 128
    _check(28672, 4096, bits, group, 100, torch.bfloat16, "cuda", tol=2e-2, seed=bits)


@gpu
@pytest.mark.parametrize("bits, group", [(4, 128), (8, -1)])
def test_gpu_wint_mma_w_rows_past_whole_waves(monkeypatch, bits, group):
    """gate_up at 512 rows: 448 tiles of 128 x 256 are 3.4 waves of the SMs (132 on the H100):
    the rows of W in whole waves take one launch, the rest 64-row tiles in a second."""
    seen = _spy_launches(monkeypatch)
    _check(28672, 4096, bits, group, 512, torch.bfloat16, "cuda", tol=2e-2, seed=bits)
    sms = mma.num_sms(torch.device("cuda"))
    head = 2 * 224 // sms * sms // 2 * 128
    assert seen == [Launch(512, head, 128, True), Launch(512, 28672 - head, 64, True)]

@gpu
@pytest.mark.parametrize("bits, group, m, launches", [
    (4, 128, 264, [(256, True), (8, False)]), (4, 128, 300, [(256, True), (44, False)]),
    (8, -1, 264, [(264, False), (264, False)]), (8, -1, 300, [(256, True), (44, False)]),
    (4, 128, 512, [(512, True), (512, True)]),  # W's rows in two launches (below)
])  # fmt: skip
def test_gpu_wint_mma_whole_x_tiles_then_the_rest(monkeypatch, bits, group, m, launches):
    """At the merged gate_up's N the whole 256-row x tiles fill the SMs: M up to half a tile
    past them takes a second launch for the rest (8-bit codes not for 8 rows of it); launches
    whose x tiles are all full (256 and 512 rows; not 8 rows in a 16-row tile) load x
    without row masks. Two x tiles of 256 rows (512, and 8-bit codes at 264) are 3.4 waves of
    tiles: W's rows take two launches too (test_gpu_wint_mma_w_rows_past_whole_waves)."""
    seen = _spy_launches(monkeypatch)
    _check(28672, 4096, bits, group, m, torch.bfloat16, "cuda", tol=2e-2, seed=m)
    assert [(s.m, s.even_m) for s in seen] == launches

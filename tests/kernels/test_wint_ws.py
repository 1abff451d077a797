"""Persistent warp-specialized weight-only GEMM (kiln/kernels/wint_ws.py, Gluon sm_90): on the
GPU against float64 math on the dequantized weight (fresh random codes and scales, int4 group
64 / 128 / per channel and 8-bit per channel, bf16 and fp16 x, M and N that are no multiple of
a tile); on CPU, its sm_90 compile and what it accepts."""

import re

import pytest
import torch
from kernel_testing import assert_rel_close, gpu, needs_triton, sm90_compile_report
from test_quant_gemm import make_weight, naive

from kiln.kernels import quant_gemm as qg
from kiln.kernels import wint_mma as mma
from kiln.kernels import wint_ws as ws


def _check(n, k, bits, group, m, dtype=torch.bfloat16, tiles=None, seed=0, out_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    qweight, scales, _, w64 = make_weight(n, k, bits, group, True, gen=gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    expected = naive(x, w64)
    words = qg._words(qweight, bits).cuda()
    out = ws.wint_ws_gemm(x.cuda(), words, scales.to(dtype).cuda(), bits,
                          k if group == -1 else group, out_dtype, tiles)
    assert out.dtype == (out_dtype or dtype) and out.shape == (m, n)
    assert_rel_close(out.cpu(), expected, 3e-3, f"W{bits} {n}x{k} g{group} m={m} {tiles}")
    return out


@gpu
@pytest.mark.parametrize("bits, group", [(4, 128), (4, 64), (4, -1), (8, -1)])
@pytest.mark.parametrize("n, k, m", [(4096, 4096, 512), (1000, 1024, 300), (6144, 4096, 257)])
def test_gpu_wint_ws_matches_float64(bits, group, n, k, m):
    """Ragged N (the last W tile's rows past N are TMA's zeros, not stored) and M (the last x
    tile's rows likewise), more tiles than SMs (the persistent loop's second pass)."""
    _check(n, k, bits, group, m)


@gpu
@pytest.mark.parametrize("tiles", [ws.WsTiles(128, 128, 6), ws.WsTiles(64, 256, 4),
                                   ws.WsTiles(128, 256, 2), ws.WsTiles(128, 64, 8, 4),
                                   ws.WsTiles(64, 32, 8, 8), ws.WsTiles(64, 128, 3, 2)])
@pytest.mark.parametrize("bits, group", [(4, 128), (8, -1)])
def test_gpu_wint_ws_tiles(bits, group, tiles):
    """One warpgroup or two, x tiles of 32 to 256 rows, a ring of 2 to 8 stages, K in 1 to 8
    splits; K = 14336 (down_proj's: 224 steps, the ring wrapping many times a tile; 28 steps
    a split of 8, whose group scales start mid-K)."""
    _check(2048, 14336, bits, group, 384, tiles=tiles)


@gpu
@pytest.mark.parametrize("m, tiles", [(40, ws.WsTiles(64, 64, 8)), (100, ws.WsTiles(64, 128, 8, 2)),
                                      (330, ws.WsTiles(128, 256, 5)),
                                      (330, ws.WsTiles(64, 256, 6))])
def test_gpu_wint_ws_last_x_tile(m, tiles):
    """Fewer rows than a tile (its box partly past M), and a ragged last x tile: its box ends at
    M (the rows it shares with the tile before stored once), in 128 x 256 tiles too."""
    _check(1000, 4096, 4, 128, m, tiles=tiles, seed=m)


@gpu
@pytest.mark.parametrize("m, tiles", [(160, ws.WsTiles(128, 128, 6, block_m2=32)),
                                      (300, ws.WsTiles(64, 128, 8, block_m2=32)),
                                      (100, ws.WsTiles(128, 128, 6, block_m2=64)),
                                      (700, ws.WsTiles(64, 256, 5, block_m2=64)),
                                      (40, ws.WsTiles(64, 64, 8, block_m2=32))])
@pytest.mark.parametrize("bits, group", [(4, 128), (8, -1)])
def test_gpu_wint_ws_two_wgmmas_a_tile(bits, group, m, tiles):
    """Tiles of rows of x that are no power of two, two wgmmas on one decoded operand (and
    per-channel scales on both accumulators): a whole tile, ragged last tiles (shifted to end at
    M in 64-row tiles of W, not in 128-row ones), fewer rows than the first wgmma's."""
    _check(1000, 2048, bits, group, m, tiles=tiles, seed=m)


@gpu
@pytest.mark.parametrize("bits, group", [(4, 64), (8, -1)])
def test_gpu_wint_ws_split_k_repeats_exactly(bits, group):
    """K split 4 ways over ragged M and N (tiles past both edges): the splits' partials are
    added in split order whatever order they arrive in, so a second and third run give the
    same bits, and every arrival counter is back to zero after each launch."""
    tiles = ws.WsTiles(64, 64, 6, 4)
    first = _check(1000, 4096, bits, group, 200, tiles=tiles, seed=5)
    for _ in range(2):
        assert torch.equal(_check(1000, 4096, bits, group, 200, tiles=tiles, seed=5), first)
        assert int(mma.arrival_counters(first.device).abs().sum()) == 0


@gpu
def test_gpu_wint_ws_fp16_and_repeatable():
    """fp16 x (the decode's f16 asm), and the same bits on a second run: every sum is in a
    fixed order whatever the schedule."""
    first = _check(3000, 2048, 4, 128, 700, dtype=torch.float16, seed=3)
    second = _check(3000, 2048, 4, 128, 700, dtype=torch.float16, seed=3)
    assert torch.equal(first, second)


@gpu
@pytest.mark.parametrize("bits, group, n, k, m", [(8, -1, 9216, 1024, 300),
                                                  (4, 128, 6144, 2048, 640)])
def test_gpu_wint_ws_two_launches(bits, group, n, k, m):
    """ws_plan's two launches over W's rows (on the H100's 132 SMs; other SM counts may plan
    otherwise, and the test then says so), each writing its columns of one output."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert len(ws.ws_plan(m, n, k, sms, bits)) == 2, f"one launch on {sms} SMs"
    _check(n, k, bits, group, m)


@gpu
def test_gpu_wint_ws_float32_output_fits_shared_memory():
    """A float32 output (an LM head's logits) at a shape whose bf16 pick's store scratch would
    not fit it then (test_ws_tiles_fit_shared_memory): the launch takes another tiling."""
    _check(6144, 4096, 8, -1, 176, out_dtype=torch.float32)


def test_wint_ws_tiles_name_what_is_wrong():
    with pytest.raises(ValueError, match="block_n=96"):
        ws.WsTiles(block_n=96)
    with pytest.raises(ValueError, match="block_m=100"):
        ws.WsTiles(block_m=100)
    with pytest.raises(ValueError, match="stages=1"):
        ws.WsTiles(stages=1)
    with pytest.raises(ValueError, match="block_m2=128: 0 or a multiple of 16 less than"):
        ws.WsTiles(block_m=128, block_m2=128)
    with pytest.raises(ValueError, match="block_m2=32 with split=2"):
        ws.WsTiles(block_m=128, block_m2=32, split=2)
    tiles = ws.WsTiles(128, 128, 6, block_m2=32)
    assert tiles.rows == 160 and tiles.name == "128x128+32s6k1"


def test_wint_ws_applies_only_on_cuda():
    x = torch.randn(512, 4096, dtype=torch.bfloat16)
    words = torch.zeros(128, 512, dtype=torch.int32)
    assert not ws.wint_ws_applies(x, words, torch.ones(128, 32, dtype=torch.bfloat16), 4, 128)


@gpu
def test_gpu_wint_ws_applies_to_formats():
    """Group 32 (a step holds two groups), 8-bit group-wise scales, K not a multiple of 128,
    fp32 x and scales in another dtype than x's are not taken; the formats above are."""
    def applies(bits, group, k=4096, dtype=torch.bfloat16, scale_dtype=None):
        x = torch.randn(512, k, device="cuda").to(dtype)
        words = torch.zeros(256, k * bits // 32, device="cuda", dtype=torch.int32)
        scales = torch.ones(256, k // group if group < k else 1, device="cuda",
                            dtype=scale_dtype or dtype)
        return ws.wint_ws_applies(x, words, scales, bits, group)
    assert applies(4, 128) and applies(4, 64) and applies(4, 4096) and applies(8, 4096)
    assert not applies(4, 32) and not applies(8, 128) and not applies(4, 96, k=96 * 30)
    assert not applies(4, 64, k=64 * 65)  # an odd number of 64-code steps
    assert not applies(4, 128, dtype=torch.float32)
    assert not applies(4, 128, scale_dtype=torch.float32)


@needs_triton
@pytest.mark.parametrize("bits, group, block_n, block_m, split, block_m2, out_fp32, ragged",
                         [(4, 128, 128, 256, 1, 0, False, True),
                          (4, 128, 128, 256, 1, 0, False, False),
                          (8, 4096, 128, 256, 1, 0, False, True),
                          (4, 4096, 64, 128, 1, 0, False, False),
                          (8, 4096, 128, 64, 4, 0, False, True),
                          (4, 64, 64, 32, 2, 0, False, True),
                          (4, 128, 128, 128, 1, 32, False, True),
                          (8, 4096, 128, 128, 1, 64, False, True),
                          (8, 4096, 64, 128, 1, 32, True, True)])
def test_wint_ws_compiles_for_sm90(bits, group, block_n, block_m, split, block_m2, out_fp32,
                                   ragged, tmp_path):
    """The kernel compiles for sm_90 on a CPU host (in a subprocess: this package's conftest
    turns the interpreter on), warp-specialized (the producer warp gives up registers, the
    consumers take them), x and words by TMA, and its K loop is what the design says: two
    steps of 4 wgmmas of 64 x block_m x 16 with the decoded weights in registers, each left in
    flight over the next step's decode (the wait leaves one group pending, so ptxas did not
    serialize them), no instruction touching an in-flight wgmma's operand or accumulator
    registers anywhere in the kernel, no local memory, and (K not split) 16-byte stores of the
    output (float32 too). With a second wgmma (block_m2) each step issues both on the same
    operand, the smaller first (_step), and the wait leaves one step's pair pending.
    smem_bytes bounds its shared memory.
    Both variants (_shifts): for a ragged M, whose last x box shifts back to end at M, and for
    an M of whole boxes."""
    report = sm90_compile_report("wint_ws", "--bits", str(bits), "--group", str(group),
                                 "--block-n", str(block_n), "--block-m", str(block_m),
                                 "--split", str(split), "--block-m2", str(block_m2),
                                 *(["--ragged-m"] if ragged else []),
                                 *(["--out-fp32"] if out_fp32 else []),
                                 "--dump", str(tmp_path),
                                 timeout=600)
    ptx = (tmp_path / "wint_ws.ptx").read_text()
    loop = (tmp_path / "k_loop.sass").read_text()
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert "cp.async.bulk.tensor" in ptx
    widths = [n for n in (block_m2, block_m) if n]  # in the order they are issued
    for n in widths:
        assert len(re.findall(rf"HGMMA\.64x{n}x16\.F32\.BF16 R\d+, R\d+", loop)) == 8, loop
    issued = [int(n) for n in re.findall(r"HGMMA\.64x(\d+)x16", loop)]
    assert issued == [n for n in widths for _ in range(4)] * 2, issued
    assert loop.count(f"WARPGROUP.DEPBAR.LE gsb0, {'0x2' if block_m2 else '0x1'}") == 2, loop
    assert report["wgmma_hazards"] == []
    assert report["spill_stack_bytes"] == 0
    tiles = ws.WsTiles(block_n, block_m, report["options"]["stages"], split, block_m2)
    assert report["shared_bytes"] <= ws.smem_bytes(bits, tiles, 4 if out_fp32 else 2)
    if split == 1:  # the output stored 8 rows of W (16 bytes) at a time, not value by value
        sass = (tmp_path / "wint_ws.sass").read_text()
        assert "STG.E.128" in sass and "STG.E.U16" not in sass


def test_ws_tiles_least_modelled_time():
    """On the H100's 132 SMs: gate_up (N = 28672) keeps 128 x 256 tiles at 512 rows; down_proj
    (K = 14336) at 128 rows splits K 2 ways over its 64 tiles of 64 x 128 (one round of 128
    units), and at 512 rows takes 64 x 256 tiles, whose K steps slow less with x's 14 MiB than
    128 x 128's (the sweep: 86-91 against 100-106 us); o_proj at 64 rows splits K 2 ways over
    64 tiles of 64 x 64; rows that are no power of two take a tile of two wgmmas: gate_up at
    160 rows one 128 + 32-row tile a 128 rows of W (224 units), qkv at 320 rows 256 + 64; a K
    that no split divides into 128-code halves is not split, even one that is no multiple of
    128."""
    assert ws.ws_tiles(512, 28672, 4096, 132, 4) == ws.WsTiles(128, 256, 5)
    assert ws.ws_tiles(128, 4096, 14336, 132, 4) == ws.WsTiles(64, 128, 8, split=2)
    assert ws.ws_tiles(512, 4096, 14336, 132, 4) == ws.WsTiles(64, 256, 6)
    assert ws.ws_tiles(64, 4096, 4096, 132, 4) == ws.WsTiles(64, 64, 8, split=2)
    assert ws.ws_tiles(160, 28672, 4096, 132, 4) == ws.WsTiles(128, 128, 6, block_m2=32)
    assert ws.ws_tiles(320, 6144, 4096, 132, 4) == ws.WsTiles(64, 256, 5, block_m2=64)
    # with fewer rows than a tile each row past M costs: 48 rows in 64-row tiles
    assert ws.ws_tiles(48, 6144, 4096, 132, 4).block_m == 64
    assert ws.ws_tiles(64, 4096, 384 * 3, 132, 4).split == 1
    assert ws.ws_tiles(100, 4096, 64 * 65, 132, 4).split == 1  # (wint_ws_applies then says no)
    # fewer SMs, fewer units a round: 100 SMs at 256 rows of qkv
    assert ws.ws_tiles(256, 6144, 4096, 100, 4) == ws.WsTiles(64, 256, 6)


def test_last_x_box_shifts_only_where_m_is_ragged():
    """The shifted variant (_x_start) only where M holds a whole box and is no multiple of it:
    not at a multiple (decode at 512 rows ran 0.2% slower with the shift's code), nor with fewer
    rows than one box (its one box starts at row 0 either way)."""
    big, pair = ws.WsTiles(128, 256, 5), ws.WsTiles(128, 128, 6, block_m2=64)
    assert ws._shifts(496, big) and ws._shifts(776, big) and ws._shifts(336, pair)
    assert not ws._shifts(512, big) and not ws._shifts(1024, big) and not ws._shifts(384, pair)
    assert not ws._shifts(200, big) and not ws._shifts(192, pair)


def test_ws_plan_takes_the_last_round_apart():
    """gate_up at 512 rows in 128 x 256 tiles is 448 units on 132 SMs: the plan runs 396 of
    them (3 whole rounds, 25344 rows of W), then the 3328 rows left in 64 x 256 tiles, one
    launch over every SM. Where the last round is full enough, one launch (qkv at 256 rows);
    also where two launches model less than TWO_LAUNCH_MARGIN faster (gate_up at 880 rows: 0.4%
    modelled, 8% slower measured). Launches cover W's rows in order from multiples of 64."""
    assert ws.ws_plan(512, 28672, 4096, 132, 4) == (
        ws.WsLaunch(0, 25344, ws.WsTiles(128, 256, 5)),
        ws.WsLaunch(25344, 3328, ws.WsTiles(64, 256, 6)))
    assert ws.ws_plan(256, 6144, 4096, 132, 4) == (
        ws.WsLaunch(0, 6144, ws.ws_tiles(256, 6144, 4096, 132, 4)),)
    assert ws.ws_plan(880, 28672, 4096, 132, 4) == (
        ws.WsLaunch(0, 28672, ws.ws_tiles(880, 28672, 4096, 132, 4)),)
    for m in (48, 160, 300, 640, 1024):
        for n, k in ((6144, 4096), (28672, 4096), (4096, 14336), (9216, 2048)):
            plan = ws.ws_plan(m, n, k, 132, 8, 4)
            assert [p.row0 for p in plan] == [sum(p.rows for p in plan[:i])
                                              for i in range(len(plan))]
            assert sum(p.rows for p in plan) == n and all(p.row0 % 64 == 0 for p in plan)
            assert all(ws.smem_bytes(8, p.tiles, 4) <= ws.SMEM_BUDGET for p in plan)


def test_ws_tiles_fit_shared_memory():
    """64 x (128 + 64) tiles of 8-bit codes fit a bf16 output's store scratch, not a float32
    one's (an LM head's logits): ws_tiles then picks another."""
    tiles = ws.WsTiles(64, 128, 8, block_m2=64)
    assert ws.smem_bytes(8, tiles) <= ws.SMEM_BUDGET < ws.smem_bytes(8, tiles, out_bytes=4)
    assert ws.ws_tiles(176, 6144, 4096, 132, 8) == tiles
    picked = ws.ws_tiles(176, 6144, 4096, 132, 8, out_bytes=4)
    assert picked != tiles and ws.smem_bytes(8, picked, out_bytes=4) <= ws.SMEM_BUDGET


def test_wint_ws_preferred_by_rows_code_width_and_output():
    """From WS_MIN_M rows (32 of 8-bit codes, 48 of int4) to WS_MAX_M: 4096 rows of a 16-bit
    output, 2048 of float32 logits; whatever the shape."""
    assert ws.wint_ws_preferred(32, 8) and not ws.wint_ws_preferred(32, 4)
    assert ws.wint_ws_preferred(48, 4) and ws.wint_ws_preferred(200, 4)
    assert ws.wint_ws_preferred(4096, 8) and ws.wint_ws_preferred(4096, 4)
    assert not ws.wint_ws_preferred(31, 8) and not ws.wint_ws_preferred(47, 4)
    assert not ws.wint_ws_preferred(4097, 4) and not ws.wint_ws_preferred(4097, 8)
    assert ws.wint_ws_preferred(2048, 4, out_bytes=4)
    assert not ws.wint_ws_preferred(2049, 8, out_bytes=4)
    assert not ws.wint_ws_preferred(128, 2)  # a code width it does not decode


@gpu
@pytest.mark.parametrize("bits, group, n, k, m, out_dtype, taken", [
    (4, 128, 4096, 4096, 512, None, True), (8, -1, 4096, 14336, 1024, None, True),
    (4, 128, 16384, 4096, 384, None, True), (8, -1, 4096, 4096, 128, None, True),
    (4, 128, 4096, 4096, 40, None, False), (8, -1, 4096, 4096, 2048, None, True),
    (4, 128, 1024, 4096, 4096, None, True), (4, 128, 1024, 4096, 4104, None, False),
    (8, -1, 4096, 4096, 32, None, True),
    (4, 128, 1024, 4096, 2048, torch.float32, True),
    (8, -1, 1024, 4096, 2056, torch.float32, False),
])  # fmt: skip
def test_gpu_quant_gemm_dispatches_to_wint_ws(monkeypatch, bits, group, n, k, m, out_dtype,
                                              taken):
    """quant_gemm's Triton path (wint_linear_triton, as the quantized layers call it) takes
    this kernel where wint_ws_preferred says so: up to 4096 rows, 8-bit codes at 1024 rows and
    int4 at 4096 too, past wint_mma's range; float32 logits up to 2048 rows. Not int4 at 40
    rows, nor past those, where the weights are dequantized for cuBLAS. The result matches
    float64 math."""
    calls = []
    real = qg.wint_ws_gemm
    monkeypatch.setattr(qg, "wint_ws_gemm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(7)
    qweight, scales, _, w64 = make_weight(n, k, bits, group, True, gen=gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    out = qg.wint_linear_triton(x.cuda(), qweight.cuda(), scales.to(torch.bfloat16).cuda(), None,
                                bits, group, out_dtype=out_dtype)
    assert bool(calls) == taken
    assert out.dtype == (out_dtype or torch.bfloat16)
    assert_rel_close(out.cpu(), naive(x, w64), 3e-3, f"W{bits} {n}x{k} m={m}")

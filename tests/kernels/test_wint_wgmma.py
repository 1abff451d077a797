"""The Gluon weight-only GEMM for large batches (kiln/kernels/wint_wgmma.py): compiled for sm_90
on the CPU host (Gluon has no interpreter), and on the GPU against float64 math on the weights
the kernel is meant to use (group scales: the dequantized reference's, rounded to x's dtype;
per-channel scales: exact, applied to the float32 sum), with float32 outputs so that the
tolerance measures the kernel and not the output rounding."""

import json
import os
import subprocess
import sys

import pytest
import torch
from kernel_testing import assert_rel_close, gpu, needs_triton
from test_quant_gemm import make_weight

from kiln.kernels import quant_gemm as qg
from kiln.kernels import wint_wgmma as wg

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "sm90_compile.py")
FORMATS = [(4, 128), (4, 64), (4, -1), (8, -1), (8, 128)]  # (bits, group); -1: per channel


@needs_triton
@pytest.mark.parametrize("args", [
    ["--bits", "4", "--block-m", "256", "--block-n", "128"],
    ["--bits", "8", "--per-channel", "--block-m", "128", "--block-n", "64"],
])  # fmt: skip
def test_wint_wgmma_compiles_for_sm90(args):
    """Both code widths compile without spills. The MMA warps' K loop reads the codes from
    shared memory (the TMA copies are the loader warp's) and issues one wgmma per 16 codes of
    the 64-code step, A in registers."""
    if not wg.HAS_GLUON:
        pytest.skip("this triton has no Gluon Hopper API")
    run = subprocess.run([sys.executable, SCRIPT, "wint_wgmma", *args],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert 0 < report["registers"] <= 255 and report["spill_stack_bytes"] == 0
    assert report["k_loop_wgmmas"] == wg.BLOCK_K // 16
    assert "LDS" in report["k_loop_loads"] and "UTMALDG" not in report["k_loop_loads"]


def test_wint_wgmma_applies_only_to_cuda_hopper_inputs():
    x = torch.randn(512, 256, dtype=torch.bfloat16)
    assert not wg.wint_wgmma_applies(x, torch.ones(64, 2, dtype=torch.bfloat16), 4, 128)


def test_wint_wgmma_tiles_and_split():
    """x tiles of the next power of two from 64 to 256 rows; K split while the tiles leave SMs
    idle and every split keeps MIN_STEPS_PER_SPLIT steps."""
    assert [wg.wint_wgmma_tiles(m, 4096, 4).block_m for m in (50, 100, 129, 256, 1000)] == \
        [64, 128, 256, 256, 256]
    tiles = wg.wint_wgmma_tiles(256, 4096, 4)
    cpu = torch.device("cpu")  # a nominal 8 SMs
    assert wg._split(tiles, 2, 64, cpu) == 4
    assert wg._split(tiles, 2, 16, cpu) == 2  # 8 steps a split at least
    assert wg._split(tiles, 16, 64, cpu) == 1


def _check(n, k, bits, group, m, dtype, tiles=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qweight, scales, _, _ = make_weight(n, k, bits, group, True, gen=gen)
    scales = scales.to(dtype)
    g = k if group == -1 else group
    # the weights the kernel multiplies: rounded to dtype where group scales are folded in
    w = qg.wint_dequant_ref(qweight, scales, None, bits, g, dtype if group != -1 else torch.float64)
    x = torch.randn(m, k, generator=gen).to(dtype)
    expected = x.double() @ w.double().t()
    words, scales, x = qg._words(qweight, bits).cuda(), scales.cuda(), x.cuda()
    assert wg.wint_wgmma_applies(x, scales, bits, g) or m < wg.WGMMA_MIN_M[bits]
    out = wg.wint_wgmma_gemm(x, words, scales, bits, g, torch.float32, tiles)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert_rel_close(out.cpu(), expected, 1e-5, f"W{bits} g{group} {n}x{k} m={m} {tiles}")
    return x, words, scales, g


@gpu
@pytest.mark.parametrize("bits, group", FORMATS)
@pytest.mark.parametrize("n, k, m", [(1000, 1024, 300), (6144, 4096, 256), (4096, 14336, 512),
                                     (256, 1024, 2048)])
def test_gpu_wint_wgmma_default_tiles(bits, group, n, k, m):
    """Llama-3.1-8B shapes and ragged ones (N and M not multiples of the tiles: TMA zero-fills
    past the edges and the stores are masked), with the default tiles and K split."""
    _check(n, k, bits, group, m, torch.bfloat16, seed=n + m + bits)


@gpu
@pytest.mark.parametrize("bits, group", [(4, 128), (8, -1)])
@pytest.mark.parametrize("tiles", [
    wg.WgmmaTiles(64, 64, 3, 1), wg.WgmmaTiles(128, 128, 4, 2), wg.WgmmaTiles(256, 64, 5, 4),
    wg.WgmmaTiles(128, 128, 4, 3), wg.WgmmaTiles(256, 128, 4, 8), wg.WgmmaTiles(256, 128, 2, 1),
])  # fmt: skip
def test_gpu_wint_wgmma_tiles(bits, group, tiles):
    """Every tile shape and ring depth the sweep may pick (down to two stages, where every step
    waits for its copies); splits of 3 (uneven step counts) to 8, whose partials the last
    program adds."""
    _check(1000, 2048, bits, group, 700, torch.bfloat16, tiles, seed=tiles.block_n)


@gpu
@pytest.mark.parametrize("bits, group", [(4, 128), (8, -1)])
def test_gpu_wint_wgmma_fp16_and_16bit_output(bits, group):
    """fp16 x and scales (the f16x2 decodes), and the default 16-bit output against the same
    float64 math within its rounding."""
    x, words, scales, g = _check(768, 2048, bits, group, 333, torch.float16, seed=7)
    out = wg.wint_wgmma_gemm(x, words, scales, bits, g)
    ref = wg.wint_wgmma_gemm(x, words, scales, bits, g, torch.float32)
    assert out.dtype == torch.float16
    assert_rel_close(out.float().cpu(), ref.cpu(), 1e-3, "fp16 output")


@gpu
def test_gpu_wint_wgmma_split_is_deterministic():
    """The split-K partials are added in split order by whichever program arrives last: the
    same bits every run, and the counters are reset for the next launch."""
    x, words, scales, g = _check(2048, 4096, 4, 128, 512, torch.bfloat16,
                                 wg.WgmmaTiles(256, 128, 4, 8), seed=3)
    tiles = wg.WgmmaTiles(256, 128, 4, 8)
    runs = [wg.wint_wgmma_gemm(x, words, scales, 4, g, tiles=tiles) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])

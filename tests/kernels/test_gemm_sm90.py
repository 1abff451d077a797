"""kiln/kernels/gemm_sm90.py: the Gluon stream-K decode GEMM against float64 math and gemm_ref on
the GPU (fresh random inputs, Llama-3.1-8B shapes, odd N and M, gated, bias, float32 logits,
shared tiles); on CPU, its sm_90 compile and the host-side checks."""

import json
import os
import subprocess
import sys

import pytest
import torch
from kernel_testing import assert_rel_close, gpu, needs_triton

from kiln.kernels import gemm_sm90 as g
from kiln.kernels._triton import arrival_counters
from kiln.kernels.activation import silu_and_mul_ref
from kiln.kernels.gemm import gemm_ref

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "sm90_compile.py")
# qkv, o_proj, merged gate_up, down_proj of Llama-3.1-8B, and N that is no multiple of a tile
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1000, 4096)]
# float32 accumulation; the output's bf16 rounding dominates (2^-9 relative, ~1.1e-3 in norm)
TOL = 4e-3


def make(n: int, k: int, m: int, seed: int, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    return x, w


def exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y + bias.double() if bias is not None else y


def counters_clear() -> bool:
    return int(arrival_counters(torch.device("cuda")).abs().sum()) == 0


@gpu
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 7, 16, 33, 64])
def test_gpu_matches_float64(n, k, m):
    x, w = make(n, k, m, seed=n + k + m)
    assert g.gemm_sm90_applies(x, w)
    y = g.gemm_sm90(x, w)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert_rel_close(y, exact(x, w), TOL, f"{n}x{k} m={m}")
    assert torch.equal(y, g.gemm_sm90(x, w)), "not deterministic"
    assert counters_clear()


@gpu
@pytest.mark.parametrize("programs", [1, 3, 7, 50, 1000])
def test_gpu_any_number_of_programs(programs):
    """Few programs (many tiles each, shared ones at both ends of a range) or more than the
    units of some tiles (a tile summed from several programs' partials): the same result to
    float32 summation order."""
    x, w = make(1000, 4096, 20, seed=programs)
    y = g.gemm_sm90(x, w, out_dtype=torch.float32, programs=programs)
    assert_rel_close(y, exact(x, w), 1e-5, f"programs={programs}")
    assert counters_clear()


@gpu
@pytest.mark.parametrize("m", [1, 5, 64])
def test_gpu_gated_with_bias_matches_the_unfused_path(m):
    """silu(gate) * up from the epilogue: the gate and up rows of a tile come from the two halves
    of the merged weight (N / 2 = 7000 is no multiple of the tile's 64 rows of each: the last
    tile's gate rows run into up's and are not stored)."""
    n, k = 2 * 7000, 4096
    x, w = make(n, k, m, seed=m)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    y = g.gemm_sm90(x, w, bias, gated=True)
    ref = silu_and_mul_ref((exact(x, w, bias)).to(torch.bfloat16))
    assert y.shape == (m, n // 2)
    assert_rel_close(y, ref, 1e-2, f"gated m={m}")
    assert_rel_close(y, gemm_ref(x, w, bias, gated=True), 1e-2, f"gated m={m} vs gemm_ref")


@gpu
def test_gpu_float32_logits_fp16_and_strided_x():
    """The LM head's float32 output; fp16 operands; x rows a view of a wider activation."""
    x, w = make(1000, 4096, 9, seed=5)
    y = g.gemm_sm90(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    assert_rel_close(y, exact(x, w), 1e-5, "float32 out")
    xh, wh = make(4096, 4096, 9, seed=6, dtype=torch.float16)
    assert_rel_close(g.gemm_sm90(xh, wh), exact(xh, wh), 2e-3, "fp16")
    wide = torch.zeros(9, 4096 + 64, device="cuda", dtype=torch.bfloat16)
    wide[:, :4096] = x
    assert torch.equal(g.gemm_sm90(wide[:, :4096], w, out_dtype=torch.float32), y)


@gpu
def test_gpu_rows_do_not_depend_on_the_batch():
    """The work split depends on N, K and the SM count only: a row's bits are the same whatever
    the batch around it (the engine pads decode batches to CUDA graph sizes)."""
    x, w = make(6144, 4096, 64, seed=11)
    full = g.gemm_sm90(x, w)
    for m in (1, 16, 17, 40):
        assert torch.equal(g.gemm_sm90(x[:m].contiguous(), w), full[:m]), m


@gpu
@pytest.mark.parametrize("tiles", [
    g.Sm90Tiles(stages=2), g.Sm90Tiles(block_k=64, stages=8), g.Sm90Tiles(block_k=256, stages=3),
    g.Sm90Tiles(block_n=128, block_k=64, stages=4, num_warps=8),
    g.Sm90Tiles(rows=32), g.Sm90Tiles(rows=48),  # fewer weight rows than the wgmma's
])  # fmt: skip
def test_gpu_tiles_agree(tiles):
    x, w = make(4096, 14336, 33, seed=3)
    y = g.gemm_sm90(x, w, out_dtype=torch.float32, tiles=tiles)
    assert_rel_close(y, exact(x, w), 3e-5, str(tiles))  # K = 14336 of float32 sums


@needs_triton
@pytest.mark.parametrize("args", [
    ["--block-n", "64", "--block-k", "128", "--stages", "6"],  # the default tiles, M = 33-64
    ["--block-n", "64", "--block-k", "128", "--stages", "6", "--block-m", "16"],
    ["--gated", "--block-k", "128", "--stages", "4"],  # the gated default, M = 33-64
    ["--gated", "--block-k", "128", "--stages", "4", "--block-m", "32"],
    ["--block-n", "256", "--warps", "8", "--stages", "3", "--block-m", "16"],
])
def test_compiles_for_sm90_without_spills(args):
    """The kernel compiles on a CPU host (Gluon has no interpreter; in a subprocess: this
    package's conftest turns the interpreter on): registers, no spills, TMA and wgmma in the K
    loop."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, SCRIPT, "gemm_sm90", *args], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("{")))
    assert row["spill_stack_bytes"] == 0 and 0 < row["registers"] <= 255, row
    assert row["k_loop_loads"].get("UTMALDG", 0) >= 2 and row["k_loop_wgmmas"] > 0, row


def test_tiles_name_what_is_wrong():
    with pytest.raises(ValueError, match="block_n=96"):
        g.Sm90Tiles(block_n=96)
    with pytest.raises(ValueError, match="block_k=32"):
        g.Sm90Tiles(block_k=32)
    with pytest.raises(ValueError, match="block_n=64.*8 warps"):
        g.Sm90Tiles(block_n=64, num_warps=8)


def test_shared_memory_fits_the_default_tiles():
    for m in (1, 16, 32, 64):
        assert g.default_tiles(m, 4096, 4096).smem_bytes(g.block_m_for(m)) <= g.SMEM_BUDGET


def test_applies_only_on_a_hopper_gpu():
    x, w = torch.randn(4, 256).bfloat16(), torch.randn(64, 256).bfloat16()
    assert not g.gemm_sm90_applies(x, w)

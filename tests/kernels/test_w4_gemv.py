"""kiln/kernels/w4_gemv.py: the Gluon int4 g128 GEMV against wint_linear_ref on the GPU (fresh
random inputs, Llama-3.1-8B shapes and an odd N, M = 1 and 2); on CPU, its sm_90 compile."""

import json
import os
import subprocess
import sys

import pytest
import torch
from kernel_testing import assert_rel_close, gpu, needs_triton, rel_err

from kiln.kernels import w4_gemv as w4
from kiln.kernels.quant_gemm import wint_linear_ref
from kiln.quant.rtn import pack_int4

# qkv, o_proj, gate_up (merged), down_proj of Llama-3.1-8B, and an N that is no multiple of a
# row tile (the last tile's rows past N come from TMA's zero fill and are not stored)
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1000, 4096)]
BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "w4_gemv_bench.py")
# Against the reference (W rounded to bf16 per element, then a bf16 GEMM): both round the
# output to bf16 (2^-9 relative) and the reference rounds each weight too; the kernel keeps
# each 4-word partial in float32, so the two differ by about 2e-3 in norm.
TOL_REF = 1e-2
# Against float64 math on the same codes and scales: the output's bf16 rounding dominates
# (2^-9 relative per element, ~1.1e-3 in norm).
TOL_EXACT = 4e-3


def make_inputs(n: int, k: int, m: int, seed: int, device: str = "cuda"):
    """x [m, k] bf16, words [n, k / 8] int32, scales [n, k / 128] bf16, codes [n, k]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, device=device, dtype=torch.uint8)
    scales = (torch.rand(n, k // 128, generator=gen, device=device) * 0.05 + 0.005)
    x = torch.randn(m, k, generator=gen, device=device)
    return x.to(torch.bfloat16), pack_int4(codes), scales.to(torch.bfloat16), codes


def exact(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    w = (codes.double() - 8) * scales.double().repeat_interleave(128, 1)
    return x.double() @ w.t()


@gpu
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_matches_reference(n, k, m):
    x, words, scales, codes = make_inputs(n, k, m, seed=n + k + m)
    assert w4.w4_gemv_applies(x, words, scales)
    out = w4.w4_gemv(x, words, scales)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert_rel_close(out, wint_linear_ref(x, words, scales, None, 4, 128), TOL_REF,
                     f"{n}x{k} m={m} vs wint_linear_ref")
    assert_rel_close(out, exact(x, codes, scales), TOL_EXACT, f"{n}x{k} m={m} vs float64")
    assert torch.equal(out, w4.w4_gemv(x, words, scales)), "not deterministic"


@gpu
@pytest.mark.parametrize("config", [
    w4.W4GemvConfig(),  # K = 4096: every chunk in its own buffer
    w4.W4GemvConfig(chunk_kw=64, stages=3),  # K = 4096 in 8 chunks through 3 buffers
    w4.W4GemvConfig(block_n=8, chunk_kw=256, stages=2, split_k=2),  # partials, warps along K
    w4.W4GemvConfig(block_n=32, num_warps=8),
])  # fmt: skip
def test_gpu_configs_agree(config):
    """Other tiles, stages and K splits give the same result to float32 summation order."""
    x, words, scales, codes = make_inputs(1000, 4096, 1, seed=7)
    out = w4.w4_gemv(x, words, scales, out_dtype=torch.float32, config=config)
    ref = w4.w4_gemv(x, words, scales, out_dtype=torch.float32)
    assert rel_err(out, ref) <= 1e-5, (config, rel_err(out, ref))
    assert rel_err(out, exact(x, codes, scales)) <= 1e-4


@gpu
def test_gpu_uneven_k_and_strided_x():
    """K not a multiple of a chunk (the last chunk's words past K meet zeroed x), and x rows
    with a stride (a view of a wider activation)."""
    n, k = 520, 4096 + 1024 + 128
    x, words, scales, codes = make_inputs(n, k, 2, seed=3)
    wide = torch.zeros(2, k + 64, device="cuda", dtype=torch.bfloat16)
    wide[:, :k] = x
    out = w4.w4_gemv(wide[:, :k], words, scales, out_dtype=torch.float32)
    assert rel_err(out, exact(x, codes, scales)) <= 1e-4


@needs_triton
def test_compiles_for_sm90_without_spills():
    """Each shape's default tiles compile on a CPU host (triton's own ptxas; in a subprocess:
    this package's conftest turns the interpreter on) and keep everything in registers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, BENCH, "--compile-only", "--default-only"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert {row["k"] for row in rows} == {4096, 14336}
    for row in rows:
        assert "error" not in row, row
        assert row["spill_bytes"] == 0 and 0 < row["registers"] <= 255, row
        # the allocation estimate w4_gemv_applies uses bounds what the compiler allocates
        assert row["shared_estimate"] - 256 <= row["shared"] <= row["shared_estimate"], row
        assert row["shared_estimate"] <= w4.SMEM_BUDGET
        assert row["tma"], row  # the weights come by TMA


def test_config_names_what_is_wrong():
    with pytest.raises(ValueError, match="chunk_kw=96"):
        w4.W4GemvConfig(chunk_kw=96)
    with pytest.raises(ValueError, match="block_n=2: a multiple of 4"):
        w4.W4GemvConfig(block_n=2)  # 4 warps along rows: at least a row each


def test_plan_covers_k_without_empty_programs():
    for k in (4096, 14336, 5248):
        for cfg in (w4.W4GemvConfig(), w4.W4GemvConfig(chunk_kw=64, split_k=3)):
            p = w4.plan(cfg, k)
            covered = p.split * p.num_steps * cfg.chunk_kw
            assert covered >= k // 8 > (p.split - 1) * p.num_steps * cfg.chunk_kw


def test_applies_only_on_cuda():
    x, words, scales, _ = make_inputs(64, 256, 1, seed=0, device="cpu")
    assert not w4.w4_gemv_applies(x, words, scales)


@gpu
@pytest.mark.parametrize("n, k, taken", [(6144, 4096, True), (4096, 4096, True),
                                         (28672, 4096, False), (4096, 14336, False)])
def test_gpu_quant_gemm_takes_it_at_batch_1_for_qkv_and_o_proj(monkeypatch, n, k, taken):
    """wint_linear at M = 1 sends Llama-3.1-8B's qkv and o_proj (symmetric int4 g128) here, and
    keeps gate_up and down_proj on its own GEMV; the bias is added after."""
    from kiln.kernels import quant_gemm as qg

    calls = []
    monkeypatch.setattr(qg, "w4_gemv", lambda *a, **kw: calls.append(1) or w4.w4_gemv(*a, **kw))
    x, words, scales, codes = make_inputs(n, k, 1, seed=n)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    out = qg.wint_linear(x, words, scales, None, 4, 128, bias=bias)
    assert calls == ([1] if taken else [])
    assert_rel_close(out.float().cpu(), (exact(x, codes, scales) + bias.double()).cpu(), TOL_EXACT,
                     f"{n}x{k}")

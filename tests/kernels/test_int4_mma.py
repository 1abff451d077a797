"""Tensor-core int4 GEMM for decode batches (kiln/kernels/int4_mma.py): Triton (interpreted on
CPU in fp16; compiled with its PTX decode on the GPU) against float64 math on the dequantized
weight, the split-K reduction, the arrival counters, and its dispatch from quant_gemm."""

import importlib
import sys

import pytest
import torch
from kernel_testing import assert_rel_close, gpu, needs_triton

if not torch.cuda.is_available():  # built for a GPU if imported before the conftest: rebuild
    for _name in ("kiln.kernels.int4_mma", "kiln.kernels.quant_gemm"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

from test_quant_gemm import make_weight, naive  # noqa: E402

from kiln.kernels import int4_mma as mma  # noqa: E402
from kiln.kernels import quant_gemm as qg  # noqa: E402


def _check(n, k, group, m, dtype, device, tiles=None, smooth=False, seed=0, tol=3e-3):
    gen = torch.Generator().manual_seed(seed)
    qweight, scales, _, w64 = make_weight(n, k, 4, group, True, gen=gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    sm = (torch.rand(k, generator=gen) + 0.5).to(dtype) if smooth else None
    expected = naive(x, w64, smooth=sm)
    args = [t.to(device) if t is not None else None for t in (x, qweight, scales.to(dtype), sm)]
    out = mma.int4_mma_gemm(args[0], args[1], args[2], group, args[3], tiles=tiles)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_rel_close(out.cpu(), expected, tol, f"{n}x{k} g{group} m={m} {tiles}")
    return out, args


@needs_triton
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("n, k, group, m", [(80, 256, 64, 3), (64, 512, 128, 17),
                                            (33, 128, 32, 5)])
def test_int4_mma_matches_float64(n, k, group, m, split):
    """Row counts that are not a multiple of the 64-row tile (masked stores), K split into
    ranges of whole groups, x rows padded to the dot's 16/32."""
    block_m = max(16, 1 << (m - 1).bit_length())
    _check(n, k, group, m, torch.float16, "cpu", mma.MmaTiles(64, split, block_m))


@needs_triton
def test_int4_mma_smooth():
    _check(64, 256, 64, 4, torch.float16, "cpu", mma.MmaTiles(64, 2, 16), smooth=True)


@needs_triton
def test_int4_mma_split_sum_is_repeatable_and_counters_reset():
    """The last program of a tile adds the partials in split order and zeroes the tile's
    counter: a second launch (the counters reused) gives the same bits."""
    tiles = mma.MmaTiles(64, 4, 16)
    first, args = _check(130, 512, 64, 6, torch.float16, "cpu", tiles)
    again = mma.int4_mma_gemm(args[0], args[1], args[2], 64, tiles=tiles)
    assert torch.equal(first, again)
    assert int(mma._arrival_counters(torch.device("cpu")).abs().sum()) == 0


def test_int4_mma_applies_only_to_its_format():
    x = torch.zeros(8, 256, dtype=torch.bfloat16)
    zeros = torch.zeros(4, 2, dtype=torch.uint8)
    assert mma.int4_mma_applies(x, None, None, 4, 128, False)
    assert not mma.int4_mma_applies(x, zeros, None, 4, 128, False)  # asymmetric
    assert not mma.int4_mma_applies(x, None, torch.arange(256), 4, 128, False)  # act-order
    assert not mma.int4_mma_applies(x, None, None, 8, 128, False)
    assert not mma.int4_mma_applies(x, None, None, 4, 256, False)  # group too wide for one step
    assert not mma.int4_mma_applies(x.float(), None, None, 4, 128, False)
    assert not mma.int4_mma_applies(x[:2], None, None, 4, 128, False)  # the GEMV's rows
    assert not mma.int4_mma_applies(torch.zeros(65, 256, dtype=torch.bfloat16), None, None, 4,
                                    128, False)  # fmt: skip


@needs_triton
def test_wint_gemm_dispatches_decode_batches_to_int4_mma(monkeypatch):
    """quant_gemm sends symmetric int4 at 3..64 rows here (bias and the gated silu after)."""
    calls = []
    real = qg.int4_mma_gemm
    monkeypatch.setattr(qg, "int4_mma_gemm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(3)
    qweight, scales, _, w64 = make_weight(128, 256, 4, 64, True, gen=gen)
    x = torch.randn(5, 256, generator=gen).half()
    bias = torch.randn(128, generator=gen).half()
    out = qg.wint_gemm_triton(x, qweight, scales.half(), None, 4, 64, bias=bias, gated=True)
    y = naive(x, w64) + bias.double()
    gate, up = y.chunk(2, dim=-1)
    assert calls == [1]
    assert_rel_close(out, torch.nn.functional.silu(gate) * up, 5e-3, "gated int4 mma")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [3, 16, 64])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336), (1000, 4096)])
def test_gpu_int4_mma_default_tiles(n, k, m, dtype):
    """The PTX decode (lop3 + packed FMA) at Llama-3.1-8B shapes with the default tiles."""
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    _check(n, k, 128, m, dtype, "cuda", tol=tol, seed=m)
    _check(n, k, 64, m, dtype, "cuda", tol=tol, seed=m + 1, smooth=True)

"""Weight-only quantized GEMM (W4A16 / W8A16 / FP8-weight) and the W8A8 activation quantizer:
Triton (interpreted on CPU) vs the PyTorch references, references vs float64 math."""

import importlib
import sys

import pytest
import torch
from kernel_testing import INTERPRET_DTYPES, assert_rel_close, gpu, needs_triton

# A module imported before this package's conftest set TRITON_INTERPRET was built for a GPU:
# rebuild the two kernel modules under test (the conftest only knows the older kernels).
if not torch.cuda.is_available():
    for _name in ("kiln.kernels.quant_gemm", "kiln.quant.w8a8"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

from kiln.kernels import quant_gemm as qg  # noqa: E402
from kiln.kernels.activation import (  # noqa: E402
    silu_and_mul,
    silu_and_mul_ref,
    silu_and_mul_triton,
)
from kiln.quant import w8a8  # noqa: E402

# Against float64 math on the *dequantized* weight: fp32 differs by summation order only;
# fp16/bf16 round x, W (and the output) to 2^-11 / 2^-8 relative.
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_weight(n, k, bits, group_size, symmetric, fp8=False, gen=None):
    """Random codes/scales/zeros in the kernel's storage formats, plus the float64 weight."""
    group = k if group_size == -1 else group_size
    if fp8:
        dense = torch.randn(n, k, generator=gen)
        qweight, s = w8a8.quantize_weight(dense, "fp8", "channel")
        scales, zeros = s[:, None], None
        w64 = qweight.double() * scales.double()
        return qweight, scales, zeros, w64
    codes = torch.randint(0, 2**bits, (n, k), generator=gen)
    scales = torch.rand(n, k // group, generator=gen) * 0.05 + 0.005
    zeros = None if symmetric else torch.randint(0, 2**bits, (n, k // group), generator=gen)
    z = 2 ** (bits - 1) if zeros is None else zeros.double().repeat_interleave(group, 1)
    w64 = (codes.double() - z) * scales.double().repeat_interleave(group, 1)
    if bits == 4:
        shifts = torch.arange(0, 32, 4)
        words = (codes.reshape(n, k // 8, 8) << shifts).sum(-1)
        qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    else:
        qweight = codes.to(torch.uint8)
    return qweight, scales, zeros.to(torch.uint8) if zeros is not None else None, w64


def naive(x, w64, perm=None, smooth=None):
    xs = x.double()
    if perm is not None:
        xs = xs[:, perm.long()]
    if smooth is not None:
        xs = xs * smooth.double()
    return xs @ w64.t()


CASES = [  # (bits, group_size, symmetric, fp8)
    (4, 32, True, False),
    (4, 64, False, False),
    (4, 128, True, False),
    (4, -1, False, False),
    (8, -1, True, False),
    (8, -1, False, False),
    (8, -1, True, True),
]


def check(fn, m, n, k, case, dtype, device="cpu", seed=0, extras=True, bias=False):
    bits, group_size, symmetric, fp8 = case
    gen = torch.Generator().manual_seed(seed)
    qweight, scales, zeros, w64 = make_weight(n, k, bits, group_size, symmetric, fp8, gen)
    x = torch.randn(m, k, generator=gen)
    perm = torch.randperm(k, generator=gen).to(torch.int32) if extras else None
    smooth = torch.rand(k, generator=gen) + 0.5 if extras else None
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    expected = naive(x.to(dtype), w64, perm, smooth) + (b.double() if bias else 0)
    to = lambda t: t.to(device) if t is not None else None
    out = fn(
        to(x.to(dtype)),
        to(qweight),
        to(scales.to(dtype)),
        to(zeros),
        bits,
        group_size,
        to(perm),
        to(smooth),
        **({"bias": to(b)} if bias else {}),
    )
    assert out.dtype == dtype and out.shape == (m, n)
    assert_rel_close(out.cpu(), expected, TOL[dtype], f"{fn.__name__} m={m} {case} {dtype}")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference(case, dtype):
    check(qg.wint_linear_ref, 5, 24, 256, case, dtype)


@needs_triton
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("m", [1, 3, 17])  # GEMV, padded dot, more than one row block
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
def test_fused_triton(case, m, dtype):
    check(qg.wint_gemm_triton, m, 40, 256, case, dtype, seed=m, extras=case[1] != 64)


CONFIGS = [  # the tensor-core tile kernel (M > SMALL_M) with explicit tiles
    qg.GemmConfig(1, 16, 64, split_k=2),
    qg.GemmConfig(16, 32, 32, split_k=3),
    qg.GemmConfig(16, 16, 128),
]
GEMV_CONFIGS = [  # the small-M word-streaming kernels
    qg.GemvConfig(1, 8, 16),  # FMA: 2 rows of x = 2 programs, K in 2 tiles
    qg.GemvConfig(1, 4, 32),  # K = 24 or 48 words: a masked tail
    qg.GemvConfig(1, 8, 8, split_k=3),  # split-K: atomics into float32
    qg.GemvConfig(16, 16, 16, mma=True),  # tensor cores, M = 18: two row blocks
    qg.GemvConfig(16, 32, 64, mma=True, split_k=2),
    qg.GemvConfig(16, 16, 16, mma=True, natural=True),  # codes joined into input order
    qg.GemvConfig(16, 32, 32, mma=True, split_k=2, natural=True),
]


@needs_triton
@pytest.mark.parametrize("config", CONFIGS)  # split-K (atomic), tiles smaller/larger than a group
@pytest.mark.parametrize("bias", [False, True])  # added after the tile kernel
def test_fused_triton_configs(config, bias):
    fn = lambda *a, **kw: qg.wint_gemm_triton(*a, config=config, **kw)
    fn.__name__ = "wint_gemm_triton"
    check(fn, 2 if config.block_m == 1 else 18, 33, 192, (4, 64, False, False), torch.float32,
          bias=bias)


@needs_triton
@pytest.mark.parametrize("config", GEMV_CONFIGS)
@pytest.mark.parametrize("case", [(4, 64, False, False), (8, -1, True, False), (8, -1, True, True)])
@pytest.mark.parametrize("bias", [False, True])  # in the epilogue without split-K, else after
def test_gemv_configs(config, case, bias):
    fn = lambda *a, **kw: qg.wint_gemm_triton(*a, config=config, **kw)
    fn.__name__ = "wint_gemm_triton"
    m = 18 if config.mma else 2
    check(fn, m, 33, 192, case, torch.float32, seed=config.block_kw, extras=case[1] != 64,
          bias=bias)


@needs_triton
@pytest.mark.parametrize("case", CASES)
def test_dequant_triton(case):
    bits, group_size, symmetric, fp8 = case
    gen = torch.Generator().manual_seed(7)
    qweight, scales, zeros, _ = make_weight(20, 128, bits, group_size, symmetric, fp8, gen)
    perm = torch.randperm(128, generator=gen).to(torch.int32)
    smooth = torch.rand(128, generator=gen) + 0.5
    args = (qweight, scales, zeros, bits, group_size, torch.float16, perm, smooth)
    torch.testing.assert_close(
        qg.wint_dequant_triton(*args), qg.wint_dequant_ref(*args), rtol=0, atol=0
    )


# ---- gated: silu(gate) * up of a merged [gate; up] weight in the GEMV's epilogue ---------------


def _gated_operands(case, inter, k, seed):
    bits, group_size, symmetric, fp8 = case
    gen = torch.Generator().manual_seed(seed)
    qweight, scales, zeros, _ = make_weight(2 * inter, k, bits, group_size, symmetric, fp8, gen)
    return torch.randn(2, k, generator=gen), (qweight, scales, zeros, bits, group_size)


@needs_triton
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
def test_gated_gemv_is_the_unfused_path(case, dtype):
    """Bit for bit what the GEMV followed by the silu_and_mul kernel gives: I = 13 leaves the
    last program half masked, and every gate row pairs with its own up row."""
    x, w = _gated_operands(case, 13, 128, seed=case[1] + 11)
    qweight, scales, zeros, bits, group_size = w
    args = (x.to(dtype), qweight, scales.to(dtype), zeros, bits, group_size)
    config = qg.GemvConfig(1, 8, 16)
    fused = qg.wint_gemm_triton(*args, config=config, gated=True)
    unfused = silu_and_mul_triton(qg.wint_gemm_triton(*args, config=config))
    assert fused.shape == (2, 13) and fused.dtype == dtype
    torch.testing.assert_close(fused, unfused, rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("bias", [False, True])
def test_gated_dense_gemv(bias):
    """bf16 weights, fused with or without a bias (the epilogue adds it before the silu)."""
    gen = torch.Generator().manual_seed(21 + bias)
    weight = torch.randn(2 * 24, 64, generator=gen).bfloat16()
    x = torch.randn(1, 64, generator=gen)
    b = torch.randn(2 * 24, generator=gen) if bias else None
    out = qg.dense_gemv(x, weight, b, config=qg.GemvConfig(1, 4, 16), gated=True)
    plain = qg.dense_gemv(x, weight, b, config=qg.GemvConfig(1, 4, 16))
    torch.testing.assert_close(out, silu_and_mul_triton(plain), rtol=0, atol=0)
    y = x.double() @ weight.double().t() + (b.double() if bias else 0)
    assert_rel_close(out.double(), torch.nn.functional.silu(y[:, :24]) * y[:, 24:], 1e-5)


@needs_triton
def test_gated_falls_back_off_the_fma_gemv():
    """Where the epilogue cannot take it (the tensor-core word kernel, the tile kernel, M past
    the GEMV) the gated call is the plain one followed by silu_and_mul."""
    x, (qweight, scales, zeros, bits, group_size) = _gated_operands((4, 64, False, False), 24,
                                                                    128, seed=5)
    x = torch.cat([x] * 9)  # 18 rows
    for config in (qg.GemvConfig(16, 16, 16, mma=True), qg.GemmConfig(16, 16, 64), None):
        args = (x, qweight, scales, zeros, bits, group_size)
        fused = qg.wint_gemm_triton(*args, config=config, gated=True)
        torch.testing.assert_close(fused, silu_and_mul(qg.wint_gemm_triton(
            *args, config=config)), rtol=0, atol=0)


@needs_triton
def test_gated_gemv_with_a_bias_is_the_unfused_path():
    """A bias goes in the FMA GEMV's epilogue before silu(gate) * up: bit for bit the plain
    GEMV with its bias followed by the silu_and_mul kernel."""
    x, (qweight, scales, zeros, bits, group_size) = _gated_operands((4, 64, False, False), 24,
                                                                    128, seed=5)
    bias = torch.randn(48)
    out = qg.wint_linear_triton(x[:1], qweight, scales, zeros, bits, group_size, bias=bias,
                                gated=True)
    plain = qg.wint_linear_triton(x[:1], qweight, scales, zeros, bits, group_size, bias=bias)
    torch.testing.assert_close(out, silu_and_mul_triton(plain), rtol=0, atol=0)


def test_gated_wrapper_on_cpu_is_reference():
    x, (qweight, scales, zeros, bits, group_size) = _gated_operands((4, 32, True, False), 8, 64,
                                                                    seed=6)
    out = qg.wint_linear(x, qweight, scales, zeros, bits, group_size, gated=True)
    ref = qg.wint_linear_ref(x, qweight, scales, zeros, bits, group_size)
    torch.testing.assert_close(out, silu_and_mul_ref(ref))


def test_wrapper_on_cpu_is_reference():
    gen = torch.Generator().manual_seed(3)
    qweight, scales, zeros, _ = make_weight(16, 64, 4, 32, False, gen=gen)
    x = torch.randn(2, 3, 64, generator=gen)
    bias = torch.randn(16, generator=gen)
    out = qg.wint_linear(x, qweight, scales, zeros, 4, 32, bias=bias)
    ref = qg.wint_linear_ref(x.reshape(6, 64), qweight, scales, zeros, 4, 32, bias=bias)
    torch.testing.assert_close(out, ref.reshape(2, 3, 16))


@needs_triton
@pytest.mark.parametrize("static", [False, True])
def test_act_quant_triton_int8(static):
    """INT8 codes and scales match exactly (both round half away from zero). FP8 is checked on
    the GPU only: the interpreter's fp32 -> e4m3 cast is wrong at binade boundaries."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 300, generator=gen) * 3
    x[2] = 0.0  # an all-zero row must still get a finite scale
    smooth = torch.rand(300, generator=gen) + 0.5
    scale = torch.tensor(0.05) if static else None
    q, s = w8a8.quant_per_token_triton(x, "int8", smooth, scale)
    q_ref, s_ref = w8a8.quant_per_token_ref(x, "int8", smooth, scale)
    assert q.dtype == torch.int8 and s.shape == (7, 1)
    torch.testing.assert_close(q, q_ref, rtol=0, atol=0)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_act_quant_ref_bounds(kind):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 64, generator=gen) * torch.logspace(-2, 2, 9)[:, None]
    q, s = w8a8.quant_per_token_ref(x, kind)
    deq = q.float() * s
    assert q.float().abs().max() <= w8a8.QMAX[kind]
    # per-token: each row's error scales with its own magnitude (int8: half a step; e4m3: 2^-4)
    rel = (deq - x).abs().amax(1) / x.abs().amax(1)
    assert (rel <= (0.5 / 127 if kind == "int8" else 2**-4) * 1.001).all(), rel


@gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("m", [1, 7, 16, 64, 300])  # fused and dequantize + cuBLAS paths
def test_gpu(case, m):
    check(qg.wint_linear, m, 4096, 4096, case, torch.bfloat16, device="cuda", seed=m)


@gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("m", [1, 4])
def test_gpu_bias_in_the_gemv_epilogue(case, m):
    """Qwen2's qkv bias at decode: added in the GEMV's epilogue (no separate add)."""
    check(qg.wint_linear, m, 4096, 4096, case, torch.bfloat16, device="cuda", seed=m, bias=True)


@gpu
@pytest.mark.parametrize("case", [*CASES, "bf16"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_gpu_gated_gemv(case, m):
    """Llama-3.1-8B's gate/up shape at decode: the epilogue gives the unfused path's bits."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 4096, generator=gen).bfloat16().cuda()
    if case == "bf16":
        weight = (torch.randn(2 * 14336, 4096, generator=gen) * 0.02).bfloat16().cuda()
        fused = qg.dense_gemv(x, weight, gated=True)  # the engine takes it at M = 1 only
        unfused = silu_and_mul_triton(qg.dense_gemv(x, weight))
    else:
        qweight, scales, zeros, _ = make_weight(2 * 14336, 4096, *case[:3], case[3], gen)
        args = [t.cuda() if t is not None else None for t in (qweight, scales.bfloat16(), zeros)]
        fused = qg.wint_linear(x, *args, case[0], case[1], gated=True)
        unfused = silu_and_mul_triton(qg.wint_linear(x, *args, case[0], case[1]))
    torch.testing.assert_close(fused, unfused, rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 33])
def test_gpu_w8a8(kind, m):
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(512, 1024, generator=gen)
    x = torch.randn(m, 1024, generator=gen).bfloat16()
    smooth = torch.rand(1024, generator=gen) + 0.5
    wq, ws = w8a8.quantize_weight(w, kind, "channel")
    ref = w8a8.w8a8_linear_ref(x, wq, ws, kind, smooth)
    out = w8a8.w8a8_linear(x.cuda(), wq.cuda(), ws.cuda(), kind, smooth.cuda())
    assert_rel_close(out.cpu(), ref, 1e-2, f"w8a8 {kind} m={m}")


# ---- dense bf16 weights through the word-streaming GEMV ("16-bit codes") ----------------------


@needs_triton
@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (1, 24, 64, None),  # one whole tile per row
        (1, 13, 40, qg.GemvConfig(1, 8, 16)),  # rows past N clamped; K in 2.5 tiles (masked)
        (2, 16, 256, qg.GemvConfig(1, 4, 32)),  # a pipelined K loop of 4 tiles, 2 rows of x
        (1, 16, 128, qg.GemvConfig(1, 8, 16, split_k=2)),  # split-K through float32 atomics
    ],
)
def test_dense_gemv(m, n, k, config):
    """bf16 weights read as int32 words; x in float32 (the interpreter mishandles bf16 tensors;
    the GPU test below runs bf16). Against float64 math on the same weight."""
    gen = torch.Generator().manual_seed(n * k + m)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    out = qg.dense_gemv(x, weight, bias, config=config)
    ref = x.double() @ weight.double().t() + bias.double()
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert_rel_close(out.double(), ref, 1e-5, f"dense_gemv m={m} {n}x{k} {config}")


def test_dense_gemv_does_not_apply_on_cpu():
    """Off CUDA the dense path stays F.linear (the GPU test checks where it does apply)."""
    w = torch.randn(16, 64).bfloat16()
    assert not qg.dense_gemv_applies(torch.randn(1, 64).bfloat16(), w)


@gpu
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (1000, 96)])
def test_gpu_dense_gemv(n, k):
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen).bfloat16().cuda()
    x = torch.randn(1, k, generator=gen).bfloat16().cuda()
    assert qg.dense_gemv_applies(x, weight)
    assert not qg.dense_gemv_applies(x.expand(2, k), weight)  # two rows: cuBLAS
    ref = x.double() @ weight.double().t()
    assert_rel_close(qg.dense_gemv(x, weight).double(), ref, 1e-2, f"bf16 {n}x{k}")
    logits = qg.dense_gemv(x, weight, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    assert_rel_close(logits.double(), ref, 1e-5, f"bf16 {n}x{k}, float32 out")
    bias = torch.randn(n, generator=gen).bfloat16().cuda()
    assert_rel_close(qg.dense_gemv(x, weight, bias).double(), ref + bias.double(), 1e-2,
                     f"bf16 {n}x{k} + bias")


@gpu
@pytest.mark.parametrize("path", ["dequantize", "triton"])
def test_gpu_residual_added_where_the_rows_dequantize_for_cublas(path, monkeypatch):
    """wint_linear(residual=r): where the rows take dequantize + cuBLAS (forced here past the
    tile kernels' rows), cuBLAS adds the result into r in its epilogue and None comes back; on a
    Triton path (16 rows) the result comes back and r is left alone
    (tests/models/test_residual_epilogue.py: the dense layers)."""
    rows = 16 if path == "triton" else qg.FUSED_MAX_M[4] + 235
    if path == "dequantize":
        monkeypatch.setattr(qg, "_mma_applies", lambda *args: False)
        monkeypatch.setattr(qg, "_ws_takes", lambda *args: False)
    gen = torch.Generator().manual_seed(rows)
    qweight, scales, zeros, w64 = make_weight(512, 1024, 4, 128, True, gen=gen)
    args = (qweight.cuda(), scales.to("cuda", torch.bfloat16), None, 4, 128)
    x = torch.randn(rows, 1024, generator=gen).to("cuda", torch.bfloat16)
    residual = torch.randn(rows, 512, generator=gen).to("cuda", torch.bfloat16)
    before = residual.clone()
    out = qg.wint_linear(x, *args, residual=residual)
    assert (out is None) == (path == "dequantize")
    if out is not None:
        assert torch.equal(residual, before)
        residual = before + out
    expected = before.double() + naive(x, w64.cuda())
    assert_rel_close(residual.double(), expected, 2e-2)

"""SiLU-and-mul: Triton (interpreted on CPU) and reference vs float64 math."""

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import INTERPRET_DTYPES, assert_rel_close, gpu, needs_triton

from kiln.kernels.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton

# fp32: exp/division rounding only. fp16/bf16: silu is rounded to the dtype before the multiply
# and the product again (two roundings of 2^-11 / 2^-8 relative).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def naive(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    gate, up = x[..., :inter].double(), x[..., inter:].double()
    return gate / (1 + torch.exp(-gate)) * up


def check(fn, shape, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)
    out = fn(x)
    assert out.dtype == dtype
    assert_rel_close(out, naive(x), TOL[dtype], f"silu_and_mul {shape} {dtype}")


SHAPES = [(1, 2), (17, 34), (3, 2, 2000)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference(shape, dtype):
    check(silu_and_mul_ref, shape, dtype)


@needs_triton
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
@pytest.mark.parametrize("block", [16, 1024])  # 16: several column blocks and a ragged last one
def test_triton(shape, dtype, block):
    check(lambda x: silu_and_mul_triton(x, block=block), shape, dtype, seed=1)


def test_matches_eager_rounding():
    """fp16: the kernel rounds where eager `F.silu(gate) * up` rounds, so it agrees closely."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(17, 64, generator=gen).half()
    gate, up = x.chunk(2, -1)
    eager = (F.silu(gate.float()).half().float() * up.float()).half()
    torch.testing.assert_close(silu_and_mul_triton(x), eager, rtol=1e-3, atol=1e-3)


def test_wrapper_on_cpu_is_reference():
    x = torch.randn(5, 64)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x))


@gpu
@pytest.mark.parametrize("num_tokens", [1, 17, 1000])
@pytest.mark.parametrize("inter", [14336, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu(num_tokens, inter, dtype):
    check(silu_and_mul, (num_tokens, 2 * inter), dtype, device="cuda", seed=num_tokens)

"""Rotary embedding: Triton (interpreted on CPU) and reference vs a complex-number rotation."""

import pytest
import torch
from kernel_testing import INTERPRET_DTYPES, assert_rel_close, gpu, needs_triton

from kiln.kernels.rotary import apply_rotary, apply_rotary_ref, apply_rotary_triton

# fp32: one fp32 multiply-add per element. fp16/bf16: inputs are exact, one final rounding
# (2^-11 / 2^-8 relative), plus fp32 cos/sin products.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
MAX_POS = 4096


def cos_sin_cache(rot_dim: int, device="cpu") -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    angles = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float().to(device)


def naive(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate (x[i], x[i + R/2]) as the complex number x[i] + i x[i + R/2] times e^(i theta)."""
    half = cache.shape[-1] // 2
    cos, sin = cache[positions.long()].double().chunk(2, -1)
    rot = torch.complex(cos, sin)[..., None, :]  # [..., 1, R/2]
    x64 = x.double()
    z = torch.complex(x64[..., :half], x64[..., half : 2 * half]) * rot
    return torch.cat((z.real, z.imag, x64[..., 2 * half :]), dim=-1)


def check(fn, lead, num_heads, num_kv_heads, head_dim, rot_dim, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    # q and k are slices of one fused projection, as the attention layer produces them
    qkv = torch.randn(*lead, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype).to(device)
    q = qkv[..., : num_heads * head_dim].unflatten(-1, (num_heads, head_dim))
    k = qkv[..., num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.unflatten(-1, (num_kv_heads, head_dim))
    positions = torch.randint(0, MAX_POS, lead, generator=gen).to(device)
    cache = cos_sin_cache(rot_dim, device)
    q_out, k_out = fn(q, k, positions, cache)
    assert q_out.dtype == k_out.dtype == dtype
    what = f"rotary {lead} H={num_heads} H_kv={num_kv_heads} R={rot_dim} {dtype}"
    assert_rel_close(q_out, naive(q, positions, cache), TOL[dtype], "q " + what)
    assert_rel_close(k_out, naive(k, positions, cache), TOL[dtype], "k " + what)
    if rot_dim < head_dim:
        torch.testing.assert_close(q_out[..., rot_dim:], q[..., rot_dim:], rtol=0, atol=0)


# (leading shape, num_heads, num_kv_heads, head_dim, rot_dim)
CASES = [((1,), 4, 4, 64, 64), ((17,), 8, 1, 64, 64), ((2, 3), 4, 1, 64, 32), ((5,), 3, 3, 16, 16)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference(case, dtype):
    check(apply_rotary_ref, *case, dtype)


@needs_triton
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
def test_triton(case, dtype):
    check(apply_rotary_triton, *case, dtype, seed=1)


def test_wrapper_on_cpu_is_reference():
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(5, 4, 64, generator=gen), torch.randn(5, 2, 64, generator=gen)
    positions = torch.randint(0, MAX_POS, (5,), generator=gen)
    cache = cos_sin_cache(64)
    for got, want in zip(
        apply_rotary(q, k, positions, cache), apply_rotary_ref(q, k, positions, cache), strict=True
    ):
        torch.testing.assert_close(got, want)


@gpu
@pytest.mark.parametrize("num_tokens", [1, 17, 1000])
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 16, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu(num_tokens, heads, dtype):
    num_heads, num_kv_heads, head_dim = heads
    check(apply_rotary, (num_tokens,), num_heads, num_kv_heads, head_dim, head_dim, dtype, "cuda")

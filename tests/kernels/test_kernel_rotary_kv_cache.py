"""Rotary fused with the KV-cache write: the Triton kernel (interpreted on CPU) against the
separate reference steps it replaces (rotary, then quantize_kv for an fp8 cache, then the write)."""

import pytest
import torch
from kernel_testing import INTERPRET_DTYPES, gpu, needs_triton
from test_kernel_rotary import MAX_POS, cos_sin_cache

from kiln.kernels.kv_cache import FP8_DTYPE, quantize_kv, write_kv_cache_ref
from kiln.kernels.rotary import (
    apply_rotary_triton,
    rotary_write_kv_cache,
    rotary_write_kv_cache_ref,
    rotary_write_kv_cache_triton,
)

BLOCK_SIZE = 8


def make_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, cache_dtype, gen,
                device="cpu", values=None):
    """q, k, v as views of one fused projection, random-filled caches and slots with padding.

    ``values(shape)`` draws the projection (default: standard normal)."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen) if values is None else values(
        (num_tokens, width))
    q, k, v = qkv.to(dtype).to(device).split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.unflatten(-1, (-1, head_dim)) for x in (q, k, v))
    num_blocks = num_tokens // BLOCK_SIZE + 3
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    # old content everywhere, so a row written that should not be is caught (* 8: fp8 codes
    # of many magnitudes)
    k_cache = (torch.randn(shape, generator=gen) * 8).to(cache_dtype).to(device)
    v_cache = (torch.randn(shape, generator=gen) * 8).to(cache_dtype).to(device)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:num_tokens]
    padding = torch.rand(num_tokens, generator=gen) < 0.25
    padding[:1] = False  # a real token and, where there are several, padding, whatever the draw
    padding[1:2] = True
    slots[padding] = -1
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=gen).to(device)
    return q, k, v, positions, k_cache, v_cache, slots.to(device)


def run_both(fused, inputs, table, k_scale=1.0, v_scale=1.0, slots="given"):
    """(fused q, k_cache, v_cache) and the reference's, from the same starting caches."""
    q, k, v, positions, k_cache, v_cache, slot_mapping = inputs
    slot_mapping = slot_mapping if slots == "given" else None
    ref_caches = k_cache.clone(), v_cache.clone()
    want_q = rotary_write_kv_cache_ref(q, k, v, positions, table, *ref_caches, slot_mapping,
                                       k_scale, v_scale)
    got_q = fused(q, k, v, positions, table, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return (got_q, k_cache, v_cache), (want_q, *ref_caches)


def assert_same(got, want, what):
    """Bit for bit (fp8 compared as codes: assert_close has no float8 arithmetic)."""
    for name, g, w in zip(("q", "k_cache", "v_cache"), got, want, strict=True):
        assert g.dtype == w.dtype, f"{what}: {name} dtype {g.dtype} != {w.dtype}"
        if g.dtype == FP8_DTYPE:
            g, w = g.view(torch.uint8), w.view(torch.uint8)
        mismatch = (g != w).nonzero()
        assert mismatch.numel() == 0, (
            f"{what}: {name} differs at {mismatch.shape[0]} places, first {mismatch[0].tolist()}: "
            f"{g[tuple(mismatch[0])].item()} vs {w[tuple(mismatch[0])].item()}")


# (num_tokens, num_heads, num_kv_heads, head_dim, rot_dim): GQA 1 and 4, head_dim 64 and 128,
# partial rotary, odd head counts and a non-power-of-two head_dim
CASES = [(1, 4, 4, 64, 64), (17, 8, 2, 128, 128), (17, 4, 4, 128, 64), (1, 4, 1, 64, 32),
         (17, 3, 3, 24, 16)]


@needs_triton
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
def test_triton_matches_separate_steps(case, dtype):
    num_tokens, num_heads, num_kv_heads, head_dim, rot_dim = case
    gen = torch.Generator().manual_seed(num_tokens * head_dim + rot_dim)
    inputs = make_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, dtype, gen)
    # the interpreter runs the reference's float32 operations in the same order: bit-exact
    got, want = run_both(rotary_write_kv_cache_triton, inputs, cos_sin_cache(rot_dim))
    assert_same(got, want, f"{case} {dtype}")


def quarter_turn_table(rot_dim: int, gen: torch.Generator) -> torch.Tensor:
    """A cos/sin table of random multiples of 90 degrees: rotation only moves and negates."""
    turns = torch.randint(0, 4, (MAX_POS, rot_dim // 2), generator=gen)
    cos = torch.tensor([1.0, 0.0, -1.0, 0.0])[turns]
    sin = torch.tensor([0.0, 1.0, 0.0, -1.0])[turns]
    return torch.cat((cos, sin), dim=-1)


def fp8_grid(scale: float, gen: torch.Generator):
    """Draws of e4m3 values times ``scale``, never 0, every 7th at +-512 (saturates to 448)."""

    def draw(shape):
        x = (torch.randn(shape, generator=gen) * 40).to(FP8_DTYPE).float()
        x[x == 0] = 1.0
        x.view(-1)[::7] = 512 * x.view(-1)[::7].sign()
        return x * scale

    return draw


@needs_triton
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
def test_triton_fp8_cache_matches_quantize_then_write(case, dtype):
    # The interpreter's float32 -> e4m3 cast rounds ties away from zero and can drop a carry
    # into the exponent (the GPU's cvt rounds to nearest even), so these inputs need no
    # rounding at all: k and v on the e4m3 grid times a power-of-two scale, rotated by quarter
    # turns, which keeps them there (v / v_scale = 2 v / k_scale: on the grid or saturated).
    # Scales, saturation, layout and padding are checked here; general values, where the
    # rounding order matters, bit for bit on the GPU below.
    num_tokens, num_heads, num_kv_heads, head_dim, rot_dim = case
    gen = torch.Generator().manual_seed(num_tokens * head_dim + rot_dim + 1)
    k_scale, v_scale = 2.0**-4, 2.0**-5
    inputs = make_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, FP8_DTYPE, gen,
                         values=fp8_grid(k_scale, gen))
    got, want = run_both(rotary_write_kv_cache_triton, inputs, quarter_turn_table(rot_dim, gen),
                         k_scale, v_scale)
    assert_same(got, want, f"fp8 {case} {dtype}")
    assert (want[1].float().abs() == 448).any(), "no saturated value in the test data"


@needs_triton
@pytest.mark.parametrize("fp8", [False, True])
def test_triton_without_slot_mapping_writes_nothing(fp8):
    gen = torch.Generator().manual_seed(5)
    dtype = torch.float16
    inputs = make_inputs(17, 4, 1, 64, dtype, FP8_DTYPE if fp8 else dtype, gen)
    old = inputs[4].clone(), inputs[5].clone()
    got, want = run_both(rotary_write_kv_cache_triton, inputs, cos_sin_cache(64), slots=None)
    assert_same(got, want, "slot_mapping=None")
    assert_same(got, (want[0], *old), "slot_mapping=None leaves the caches")


@needs_triton
def test_triton_k_out_gets_the_rotated_k():
    """k_out (the prefill kernel's k_new) receives the rotated k, and the q and cache outputs are
    unchanged by asking for it (an fp8 cache: on the GPU below)."""
    gen = torch.Generator().manual_seed(8)
    dtype = torch.float16
    inputs = make_inputs(17, 8, 2, 64, dtype, dtype, gen)
    q, k, v, positions, k_cache, v_cache, slot_mapping = inputs
    table = cos_sin_cache(64)
    got_k, want_k = torch.empty_like(k), torch.empty_like(k)
    ref_caches = k_cache.clone(), v_cache.clone()
    want_q = rotary_write_kv_cache_ref(q, k, v, positions, table, *ref_caches, slot_mapping,
                                       0.011, 0.023, want_k)
    got_q = rotary_write_kv_cache_triton(q, k, v, positions, table, k_cache, v_cache,
                                         slot_mapping, 0.011, 0.023, got_k)
    assert_same((got_q, k_cache, v_cache), (want_q, *ref_caches), "with k_out")
    assert torch.equal(got_k, want_k)
    assert torch.equal(want_k, apply_rotary_triton(q, k, positions, table)[1])


@needs_triton
def test_triton_empty_batch():
    gen = torch.Generator().manual_seed(6)
    inputs = make_inputs(0, 4, 2, 64, torch.float32, torch.float32, gen)
    old = inputs[4].clone(), inputs[5].clone()
    got, want = run_both(rotary_write_kv_cache_triton, inputs, cos_sin_cache(64))
    assert got[0].shape == (0, 4, 64)
    assert_same(got, (want[0], *old), "empty batch")


def test_wrapper_on_cpu_is_reference():
    gen = torch.Generator().manual_seed(7)
    inputs = make_inputs(17, 4, 2, 64, torch.float32, FP8_DTYPE, gen)
    got, want = run_both(rotary_write_kv_cache, inputs, cos_sin_cache(64), 0.011, 0.023)
    assert_same(got, want, "CPU wrapper")


def unfused_triton(q, k, v, positions, table, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    """What the fused kernel replaces: the rotary launch, then the scatter into the cache."""
    q, k = apply_rotary_triton(q, k, positions, table)
    if k_cache.dtype == FP8_DTYPE:
        k, v = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
    write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


@gpu
@pytest.mark.parametrize("num_tokens", [1, 17, 1000])
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 16, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_matches_unfused_launches(num_tokens, heads, dtype, fp8):
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(num_tokens)
    inputs = make_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype,
                         FP8_DTYPE if fp8 else dtype, gen, device="cuda")
    q, k, v, positions, k_cache, v_cache, slot_mapping = inputs
    table = cos_sin_cache(head_dim, "cuda")
    scales = (0.011, 0.023) if fp8 else (1.0, 1.0)
    caches = k_cache.clone(), v_cache.clone()
    want = unfused_triton(q, k, v, positions, table, *caches, slot_mapping, *scales)
    k_out = torch.empty_like(k)  # the rotated k, in the model dtype whatever the cache holds
    got = rotary_write_kv_cache(q, k, v, positions, table, k_cache, v_cache, slot_mapping,
                                *scales, k_out)
    assert_same((got, k_cache, v_cache), (want, *caches), f"GPU {num_tokens} {heads} {dtype}")
    assert torch.equal(k_out, apply_rotary_triton(q, k, positions, table)[1])

"""The KV-cache write reference (the oracle of the fused rotary + write kernel) vs a per-token
Python loop."""

import pytest
import torch

from kiln.kernels.kv_cache import write_kv_cache_ref


def check(fn, num_tokens, num_kv_heads, head_dim, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = num_tokens // block_size + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    # k and v come out of a fused projection: token stride larger than heads * head_dim
    kv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(dtype)
    k, v = kv[:, 0], kv[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    padding = torch.rand(num_tokens, generator=gen) < 0.25
    slots[padding] = -1
    slot_mapping = slots
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // block_size, slot % block_size] = k[t]
            want_v[slot // block_size, slot % block_size] = v[t]
    fn(k, v, k_cache, v_cache, slot_mapping)
    # a pure copy: bit-exact, and every slot not named keeps its old (random) content
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0)


# (num_tokens, num_kv_heads, head_dim, block_size)
CASES = [(1, 1, 64, 16), (17, 4, 64, 16), (40, 3, 24, 8)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference(case, dtype):
    check(write_kv_cache_ref, *case, dtype)

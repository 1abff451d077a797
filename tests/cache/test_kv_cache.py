"""KVCache data movement: random contents, every layer, K and V."""

import pytest
import torch

from kiln.cache import KVCache


def make(device: str = "cpu", dtype: torch.dtype = torch.float32,
         staging_blocks: int = 4) -> KVCache:
    """staging_blocks: blocks a swap moves per chunk (its staging buffers hold 2 x that)."""
    cache = KVCache(
        num_layers=3,
        num_blocks=6,
        block_size=4,
        num_kv_heads=2,
        head_dim=5,
        dtype=dtype,
        device=device,
        num_cpu_blocks=4,
        staging_bytes=2 * staging_blocks * KVCache.bytes_per_block(3, 4, 2, 5, dtype),
    )
    g = torch.Generator().manual_seed(0)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g).to(dtype))
    cache.kv_cpu.copy_(torch.randn(cache.kv_cpu.shape, generator=g).to(dtype))
    return cache


def test_layout_and_views():
    cache = make()
    assert cache.k_caches[1].shape == (6, 4, 2, 5)
    assert cache.k_caches[1].data_ptr() == cache.kv[1, 0].data_ptr()
    assert cache.v_caches[2].data_ptr() == cache.kv[2, 1].data_ptr()
    cache.k_caches[0][3].fill_(7.0)  # a view: writes land in the shared allocation
    assert torch.all(cache.kv[0, 0, 3] == 7.0)


def test_bytes_per_block_and_budget():
    per_block = KVCache.bytes_per_block(32, 16, 8, 128, torch.bfloat16)
    assert per_block == 2 * 32 * 16 * 8 * 128 * 2  # 128 KiB for Llama-3-8B
    assert KVCache.num_blocks_for_budget(10 * per_block + 1, 32, 16, 8, 128, torch.bfloat16) == 10
    assert KVCache.num_blocks_for_budget(-5, 32, 16, 8, 128, torch.bfloat16) == 0
    assert KVCache.bytes_per_block(1, 1, 1, 1, torch.float32) == 8


def check_copy_blocks(device: str, dtype: torch.dtype = torch.float32) -> None:
    cache = make(device, dtype)
    before = cache.kv.clone()
    # Block 1 is both a destination and another pair's source: it must give its old data.
    cache.copy_blocks([(1, 4), (0, 1), (0, 5)])
    expected = before.clone()
    expected[:, :, 4] = before[:, :, 1]
    expected[:, :, 1] = before[:, :, 0]
    expected[:, :, 5] = before[:, :, 0]
    torch.testing.assert_close(cache.kv, expected, rtol=0, atol=0)


def check_swap_round_trip(device: str, dtype: torch.dtype = torch.float32,
                          staging_blocks: int = 4) -> None:
    cache = make(device, dtype, staging_blocks)
    gpu_before, cpu_before = cache.kv.clone(), cache.kv_cpu.clone()
    cache.swap_out([(5, 0), (2, 3)])
    cpu_expected = cpu_before.clone()
    cpu_expected[:, :, 0] = gpu_before[:, :, 5].cpu()
    cpu_expected[:, :, 3] = gpu_before[:, :, 2].cpu()
    torch.testing.assert_close(cache.kv_cpu, cpu_expected, rtol=0, atol=0)
    torch.testing.assert_close(cache.kv, gpu_before, rtol=0, atol=0)  # source untouched
    cache.swap_in([(3, 0), (0, 4), (1, 1)])
    expected = gpu_before.clone()
    expected[:, :, 0] = gpu_before[:, :, 2]
    expected[:, :, 4] = gpu_before[:, :, 5]
    expected[:, :, 1] = cpu_before[:, :, 1].to(device)
    torch.testing.assert_close(cache.kv, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_copy_blocks_cpu(dtype):
    check_copy_blocks("cpu", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("staging_blocks", [1, 2, 4])
def test_swap_round_trip_cpu(dtype, staging_blocks):
    """Staging chunks of one block, of two (the last one short) and of all: the two staging
    buffers take turns."""
    check_swap_round_trip("cpu", dtype, staging_blocks)


def test_empty_pairs_are_noops():
    cache = make()
    before, cpu_before = cache.kv.clone(), cache.kv_cpu.clone()
    cache.copy_blocks([])
    cache.swap_out([])
    cache.swap_in([])
    assert torch.equal(cache.kv, before) and torch.equal(cache.kv_cpu, cpu_before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copy_and_swap_cuda():
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        check_copy_blocks("cuda", dtype)
        for staging_blocks in (1, 2, 4):
            check_swap_round_trip("cuda", dtype, staging_blocks)
    cache = make("cuda", torch.bfloat16)
    before = cache.kv.clone()
    cache.swap_out([(0, 2)])
    cache.swap_in([(2, 5)])
    torch.cuda.synchronize()
    assert torch.equal(cache.kv[:, :, 5], before[:, :, 0])

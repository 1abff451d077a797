"""Scatter the new tokens' keys and values into the paged KV cache.

    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping[t]] = k[t]     (same for v)

with slot = block_id * block_size + offset; tokens with slot < 0 (batch padding) are skipped.
The caches are [num_blocks, block_size, num_kv_heads, head_dim] and are written in place.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.kernels._triton import next_power_of_2, tl, triton, use_triton


@triton.jit
def _write_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    block_size, num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        offs_h = tl.arange(0, BLOCK_H)[:, None]
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        mask = (offs_h < num_kv_heads) & (offs_d < HEAD_DIM)
        k = tl.load(k_ptr + tok * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
        v = tl.load(v_ptr + tok * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + offs_h * stride_kch
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + offs_h * stride_vch
        tl.store(k_dst + offs_d, k, mask=mask)
        tl.store(v_dst + offs_d, v, mask=mask)


def write_kv_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Launch the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert k_cache.dtype == v_cache.dtype == k.dtype == v.dtype
    assert k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    block_h, block_d = next_power_of_2(num_kv_heads), next_power_of_2(head_dim)
    _write_kv_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1], num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )  # fmt: skip


def write_kv_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain PyTorch scatter (the CPU path and the test oracle)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[valid]
    v_cache[blocks, offsets] = v[valid]


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, num_kv_heads, head_dim] into the caches at `slot_mapping` (in place)."""
    if use_triton(k, v, k_cache, v_cache, slot_mapping):
        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)


# ---- FP8 (e4m3) KV cache: storage helpers (see kiln/quant/kv_cache.py for the scheme) ----

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the KV cache for ``--kv-cache-dtype`` ("auto": the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}; choose auto or fp8")


def fp8_inv_scale(scale: float) -> float:
    """1 / scale rounded to float32: every path computes x / scale as x * fp8_inv_scale(scale).

    torch on CUDA divides by a Python scalar that way anyway, and true division on CPU (or in a
    kernel) would round differently in the last bit, which an fp8 code occasionally inherits."""
    return float(np.float32(1.0) / np.float32(scale))


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """k or v [T, H_kv, D] in the model dtype -> fp8 for the cache (call before the write)."""
    return (x.float() * fp8_inv_scale(scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(cache: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fp8 cache tensor (or gathered pages) -> ``dtype`` values."""
    return (cache.float() * scale).to(dtype)


def attention_scales(sm_scale: float, k_scale: float, v_scale: float) -> tuple[float, float]:
    """(score scale to use with raw fp8 K, factor for the output computed with raw fp8 V)."""
    return sm_scale * k_scale, v_scale

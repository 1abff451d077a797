"""The paged KV cache's write, as a reference, and its FP8 storage helpers.

    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping[t]] = k[t]     (same for v)

with slot = block_id * block_size + offset; tokens with slot < 0 (batch padding) are skipped.
The caches are [num_blocks, block_size, num_kv_heads, head_dim] and are written in place. On
the GPU the write happens inside the rotary kernel (kiln/kernels/rotary.py), which this
reference checks.
"""

from __future__ import annotations

import numpy as np
import torch


def write_kv_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain PyTorch scatter (the CPU path of rotary_write_kv_cache and the test oracle)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[valid]
    v_cache[blocks, offsets] = v[valid]


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

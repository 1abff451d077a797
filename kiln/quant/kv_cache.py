"""FP8 (e4m3) KV cache with one K scale and one V scale per layer.

    cache = fp8(clamp(k / k_scale, -448, 448)),    k ~= cache * k_scale      (same for v)

Scales come from calibration (``kiln quantize`` stores max|k| / 448 per layer in the JSON
config) or default to 1.0 (K and V of RMS-normed models rarely exceed +-448). Attention never
needs a dequantized cache: a scale on K multiplies every score and a scale on V every output,

    softmax(sm q . (c_k k_scale)) (c_v v_scale) = softmax((sm k_scale) q . c_k) c_v * v_scale

so a kernel casts fp8 tiles to the query dtype, runs with ``sm_scale * k_scale`` and multiplies
its output by ``v_scale`` (``attention_scales``).
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.layers.attention import Attention

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
DEFAULT_SCALE = 1.0


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of the KV cache for ``--kv-cache-dtype`` ("auto": the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}; choose auto or fp8")


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """k or v [T, H_kv, D] in the model dtype -> fp8 for the cache (call before the write)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(cache: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fp8 cache tensor (or gathered pages) -> ``dtype`` values."""
    return (cache.float() * scale).to(dtype)


def attention_scales(sm_scale: float, k_scale: float, v_scale: float) -> tuple[float, float]:
    """(score scale to use with raw fp8 K, factor for the output computed with raw fp8 V)."""
    return sm_scale * k_scale, v_scale


def set_kv_scales(model: nn.Module, scales: list[list[float]] | None) -> None:
    """Give each attention layer (by ``layer_idx``) its ``k_scale`` / ``v_scale`` floats."""
    layers = sorted((m for m in model.modules() if isinstance(m, Attention)),
                    key=lambda m: m.layer_idx)
    if scales is not None and len(scales) != len(layers):
        raise ValueError(f"{len(scales)} KV-cache scale pairs for {len(layers)} attention layers")
    for i, attn in enumerate(layers):
        attn.k_scale, attn.v_scale = (float(scales[i][0]), float(scales[i][1])) if scales \
            else (DEFAULT_SCALE, DEFAULT_SCALE)

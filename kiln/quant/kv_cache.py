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

from torch import nn

from kiln.kernels.kv_cache import (  # noqa: F401 (re-exported: the quantization API)
    FP8_DTYPE,
    FP8_MAX,
    attention_scales,
    dequantize_kv,
    kv_cache_torch_dtype,
    quantize_kv,
)
from kiln.layers.attention import Attention

DEFAULT_SCALE = 1.0


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's attention layers in layer order."""
    return sorted((m for m in model.modules() if isinstance(m, Attention)),
                  key=lambda m: m.layer_idx)


def set_kv_scales(model: nn.Module, scales: list[list[float]] | None) -> None:
    """Give each attention layer (by ``layer_idx``) its ``k_scale`` / ``v_scale`` floats."""
    layers = attention_layers(model)
    if scales is not None and len(scales) != len(layers):
        raise ValueError(f"{len(scales)} KV-cache scale pairs for {len(layers)} attention layers")
    for i, attn in enumerate(layers):
        attn.k_scale, attn.v_scale = (float(scales[i][0]), float(scales[i][1])) if scales \
            else (DEFAULT_SCALE, DEFAULT_SCALE)

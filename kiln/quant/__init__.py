"""Post-training quantization: weight formats for the Linear layer, the methods that fill them
(RTN, AWQ, GPTQ, FP8, SmoothQuant), calibration observers, FP8 KV-cache helpers, and the
quantized checkpoint format (safetensors + ``kiln_quant_config.json``).

Module map: ``config`` (QuantConfig) -> ``rtn`` / ``w8a8`` (grids, W8A8 GEMM) -> ``methods``
(the LinearMethods) -> ``awq`` / ``gptq`` / ``smoothquant`` / ``observers`` / ``calibration``
-> ``quantize`` (quantize_model) -> ``checkpoint`` (save / load / loader hook) -> ``cli``.
"""

from kiln.quant.calibration import calibration_ids
from kiln.quant.checkpoint import read_quant_config, save_quantized, setup_quantization
from kiln.quant.config import ON_THE_FLY, QuantConfig, on_the_fly_config
from kiln.quant.kv_cache import (
    attention_scales,
    dequantize_kv,
    kv_cache_torch_dtype,
    quantize_kv,
    set_kv_scales,
)
from kiln.quant.methods import W8A8Method, WeightOnlyMethod, install_methods
from kiln.quant.observers import make_observer
from kiln.quant.quantize import model_size_bytes, quantize_model

__all__ = [
    "ON_THE_FLY",
    "QuantConfig",
    "W8A8Method",
    "WeightOnlyMethod",
    "attention_scales",
    "calibration_ids",
    "dequantize_kv",
    "install_methods",
    "kv_cache_torch_dtype",
    "make_observer",
    "model_size_bytes",
    "on_the_fly_config",
    "quantize_kv",
    "quantize_model",
    "read_quant_config",
    "save_quantized",
    "set_kv_scales",
    "setup_quantization",
]

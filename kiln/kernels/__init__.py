"""Fused kernels: Triton on CUDA, a plain-PyTorch reference everywhere else.

Each module holds one kernel family: the `@triton.jit` kernel, its launcher (`*_triton`), the
reference (`*_ref`, the CPU path and the test oracle) and the wrapper that layers call.
"""

from kiln.kernels._triton import HAS_TRITON
from kiln.kernels.activation import silu_and_mul, silu_and_mul_ref
from kiln.kernels.argmax import argmax_rows, argmax_rows_ref
from kiln.kernels.attention import paged_attention, paged_attention_ref
from kiln.kernels.kv_cache import write_kv_cache_ref
from kiln.kernels.rms_norm import rms_norm, rms_norm_ref
from kiln.kernels.rotary import apply_rotary, apply_rotary_ref

__all__ = [
    "HAS_TRITON",
    "apply_rotary",
    "apply_rotary_ref",
    "argmax_rows",
    "argmax_rows_ref",
    "paged_attention",
    "paged_attention_ref",
    "rms_norm",
    "rms_norm_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "write_kv_cache_ref",
]

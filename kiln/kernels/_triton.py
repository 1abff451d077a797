"""Optional Triton import shared by the kernel files.

Triton is an optional dependency: without it every wrapper runs its PyTorch reference. The stub
below only lets the `@triton.jit` definitions and their `tl.constexpr` annotations be parsed;
nothing calls a kernel unless `HAS_TRITON` is true.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install: the references do the work
    HAS_TRITON = False

    class _TritonStub:
        @staticmethod
        def jit(fn=None, **kwargs):
            return fn if fn is not None else (lambda f: f)

    class _LanguageStub:
        constexpr = object

    triton = _TritonStub()  # type: ignore[assignment]
    tl = _LanguageStub()  # type: ignore[assignment]

__all__ = ["HAS_TRITON", "next_power_of_2", "num_sms", "tl", "triton", "use_triton"]


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton path can run: triton imported and every tensor is on CUDA."""
    return HAS_TRITON and all(t.is_cuda for t in tensors)


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.lru_cache(maxsize=16)
def _num_sms_cuda(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of `device` (a nominal 8 off CUDA, for the interpreter)."""
    if device.type != "cuda":
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms_cuda(index)

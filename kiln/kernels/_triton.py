"""Optional Triton import shared by the kernel files.

Triton is an optional dependency: without it every wrapper runs its PyTorch reference. The stub
below only lets the `@triton.jit` definitions and their `tl.constexpr` annotations be parsed;
nothing calls a kernel unless `HAS_TRITON` is true.
"""

from __future__ import annotations

import functools
import os

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
    TensorDescriptor = None  # type: ignore[assignment,misc]

if HAS_TRITON:  # an installed triton too old for the kernels is an error, not a silent fallback
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # host-side TMA descriptors
    except ImportError as exc:
        raise ImportError(
            f"Kiln's kernels need triton >= 3.4 (host TMA descriptors); found triton "
            f"{triton.__version__}. Upgrade it: pip install 'triton>=3.4'") from exc

__all__ = ["HAS_TRITON", "TensorDescriptor", "next_power_of_2", "num_sms", "pdl", "prefetch_l2",
           "release_then_wait", "tl", "triton", "use_triton", "wait_for_inputs"]


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


# ---- programmatic dependent launch (PDL, sm_90+) ------------------------------------------------
#
# A kernel launched with ``launch_pdl=True`` may start while the kernel before it in the stream is
# still running, so its launch latency and whatever it loads that its predecessor does not write
# (weights, the engine's per-step inputs, KV-cache entries of earlier steps) overlap the previous
# kernel's tail; at decode batch sizes every layer is ~10 kernels of a few microseconds, and these
# gaps are a large share of the step. The next kernel is released only after this kernel's wait,
# so a chain of PDL launches overlaps at most two kernels, three where the middle one is a short
# kernel that releases the next one first (``release_then_wait``). The contract, kept by every
# kernel that takes USE_PDL:
# - before its wait it stores nothing (a store could overwrite memory a running kernel still
#   reads) and reads nothing the step's kernels write: only weights, the engine's per-step inputs
#   (written before the step) and KV-cache entries of earlier steps;
# - every program calls ``wait_for_inputs`` or ``release_then_wait`` before exiting (a grid that
#   exited without waiting would let its dependents past their wait before its own predecessor
#   had finished).


@triton.jit
def wait_for_inputs(USE_PDL: tl.constexpr):
    """PDL: block until the previous kernel has finished and its writes are visible, then let
    the next kernel launch. A no-op without PDL (and under the interpreter)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, USE_PDL: tl.constexpr):
    """PDL: ask L2 for the line holding each of ``ptrs`` (any shape, every address valid), so a
    kernel waiting on its predecessor has its first weight bytes on their way. A hint: nothing
    is loaded into registers or shared memory, so the K loop's software pipeline is untouched.
    A no-op without PDL (and under the interpreter)."""
    if USE_PDL:
        tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def release_then_wait(USE_PDL: tl.constexpr):
    """PDL for a short kernel between two long ones (the RMSNorm between two GEMMs): let the
    next kernel launch first, then wait. Its programs take the SMs the kernel before this one
    frees and start on their weights while it finishes (benchmarks/results/h100/ab_runs.txt
    44). Waiting on this kernel still means waiting on its predecessor: this one finishes only
    after its own wait."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@functools.lru_cache(maxsize=16)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_properties(index).major


def pdl(device: torch.device) -> dict:
    """Launch options for a kernel on ``device``: USE_PDL (the constexpr the kernel takes) and
    launch_pdl. PDL on compiled kernels on sm_90+; KILN_PDL=0 turns it off (the benchmarks'
    switch to measure what it is worth)."""
    on = device.type == "cuda" and os.environ.get("KILN_PDL", "1") != "0"
    if on:
        index = device.index if device.index is not None else torch.cuda.current_device()
        on = _capability_major(index) >= 9
    return {"USE_PDL": on, "launch_pdl": on}

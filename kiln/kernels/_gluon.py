"""Optional Gluon (triton.experimental.gluon, sm_90) import shared by the Hopper kernel files.

Gluon has no interpreter: on a host without a GPU these kernels can only be compiled for sm_90
(``compile_sm90``), which the CPU tests do. The names differ between triton 3.6 (the GPU
machine's) and 3.9 (CI's): 3.6's are used, 3.9's where they were renamed. Without Gluon,
HAS_GLUON is False and every ``*_applies`` of these kernels says no.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as ttgl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    # renamed after triton 3.6 (3.9: async_load for both copies, the old names raise;
    # memdesc .reinterpret; ttgl.barrier)
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    memdesc_reinterpret = (getattr(ttgl.shared_memory_descriptor, "reinterpret", None)
                           or ttgl.shared_memory_descriptor._reinterpret)
    cta_barrier = getattr(ttgl, "thread_barrier", None) or ttgl.barrier
    HAS_GLUON = True
    jit = gluon.jit
    constexpr_function = gluon.constexpr_function
except ImportError:  # no triton, or one without Gluon's Hopper API
    HAS_GLUON = False
    GluonTensorDescriptor = None
    gluon = ttgl = async_copy = mbarrier = tma = None  # type: ignore[assignment]
    fence_async_shared = warpgroup_mma = warpgroup_mma_wait = None  # type: ignore[assignment]
    tma_load = cp_async = memdesc_reinterpret = cta_barrier = None

    def jit(fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)

    def constexpr_function(fn):
        return fn

__all__ = ["HAS_GLUON", "GluonTensorDescriptor", "async_copy", "compile_sm90", "constexpr_function",
           "cp_async", "cta_barrier", "fence_async_shared", "gdc", "gluon", "jit", "mbarrier",
           "memdesc_reinterpret", "tma", "tma_load", "ttgl", "warpgroup_mma", "warpgroup_mma_wait"]


if HAS_GLUON:

    @jit
    def gdc(WAIT: ttgl.constexpr):
        """griddepcontrol.wait (WAIT) or .launch_dependents, as kiln.kernels._triton's
        wait_for_inputs: a PDL launch waits for the kernel before it, then lets the next one in."""
        if WAIT:
            ttgl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [],
                                        dtype=ttgl.int32, is_pure=False, pack=1)
        else:
            ttgl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                        dtype=ttgl.int32, is_pure=False, pack=1)
else:
    gdc = None


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, num_warps: int,
                 unspecialized: tuple[str, ...] = ()):
    """``fn`` compiled for sm_90 on any host (no GPU needed): triton's CompiledKernel, whose asm
    holds ttgir / ptx / cubin. signature: argument name -> triton type string (constexprs are
    added); pointers and i32 arguments are specialized as a launch would (divisible by 16),
    except those in ``unspecialized``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = dict(signature)
    sig.update({name: "constexpr" for name in constexprs})
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, ty in sig.items()
             if (ty.startswith("*") or ty == "i32") and name not in unspecialized}
    src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(c),): v
                                              for c, v in constexprs.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))

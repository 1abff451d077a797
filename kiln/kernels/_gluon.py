"""Optional Gluon import shared by the sm_90 Gluon kernels (w4_gemv.py, wint_ws.py).

Gluon is Triton's lower-level dialect (explicit layouts, shared memory, mbarriers, TMA, wgmma,
warp specialization). Some of its names moved after triton 3.6 (the GPU machines' version) and
3.9 (CI's): the aliases below take whichever exists. Without a triton that has Gluon's Hopper
API, ``HAS_GLUON`` is False, ``jit`` leaves functions undecorated and the kernels' ``*_applies``
say no. Gluon does not run under TRITON_INTERPRET: on CPU these kernels only compile
(``compile_sm90``).
"""

from __future__ import annotations

SMEM_BUDGET = 227 * 1024  # shared memory an sm_90 (H100) block may use

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
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # renamed after triton 3.6 (3.9: async_load for both copies, the old names raise;
    # memdesc .reinterpret; ttgl.barrier)
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    memdesc_reinterpret = (getattr(ttgl.shared_memory_descriptor, "reinterpret", None)
                           or ttgl.shared_memory_descriptor._reinterpret)
    cta_barrier = getattr(ttgl, "thread_barrier", None) or ttgl.barrier
    HAS_GLUON = True
    jit = gluon.jit
    constexpr_function = gluon.constexpr_function  # host code a kernel calls on constexprs
except ImportError:  # no triton, or one without Gluon's Hopper API
    HAS_GLUON = False
    gluon = ttgl = async_copy = mbarrier = tma = TensorDescriptor = None
    fence_async_shared = warpgroup_mma = warpgroup_mma_wait = None
    tma_load = cp_async = memdesc_reinterpret = cta_barrier = None

    def jit(fn=None, **options):
        return fn if fn is not None else (lambda f: f)

    constexpr_function = jit

__all__ = ["HAS_GLUON", "SMEM_BUDGET", "TensorDescriptor", "async_copy", "axis_layout",
           "compile_sm90", "constexpr_function", "cp_async", "cta_barrier", "fence_async_shared",
           "gdc", "jit", "mbarrier", "memdesc_reinterpret", "tma", "tma_load", "ttgl",
           "warpgroup_mma", "warpgroup_mma_wait"]


def _axis_layout_impl(layout, axis):
    """The layout of an arange along ``axis`` of a tensor in ``layout`` (every other axis
    sliced away, highest first, so that [:, None]-style indexing restores ``layout``)."""
    for dim in reversed(range(layout.rank)):
        if dim != axis:
            layout = ttgl.SliceLayout(dim, layout)
    return layout


axis_layout = constexpr_function(_axis_layout_impl)


@jit
def gdc(WAIT: ttgl.constexpr):
    """griddepcontrol.wait (WAIT) or .launch_dependents, as kiln.kernels._triton.wait_for_inputs."""
    if WAIT:
        ttgl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=ttgl.int32,
                                    is_pure=False, pack=1)
    else:
        ttgl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                    dtype=ttgl.int32, is_pure=False, pack=1)


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, num_warps: int,
                 unspecialized: tuple[str, ...] = (), **options):
    """A Gluon kernel compiled for sm_90 on any host (no GPU needed: triton's own ptxas):
    triton's CompiledKernel, whose asm holds ttgir / ptx / cubin. ``signature`` maps each
    runtime argument to its type (``*bf16``, ``i32``, ``tensordesc<...>``); pointers and
    integers are specialized as a launch would (divisible by 16) except ``unspecialized``."""
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
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, **options))

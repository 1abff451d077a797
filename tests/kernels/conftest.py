"""Kernel tests: on a machine without CUDA the Triton launchers run under the interpreter."""

import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))  # for kernel_testing

if not torch.cuda.is_available():
    # Must be set before the @triton.jit decorators run: triton picks interpreter or compiler there.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # If another test package imported the kernels first, they were built for a GPU: rebuild them
    # (leaves first, so that each module re-imports its fresh dependencies).
    for name in (
        "kiln.kernels._triton",
        "kiln.kernels.rms_norm",
        "kiln.kernels.activation",
        "kiln.kernels.argmax",
        "kiln.kernels.rotary",
        "kiln.kernels.kv_cache",
        "kiln.kernels.gated_gemm",
        "kiln.kernels.attention_prefill",
        "kiln.kernels.attention_decode",
        "kiln.kernels.attention",
        "kiln.kernels",
    ):
        if name in sys.modules:
            importlib.reload(sys.modules[name])

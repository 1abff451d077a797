"""Two CUDA green contexts that split the GPU's SMs between them, as streams torch can use.

torch.cuda.green_contexts.GreenContext.create(num_sms=N) splits the whole device each time it
is called (aten/src/ATen/cuda/CUDAGreenContext.cpp), so two of its contexts share their first
SMs. `split(n)` keeps both halves of one split instead: cuDevSmResourceSplitByCount's group of
n SMs and its remainder, each a green context (cuGreenCtxCreate) with a stream of its own
(cuGreenCtxStreamCreate), wrapped in torch.cuda.ExternalStream. Through the driver by ctypes:
torch exposes neither the remainder nor the driver's stream.
"""

from __future__ import annotations

import ctypes

import torch

_RESOURCE_BYTES = 512  # a CUdevResource (144 in the CUDA 12 / 13 headers), with room to spare
_SM_COUNT_OFFSET = 96  # CUdevResource.sm.smCount: after the type (4) and 92 bytes of padding
_RESOURCE_TYPE_SM = 1
_GREEN_CTX_DEFAULT_STREAM = 1  # required by cuGreenCtxCreate
_STREAM_NON_BLOCKING = 1  # required by cuGreenCtxStreamCreate
_alive: list = []  # the contexts, streams and resources: a context destroyed takes its streams


def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(cu: ctypes.CDLL, status: int, call: str) -> None:
    if status != 0:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"{call} failed: {status} ({(name.value or b'?').decode()})")


def split(num_sms: int, device: int = 0) -> tuple[torch.cuda.ExternalStream, int,
                                                  torch.cuda.ExternalStream, int]:
    """(a stream on a group of about `num_sms` SMs, its SM count, a stream on the other SMs,
    their count). The driver rounds the group to its granularity (8 SMs on an H100)."""
    torch.cuda.init()  # the primary context, which the green contexts share memory with
    cu = _driver()
    dev = ctypes.c_int()
    _check(cu, cu.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    whole = ctypes.create_string_buffer(_RESOURCE_BYTES)
    _check(cu, cu.cuDeviceGetDevResource(dev, whole, _RESOURCE_TYPE_SM), "cuDeviceGetDevResource")
    group = ctypes.create_string_buffer(_RESOURCE_BYTES)
    rest = ctypes.create_string_buffer(_RESOURCE_BYTES)
    groups = ctypes.c_uint(1)
    _check(cu, cu.cuDevSmResourceSplitByCount(group, ctypes.byref(groups), whole, rest, 0,
                                              num_sms), "cuDevSmResourceSplitByCount")
    streams = []
    for resource in (group, rest):
        desc, ctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        _check(cu, cu.cuDevResourceGenerateDesc(ctypes.byref(desc), resource, 1),
               "cuDevResourceGenerateDesc")
        _check(cu, cu.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, _GREEN_CTX_DEFAULT_STREAM),
               "cuGreenCtxCreate")
        _check(cu, cu.cuGreenCtxStreamCreate(ctypes.byref(stream), ctx, _STREAM_NON_BLOCKING, 0),
               "cuGreenCtxStreamCreate")
        _alive.append((ctx, stream, resource))
        sms = ctypes.c_uint.from_buffer_copy(resource.raw, _SM_COUNT_OFFSET).value
        streams += [torch.cuda.ExternalStream(stream.value), sms]
    return tuple(streams)

"""Where a number was measured: device, versions, commit, and the device's measured ceilings.

The ceilings are measured on the spot (device-to-device copy for bandwidth, a square GEMM for
compute) so that achieved GB/s and TFLOP/s are set against what this machine can do, not a
datasheet. Pass known values instead (shared/GPU.md lists the H100's) to skip the measurement.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch


def device_info(device: torch.device | str) -> dict[str, Any]:
    device = torch.device(device)
    info: dict[str, Any] = {"type": device.type, "cpu": platform.processor() or platform.machine(),
                            "num_cpus": os.cpu_count()}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        info.update(name=props.name, count=torch.cuda.device_count(),
                    memory_gb=round(props.total_memory / 1e9, 1),
                    num_sms=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}")
    else:
        info["name"] = f"CPU ({info['cpu']}, {info['num_cpus']} cores)"
    return info


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    import kiln

    return {"kiln": kiln.__version__, "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": _version("triton"), "transformers": _version("transformers"),
            "numpy": _version("numpy")}


def _time_s(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median wall seconds of ``fn`` after one warm-up call."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _release(device: torch.device) -> None:
    """Hand cached blocks back, so the engine's KV sizing that follows does not count them."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_bandwidth_gbps(device: torch.device | str, num_bytes: int | None = None) -> float:
    """Device-to-device copy, counting read + write (how shared/GPU.md quotes 2831 GB/s)."""
    device = torch.device(device)
    num_bytes = num_bytes or ((1 << 30) if device.type == "cuda" else (64 << 20))

    def copy_seconds() -> float:
        src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        return _time_s(lambda: dst.copy_(src), device, reps=10)

    seconds = copy_seconds()
    _release(device)
    return 2 * num_bytes / seconds / 1e9


def measure_matmul_tflops(device: torch.device | str, dtype: torch.dtype | None = None,
                          n: int | None = None) -> float:
    """A square GEMM: bf16 8192^3 on CUDA (cuBLAS), float32 1024^3 on CPU."""
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    n = n or (8192 if device.type == "cuda" else 1024)

    def gemm_seconds() -> float:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        return _time_s(lambda: a @ b, device, reps=10)

    seconds = gemm_seconds()
    _release(device)
    return 2 * n**3 / seconds / 1e12


def ceilings(device: torch.device | str, peak_gbps: float | None = None,
             peak_tflops: float | None = None) -> dict[str, Any]:
    """Bandwidth and compute ceilings: the given values, else measured now."""
    device = torch.device(device)
    return {
        "bandwidth_gbps": peak_gbps or measure_bandwidth_gbps(device),
        "bandwidth_source": "given" if peak_gbps else "measured: device-to-device copy",
        "compute_tflops": peak_tflops or measure_matmul_tflops(device),
        "compute_source": "given" if peak_tflops else (
            "measured: bf16 GEMM 8192^3" if device.type == "cuda"
            else "measured: float32 GEMM 1024^3"),
    }

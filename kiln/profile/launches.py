"""Device kernels of a Chrome trace grouped by launch grid: one row per (kernel, grid, block).

The per-kernel table (kernels.py) gives Kiln's Triton kernels one row per name, so a kernel
that serves several layers (the weight-only GEMM of qkv and of o_proj) reports one total. Each
layer launches it with its own grid, which the trace records with every kernel event
(``args.grid``, ``args.block``): grouping on it tells the layers apart, and gives each its own
time inside the engine's step. That time is what a launch configuration has to be judged by:
a split-K GEMM timed alone in a graph of itself ranked two split counts the other way round
(benchmarks/results/h100/wint_mma_tiles.txt, 7.-8.).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any


def _dims(value: Any) -> str:
    """[132, 4, 1] -> "132x4x1"; anything else (absent, malformed) -> "?"."""
    if isinstance(value, list | tuple) and value and all(isinstance(d, int) for d in value):
        return "x".join(str(d) for d in value)
    return "?"


def launch_rows(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Kernel events of a Chrome trace (``cat`` "kernel") grouped by (name, grid, block):
    calls, total and mean device microseconds, sorted by total time, longest first."""
    groups: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for event in trace.get("traceEvents", []):
        if event.get("cat") != "kernel" or event.get("ph") != "X":
            continue
        args = event.get("args") or {}
        key = (str(event.get("name", "?")), _dims(args.get("grid")), _dims(args.get("block")))
        groups[key].append(float(event.get("dur", 0.0)))
    rows = [{"name": name, "grid": grid, "block": block, "calls": len(durations),
             "time_us": sum(durations), "mean_us": sum(durations) / len(durations)}
            for (name, grid, block), durations in groups.items()]
    return sorted(rows, key=lambda r: -r["time_us"])

"""Device kernels of a Chrome trace grouped by launch grid: one row per (kernel, grid, block).

The per-kernel table (kernels.py) gives Kiln's Triton kernels one row per name, so a kernel
that serves several layers (the weight-only GEMM of qkv and of o_proj) reports one total. Each
layer launches it with its own grid, which the trace records with every kernel event
(``args.grid``, ``args.block``): grouping on it tells the layers apart, and gives each its own
time inside the engine's step. That time is what a launch configuration has to be judged by:
a split-K GEMM timed alone in a graph of itself ranked two split counts the other way round
(benchmarks/results/h100/wint_mma_tiles.txt, 7.-8.).

With programmatic dependent launch a kernel starts while the one before it still runs (and
waits), so its own duration counts time that is the kernel before's: an RMSNorm of a decode step
lasts ~29 us from its start, of which ~1.5 us are its own (benchmarks/results/h100/
profile_bs64_pdl). Each row therefore also has the kernels' share of their stream's
busy time: from the later of the kernel's start and the completion before it on the stream,
to its own completion. The shares of a stream add up to the time it was busy.
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
    calls, total and mean device microseconds of their own, and ``path_us``, their share of
    their stream's busy time (see the module docstring); sorted by that share, largest first."""
    durations: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    shares: dict[tuple[str, str, str], float] = defaultdict(float)
    by_stream: dict[Any, list[tuple[float, float, tuple[str, str, str]]]] = defaultdict(list)
    for event in trace.get("traceEvents", []):
        if event.get("cat") != "kernel" or event.get("ph") != "X":
            continue
        args = event.get("args") or {}
        key = (str(event.get("name", "?")), _dims(args.get("grid")), _dims(args.get("block")))
        start, dur = float(event.get("ts", 0.0)), float(event.get("dur", 0.0))
        durations[key].append(dur)
        by_stream[args.get("stream")].append((start + dur, start, key))
    for events in by_stream.values():  # a stream's kernels complete in launch order
        done = float("-inf")
        for end, start, key in sorted(events):
            shares[key] += max(end - max(start, done), 0.0)
            done = max(done, end)
    rows = [{"name": name, "grid": grid, "block": block, "calls": len(durs),
             "time_us": sum(durs), "mean_us": sum(durs) / len(durs),
             "path_us": shares[(name, grid, block)]}
            for (name, grid, block), durs in durations.items()]
    return sorted(rows, key=lambda r: -r["path_us"])

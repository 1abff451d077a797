"""The roofline plot: each kernel row at (FLOP/byte, achieved TFLOP/s) under the two roofs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

NUM_LABELS = 8


def plot_roofline(rows: list[dict[str, Any]], peak_tflops: float, peak_gbps: float,
                  path: Path, title: str) -> Path:
    """Rows with FLOPs > 0 are points sized by time share; the top ones are labelled. Rows
    above the roof (kernels.table says why) are counted in the title."""
    points = [r for r in rows if r["intensity"] and r["tflops"]]
    num_above = sum(1 for r in points if r["above_roof"])
    fig, ax = plt.subplots(figsize=(9, 6))
    ridge = peak_tflops * 1e3 / peak_gbps  # FLOP/byte
    lo = min([r["intensity"] for r in points] + [ridge / 100]) / 2
    hi = max([r["intensity"] for r in points] + [ridge * 100]) * 2
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    ax.plot(x, np.minimum(peak_tflops, x * peak_gbps / 1e3), "k-", lw=2,
            label=f"roof: {peak_gbps:.4g} GB/s, {peak_tflops:.3g} TFLOP/s")
    ax.axvline(ridge, color="gray", ls=":", label=f"ridge {ridge:.1f} FLOP/byte")
    if points:
        shares = np.array([r["share"] for r in points])
        colors = ["C3" if r["bound"] == "memory" else "C0" for r in points]
        ax.scatter([r["intensity"] for r in points], [r["tflops"] for r in points],
                   s=20 + 800 * shares, c=colors, alpha=0.6, edgecolors="k")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte, estimated from shapes)")
    ax.set_ylabel("achieved TFLOP/s")
    above = f"; {num_above} above the measured roof" if num_above else ""
    ax.set_title(title + f"  (red: memory-bound, blue: compute-bound; size: time share{above})",
                 fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()  # before the labels: it moves the axes, and with them the labels' boxes
    _label(fig, ax, sorted(points, key=lambda r: -r["share"])[:NUM_LABELS])
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _label(fig: plt.Figure, ax: plt.Axes, rows: list[dict[str, Any]]) -> None:
    """Label ``rows`` (largest share first), leaving out a label that would overlap one already
    placed: shapes of one op (the GEMMs of a layer) often land on the same spot."""
    renderer = fig.canvas.get_renderer()
    placed = []
    for r in rows:
        text = ax.annotate(f"{r['name'].replace('aten::', '')} {100 * r['share']:.0f}%",
                           (r["intensity"], r["tflops"]), fontsize=7, xytext=(4, 4),
                           textcoords="offset points")
        box = text.get_window_extent(renderer).padded(2)  # pixels: no two labels touch
        if any(box.overlaps(other) for other in placed):
            text.remove()
        else:
            placed.append(box)

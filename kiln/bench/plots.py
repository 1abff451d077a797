"""Plots of a result: latency CDFs for every run; throughput and P99 against request rate for a
serving sweep; decode tok/s and achieved GB/s per case for a latency run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def _num(value: float | None) -> float:
    """Matplotlib wants numbers: an undefined metric (one-token outputs) is drawn as nothing."""
    return math.nan if value is None else float(value)


def case_label(case: dict[str, Any]) -> str:
    if "request_rate" in case:
        rate = case["request_rate"]
        return f"{'inf' if math.isinf(float(rate)) else f'{rate:g}'} req/s"
    if "batch_size" in case:
        return f"bs={case['batch_size']} in={case['input_len']} out={case['output_len']}"
    return ", ".join(f"{k}={v}" for k, v in case.items())


def _values(records: list[dict], case: int, key: str) -> np.ndarray:
    rows = [r for r in records if r["case"] == case and r.get("ok", True)]
    if key == "itl_ms":
        return np.array([x for r in rows for x in r[key]], dtype=float)
    return np.array([r[key] for r in rows if r[key] is not None], dtype=float)


def plot_latency_cdfs(result: dict[str, Any], path: Path) -> Path:
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, (key, title) in zip(axes, LATENCIES, strict=True):
        for case, m in enumerate(result["metrics"]):
            values = np.sort(_values(result["requests"], case, key))
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post",
                        label=case_label(m["case"]))
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_rate_sweep(result: dict[str, Any], path: Path) -> Path:
    """Output tok/s and P99 latencies against the offered request rate (categorical axis)."""
    metrics = result["metrics"]
    labels = [case_label(m["case"]).replace(" req/s", "") for m in metrics]
    x = np.arange(len(metrics))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    left.plot(x, [m["output_tokens_per_s"] for m in metrics], "o-", label="output tok/s")
    twin = left.twinx()
    twin.plot(x, [m["requests_per_s"] for m in metrics], "s--", color="C1", label="requests/s")
    left.set_ylabel("output tokens/s")
    twin.set_ylabel("requests/s")
    lines = left.get_lines() + twin.get_lines()
    left.legend(lines, [line.get_label() for line in lines], fontsize=8)
    left.set_title("throughput vs request rate")
    for key, title in LATENCIES:
        right.plot(x, [_num(m[key]["p99"]) for m in metrics], "o-", label=f"P99 {title}")
    right.set_yscale("log")
    right.set_ylabel("ms")
    right.set_title("P99 latency vs request rate")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_decode(result: dict[str, Any], path: Path) -> Path:
    """Decode tok/s (Kiln and, if run, the peer) and achieved GB/s against the ceiling."""
    metrics = result["metrics"]
    labels = [case_label(m["case"]) for m in metrics]
    x = np.arange(len(metrics))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.4 if any("peer" in m for m in metrics) else 0.8
    left.bar(x, [_num(m["decode_tokens_per_s"]) for m in metrics], width, label="kiln")
    if width < 0.8:
        left.bar(x + width, [_num(m.get("peer", {}).get("decode_tokens_per_s")) for m in metrics],
                 width, label="HF transformers")
    left.set_ylabel("decode tokens/s")
    left.legend()
    right.bar(x, [_num(m["achieved_gbps"]) for m in metrics], 0.6)
    ceiling = result["ceilings"]["bandwidth_gbps"]
    right.axhline(ceiling, color="red", linestyle="--", label=f"ceiling {ceiling:,.0f} GB/s")
    right.set_ylabel("achieved GB/s (weights + KV per decode step)")
    right.legend()
    for ax in (left, right):
        ax.set_xticks(x, labels, rotation=20, ha="right", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(result: dict[str, Any], output_dir: Path) -> list[Path]:
    if result["kind"] not in ("latency", "throughput", "serve"):
        return []
    paths = [plot_latency_cdfs(result, output_dir / "latency_cdf.png")]
    if result["kind"] == "serve" and len(result["metrics"]) > 1:
        paths.append(plot_rate_sweep(result, output_dir / "rate_sweep.png"))
    if result["kind"] == "latency":
        paths.append(plot_decode(result, output_dir / "decode.png"))
    return paths

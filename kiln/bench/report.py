"""The markdown summary of a result (also printed to the terminal) and the one-call writer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markdown import Markdown

from kiln.bench.plots import case_label, write_plots
from kiln.bench.result import fmt, header_md, markdown_table, stat, write_result

TITLES = {"latency": "kiln bench latency", "throughput": "kiln bench throughput",
          "serve": "kiln bench serve", "profile": "kiln profile"}


def _latency_table(metrics: list[dict]) -> str:
    peer = any("peer" in m for m in metrics)
    headers = ["case", "TTFT ms (mean)", "TPOT ms (mean)", "ITL ms (p50 / p99)",
               "decode tok/s", "output tok/s", "GB/s", "% of ceiling"]
    if peer:
        headers += ["HF decode tok/s", "speedup vs HF (decode)"]
    rows = []
    for m in metrics:
        itl = m["itl_ms"]
        row = [case_label(m["case"]), stat(m["ttft_ms"], "mean"), stat(m["tpot_ms"], "mean"),
               f"{fmt(stat(itl, 'p50'), 2)} / {fmt(stat(itl, 'p99'), 2)}",
               m["decode_tokens_per_s"], m["output_tokens_per_s"], m.get("achieved_gbps"),
               None if m.get("bandwidth_utilization") is None
               else 100 * m["bandwidth_utilization"]]
        if peer:
            row += [m.get("peer", {}).get("decode_tokens_per_s"),
                    _times(m.get("peer_speedup", {}).get("decode_tokens_per_s"))]
        rows.append(row)
    return markdown_table(headers, rows)


def _times(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.2f}x"


def _throughput_table(metrics: list[dict]) -> str:
    headers = ["engine", "requests", "elapsed s", "requests/s", "output tok/s", "total tok/s"]
    rows = []
    for m in metrics:
        rows.append(["kiln", m["num_requests"], m["elapsed_s"], m["requests_per_s"],
                     m["output_tokens_per_s"], m["total_tokens_per_s"]])
        if "peer" in m:
            p = m["peer"]
            rows.append(["HF transformers", p["num_requests"], p["elapsed_s"],
                         p["requests_per_s"], p["output_tokens_per_s"], p["total_tokens_per_s"]])
            rows.append(["speedup (kiln / HF)", "", "",
                         f"{m['peer_speedup']['requests_per_s']:.2f}x",
                         f"{m['peer_speedup']['output_tokens_per_s']:.2f}x",
                         f"{m['peer_speedup']['total_tokens_per_s']:.2f}x"])
    return markdown_table(headers, rows)


def _pair(m: dict, key: str) -> str:
    return f"{fmt(stat(m[key], 'mean'))} / {fmt(stat(m[key], 'p99'))}"


def _serve_table(metrics: list[dict]) -> str:
    goodput = any("goodput_requests_per_s" in m for m in metrics)
    headers = ["request rate", "completed / failed", "requests/s", "output tok/s",
               "TTFT ms (mean / p99)", "TPOT ms (mean / p99)", "ITL ms (mean / p99)",
               "E2E ms (mean / p99)"] + (["goodput req/s"] if goodput else [])
    rows = []
    for m in metrics:
        rows.append([case_label(m["case"]), f"{m['num_completed']} / {m['num_failed']}",
                     m["requests_per_s"], m["output_tokens_per_s"], _pair(m, "ttft_ms"),
                     _pair(m, "tpot_ms"), _pair(m, "itl_ms"), _pair(m, "e2e_ms")]
                    + ([m.get("goodput_requests_per_s")] if goodput else []))
    return markdown_table(headers, rows)


def _gpu_table(metrics: list[dict]) -> str:
    """What the GPU did while each case was timed (kiln/bench/telemetry.py); "" for a result
    without telemetry (serve runs, older files)."""
    gpus = [(m, m["gpu"]) for m in metrics if "gpu" in m]
    if not gpus:
        return ""
    if not any(g["available"] for _, g in gpus):
        return f"\nGPU telemetry: none ({gpus[0][1]['reason']})\n"
    gpus = [(m, g) for m, g in gpus if g["available"]]
    headers = ["case", "energy J", "J / output token", "power W (limit)",
               "SM clock MHz mean / min (max)", "at power cap", "thermal slowdown"]
    rows = []
    for m, g in gpus:
        rows.append([
            case_label(m["case"]), g["energy_j"], fmt(g.get("joules_per_output_token"), 3),
            f"{g['mean_power_w']:,.0f} ({g['power_limit_w']:,.0f})",
            f"{g['mean_sm_clock_mhz']:,.0f} / {g['min_sm_clock_mhz']:,.0f} "
            f"({g['max_sm_clock_mhz']:,.0f})",
            f"{100 * g['power_capped_share']:.0f}%", f"{100 * g['thermal_share']:.0f}%"])
    every = gpus[0][1]["interval_s"]
    return f"\nGPU while timed (NVML, every {every:g} s):\n\n" + markdown_table(headers, rows)


def summary_markdown(result: dict[str, Any]) -> str:
    kind = result["kind"]
    body = {"latency": _latency_table, "throughput": _throughput_table,
            "serve": _serve_table}[kind](result["metrics"])
    md = header_md(result, TITLES[kind]) + body + _gpu_table(result["metrics"])
    if result.get("ceilings"):
        md += "\nceilings: " + ", ".join(f"{k}={v:,.0f}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in result["ceilings"].items()) + "\n"
    return md


def save_and_print(result: dict[str, Any], output_dir: Path,
                   summary_md: str | None = None) -> Path:
    """result.json, summary.md and plots into ``output_dir``; the summary to the terminal."""
    summary_md = summary_md or summary_markdown(result)
    path = write_result(result, output_dir, summary_md)
    write_plots(result, output_dir)
    console = Console()
    console.print(Markdown(summary_md))
    console.print(f"results in {output_dir}/ (result.json, summary.md, plots)")
    return path

"""``kiln profile``: trace N engine steps; per-kernel and per-launch-grid tables and a roofline."""

from __future__ import annotations

from typing import Any

import click

from kiln.cli_options import HELP_OPTIONS, engine_options, result_dir
from kiln.zoo import DEFAULT_MODEL


def nvtx_only_note(result: dict[str, Any]) -> str | None:
    """Why a --nvtx-only result has no kernel tables (None for a torch.profiler run)."""
    config = result["config"]
    if config["torch_profiler"]:
        return None
    if config["nvtx"]:
        return ("--nvtx-only: no torch.profiler, so no kernel tables here; the NVTX ranges "
                "(kiln.step N, kiln.forward ...) are in the report of the `nsys profile` this "
                "ran under")
    return ("--nvtx-only on CPU: NVTX ranges need a CUDA device, so only step times were "
            "recorded; drop --nvtx-only for torch.profiler's per-op tables")


def above_roof_note(rows: list[dict[str, Any]]) -> str | None:
    num = sum(1 for r in rows if r["above_roof"])
    if not num:
        return None
    return (f"{num} rows ran above the measured roof for their estimated FLOPs and bytes "
            "(cache-resident data beats the measured copy bandwidth, a larger GEMM the measured "
            "one, or the estimate overcounts): their % of roof is over 100")


def summary_markdown(result: dict[str, Any], top: int) -> str:
    from kiln.bench.result import fmt, header_md, markdown_table

    m = result["metrics"][0]
    roofs = result["ceilings"]
    md = header_md(result, "kiln profile")
    md += (f"step time: mean {fmt(m['step_ms']['mean'], 2)} ms, p50 {fmt(m['step_ms']['p50'], 2)}"
           f" ms over {m['case']['num_steps']} steps (batch {m['case']['batch_size']}, prompt "
           f"{m['case']['input_len']}, {m['case']['skip_steps']} steps skipped)\n\n")
    md += (f"ceilings: {roofs['bandwidth_gbps']:,.0f} GB/s ({roofs['bandwidth_source']}), "
           f"{roofs['compute_tflops']:,.2f} TFLOP/s ({roofs['compute_source']})\n\n")
    if m["phases"]:
        md += "## phases (per step)\n\n" + markdown_table(
            ["phase", "host ms", "device ms"],
            [[p, v["host_ms"], v["device_ms"]] for p, v in m["phases"].items()])
        md += "\n"
    note = nvtx_only_note(result)
    if note:
        return md + note + "\n"
    rows = m["kernels"][:top]
    md += (f"## top {len(rows)} of {len(m['kernels'])} kernels ({m['kernel_time_source']}; "
           f"{m['kernel_time_us'] / 1e3:,.2f} ms in all)\n\n")
    md += markdown_table(
        ["kernel / op", "shapes", "calls", "ms", "share %", "GFLOP", "MB", "TFLOP/s", "GB/s",
         "FLOP/B", "bound", "% of roof"],
        [[r["name"] if r["launched_by"] in (r["name"], "(no aten op)")
          else f"{r['name']} (in {r['launched_by']})",
          r["shapes"][:60] or "—", r["calls"], r["time_us"] / 1e3, 100 * r["share"],
          None if r["flops"] is None else r["flops"] / 1e9,
          None if r["bytes"] is None else r["bytes"] / 1e6,
          r["tflops"], r["gbps"], r["intensity"], r["bound"] or "—",
          None if r["roof_fraction"] is None else 100 * r["roof_fraction"]] for r in rows])
    note = above_roof_note(m["kernels"])
    if note:
        md += f"\n{note}\n"
    launches = m.get("launches") or []
    if launches:
        md += (f"\n## top {min(top, len(launches))} of {len(launches)} launch configurations "
               "(device kernels by grid and block: one row per layer shape of a shared kernel; "
               "\"ms\": their own durations, which overlap where a launch is programmatic "
               "(PDL); \"path ms\": their share of the stream's busy time)\n\n")
        md += markdown_table(
            ["kernel", "grid", "block", "calls", "path ms", "ms", "mean us"],
            [[r["name"], r["grid"], r["block"], r["calls"], r["path_us"] / 1e3,
              r["time_us"] / 1e3, r["mean_us"]] for r in launches[:top]])
    return md


def print_summary(result: dict[str, Any], top: int) -> None:
    """A terminal-width digest; summary.md has the full table."""
    from rich.console import Console
    from rich.table import Table

    from kiln.bench.result import fmt

    m = result["metrics"][0]
    console = Console()
    console.print(f"[bold]kiln profile[/] on {result['device']['name']}: step "
                  f"{fmt(m['step_ms']['mean'], 2)} ms mean over {m['case']['num_steps']} steps")
    if m["phases"]:
        console.print("phases (host ms / device ms per step): " + ", ".join(
            f"{p} {v['host_ms']:.2f}/{v['device_ms']:.2f}" for p, v in m["phases"].items()))
    note = nvtx_only_note(result)
    if note:
        console.print(note)
        return
    grid = Table("kernel / op", "shapes", "ms", "share %", "TFLOP/s", "GB/s", "bound")
    for r in m["kernels"][:top]:
        grid.add_row(r["name"][:48], r["shapes"][:28], fmt(r["time_us"] / 1e3, 2),
                     fmt(100 * r["share"]), fmt(r["tflops"], 3), fmt(r["gbps"]),
                     r["bound"] or "—")
    console.print(grid)


@click.command("profile", context_settings=HELP_OPTIONS)
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--input-len", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--num-steps", default=8, show_default=True, type=click.IntRange(min=1),
              help="engine steps recorded")
@click.option("--skip-steps", default=0, show_default=True, type=click.IntRange(min=0),
              help="steps run before recording (e.g. past the prefill, to see decode only)")
@click.option("--peak-gbps", type=click.FloatRange(min=0, min_open=True),
              help="bandwidth ceiling; measured (device copy) when not given")
@click.option("--peak-tflops", type=click.FloatRange(min=0, min_open=True),
              help="compute ceiling; measured (square GEMM) when not given")
@click.option("--top", default=25, show_default=True, type=click.IntRange(min=1),
              help="kernels listed in summary.md (result.json has all)")
@click.option("--nvtx-only", is_flag=True,
              help="NVTX ranges without torch.profiler, to run under `nsys profile` (CUDA; on "
                   "CPU it records step times only)")
@click.option("--output-dir", type=click.Path(file_okay=False),
              help="[default: out/bench/profile-<time>]")
@engine_options
def profile_command(model: str, batch_size: int, input_len: int, num_steps: int,
                    skip_steps: int, peak_gbps: float | None, peak_tflops: float | None,
                    top: int, nvtx_only: bool, output_dir: str | None,
                    engine_kwargs: dict[str, Any]) -> None:
    """Profile N engine steps: Chrome trace, per-kernel and per-launch-grid tables, roofline
    (NVTX on CUDA)."""
    from kiln.bench.result import write_result
    from kiln.profile.roofline import plot_roofline
    from kiln.profile.run import ProfileConfig, run_profile

    out = result_dir("profile", output_dir)
    cfg = ProfileConfig(model, batch_size, input_len, num_steps, skip_steps, peak_gbps,
                        peak_tflops, not nvtx_only, engine_kwargs)
    try:
        result = run_profile(cfg, out)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    written = [write_result(result, out, summary_markdown(result, top)), out / "summary.md"]
    if result["config"]["trace"]:
        written.append(out / result["config"]["trace"])
    if not nvtx_only:
        roofs = result["ceilings"]
        written.append(plot_roofline(result["metrics"][0]["kernels"], roofs["compute_tflops"],
                                     roofs["bandwidth_gbps"], out / "roofline.png",
                                     f"{result['device']['name']}, batch {batch_size}"))
    print_summary(result, min(top, 15))
    click.echo(f"results in {out}/ ({', '.join(p.name for p in written)})")

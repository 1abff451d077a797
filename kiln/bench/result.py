"""The result every ``kiln bench`` / ``kiln profile`` run writes (schema in benchmarks/README.md).

Top level: ``schema_version``, ``kind``, ``created``, ``device``, ``versions``, ``git_commit``,
``command``, ``config``, ``workload``, ``ceilings``, ``metrics`` (one entry per point of the run:
a latency case, a request rate ...; each names its point under ``case``) and ``requests``
(raw per-request timings, each with the index of its ``case``).
"""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Any

import torch

from kiln.bench.env import device_info, versions
from kiln.provenance import command_line, git_commit

SCHEMA_VERSION = 1
KINDS = ("latency", "throughput", "serve", "profile")


def default_output_dir(kind: str) -> Path:
    """out/bench/<kind>-<timestamp> (``out/`` is git-ignored)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("out") / "bench" / f"{kind}-{stamp}"


def make_result(kind: str, device: torch.device | str | dict[str, Any], config: dict[str, Any],
                workload: dict[str, Any] | None, metrics: list[dict[str, Any]],
                requests: list[dict[str, Any]], ceilings: dict[str, Any] | None = None,
                **extra: Any) -> dict[str, Any]:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; choose one of {', '.join(KINDS)}")
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device if isinstance(device, dict) else device_info(device),
        "versions": versions(),
        "git_commit": git_commit(),
        "command": command_line(),
        "config": config,
        "workload": workload,
        "ceilings": ceilings,
        "metrics": metrics,
        "requests": requests,
        **extra,
    }


def _clean(value: Any) -> Any:
    """JSON has no inf/nan: write them as strings so the file stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write_result(result: dict[str, Any], output_dir: Path, summary_md: str) -> Path:
    """result.json and summary.md into ``output_dir``; returns the JSON path."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "result.json"
    path.write_text(json.dumps(_clean(result), indent=1, allow_nan=False) + "\n")
    (output_dir / "summary.md").write_text(summary_md)
    return path


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:,.{digits}f}" if abs(value) < 1e6 else f"{value:.3g}"
    return str(value)


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) if not isinstance(v, str) else v for v in row) + " |"
              for row in rows]
    return "\n".join(lines) + "\n"


def header_md(result: dict[str, Any], title: str) -> str:
    dev, ver = result["device"], result["versions"]
    lines = [f"# {title}", "",
             f"- device: {dev.get('name')}",
             f"- versions: kiln {ver['kiln']}, torch {ver['torch']}, cuda {ver['cuda']}, "
             f"triton {ver['triton']}, transformers {ver['transformers']}",
             f"- commit: {result['git_commit'] or 'unknown'}",
             f"- command: `{result['command']}`",
             f"- created: {result['created']}"]
    if result.get("workload"):
        w = result["workload"]
        lines.append("- workload: " + ", ".join(f"{k}={v}" for k, v in w.items()
                                                 if v is not None))
    return "\n".join(lines) + "\n\n"


def stat(metric: dict[str, Any] | None, key: str) -> float | None:
    return None if metric is None else metric.get(key)

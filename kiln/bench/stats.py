"""The statistics every benchmark reports, with the definitions vLLM's benchmarks use.

Per request, from the time it was sent (or arrived at the engine):

- TTFT: time to the first output (token offline, streamed chunk over HTTP).
- TPOT: ``(e2e - ttft) / (output_tokens - 1)``, the mean time per output token after the first;
  undefined for a one-token output.
- ITL: every gap between two successive outputs (pooled over all requests); over HTTP a chunk
  may carry several tokens, so ITL is per chunk and TPOT per token.
- E2E: time to the last output.

Percentiles interpolate linearly between the closest ranks (numpy's default), so p50 is the
median. Goodput counts the requests that meet every SLO, per second of the run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

PERCENTILES = (50, 90, 99)
# SLO names on the command line (vLLM's "e2el" accepted as an alias) -> metric name
SLO_METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms", "e2el": "e2e_ms",
               "itl": "itl_ms"}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """mean, p50, p90, p99, min, max and count of the values that are not None."""
    kept = [float(v) for v in values if v is not None]
    if not kept:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}, "min": None, "max": None,
                "n": 0}
    return {"mean": float(np.mean(kept)),
            **{f"p{q}": percentile(kept, q) for q in PERCENTILES},
            "min": min(kept), "max": max(kept), "n": len(kept)}


@dataclass
class Latencies:
    """One request's latencies in milliseconds."""

    ttft_ms: float | None
    tpot_ms: float | None
    itl_ms: list[float]
    e2e_ms: float | None


def request_latencies(start: float, output_times: Sequence[float], end: float | None,
                      num_output_tokens: int | None) -> Latencies:
    """Latencies of one request from its timestamps (seconds, one clock).

    ``output_times`` are the moments outputs arrived (one per token offline, one per chunk
    over HTTP); ``end`` is when the request completed (the last output if None).
    """
    if not output_times:
        return Latencies(None, None, [], None if end is None else (end - start) * 1e3)
    end = output_times[-1] if end is None else end
    ttft = output_times[0] - start
    e2e = end - start
    tpot = ((e2e - ttft) / (num_output_tokens - 1)
            if num_output_tokens is not None and num_output_tokens > 1 else None)
    itl = [(b - a) * 1e3 for a, b in zip(output_times, output_times[1:], strict=False)]
    return Latencies(ttft * 1e3, None if tpot is None else tpot * 1e3, itl, e2e * 1e3)


def latency_metrics(records: Sequence[dict]) -> dict[str, dict]:
    """ttft_ms, tpot_ms, itl_ms and e2e_ms summaries over per-request records."""
    return {
        "ttft_ms": summarize(r["ttft_ms"] for r in records),
        "tpot_ms": summarize(r["tpot_ms"] for r in records),
        "itl_ms": summarize(x for r in records for x in r["itl_ms"]),
        "e2e_ms": summarize(r["e2e_ms"] for r in records),
    }


def parse_slos(items: Iterable[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft_ms": 500.0, "tpot_ms": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name.strip().lower() not in SLO_METRICS:
            raise ValueError(f"SLO {item!r} must look like NAME:MILLISECONDS with NAME one of "
                             f"{', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"SLO {item!r}: the limit must be a positive finite number")
        slos[SLO_METRICS[name.strip().lower()]] = ms
    return slos


def meets_slos(record: dict, slos: dict[str, float]) -> bool:
    """True when a successful request is within every SLO.

    A per-request metric that is undefined (TPOT of a one-token output, ITL with one chunk)
    cannot be violated; for ITL every gap must be within the limit.
    """
    if not record.get("ok", True):
        return False
    for metric, limit in slos.items():
        value = record.get(metric)
        if metric == "itl_ms":
            if any(gap > limit for gap in value or []):
                return False
        elif value is not None and value > limit:
            return False
    return True


def goodput(records: Sequence[dict], slos: dict[str, float], duration_s: float) -> float:
    """Requests per second that met every SLO."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    return sum(meets_slos(r, slos) for r in records) / duration_s

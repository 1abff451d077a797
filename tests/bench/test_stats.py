"""The statistics on inputs whose answers are known by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiln.bench.stats import (
    goodput,
    latency_metrics,
    meets_slos,
    parse_slos,
    percentile,
    request_latencies,
    summarize,
)


def test_percentile_interpolates_between_closest_ranks():
    values = [10.0, 20.0, 30.0, 40.0]  # ranks 0..3; q% sits at rank q/100 * 3
    assert percentile(values, 0) == 10.0
    assert percentile(values, 100) == 40.0
    assert percentile(values, 50) == pytest.approx(25.0)  # rank 1.5
    assert percentile(values, 90) == pytest.approx(37.0)  # rank 2.7 -> 30 + 0.7 * 10
    assert percentile(values, 99) == pytest.approx(39.7)  # rank 2.97
    assert percentile([5.0], 99) == 5.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # order does not matter


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50),
       st.floats(0, 100))
def test_percentile_is_bounded_and_monotone(values, q):
    p = percentile(values, q)
    assert min(values) - 1e-6 <= p <= max(values) + 1e-6
    assert percentile(values, min(q + 5, 100)) >= p - 1e-6


def test_summarize_one_to_hundred():
    s = summarize(range(1, 101))
    assert s["mean"] == 50.5
    assert s["p50"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)  # rank 89.1 -> 90 + 0.1
    assert s["p99"] == pytest.approx(99.01)
    assert (s["min"], s["max"], s["n"]) == (1, 100, 100)


def test_summarize_skips_none_and_handles_empty():
    assert summarize([None, 2.0, None, 4.0])["mean"] == 3.0
    empty = summarize([None])
    assert empty["n"] == 0 and empty["mean"] is None and empty["p99"] is None


def test_tpot_and_itl_definitions():
    # sent at 0; outputs at 0.1, 0.3, 0.6 s; done at 0.6 s; 4 tokens (one chunk held two)
    lat = request_latencies(0.0, [0.1, 0.3, 0.6], None, 4)
    assert lat.ttft_ms == pytest.approx(100.0)
    assert lat.e2e_ms == pytest.approx(600.0)
    # TPOT is per token after the first: (600 - 100) / (4 - 1)
    assert lat.tpot_ms == pytest.approx(500.0 / 3)
    # ITL is per output arrival: the gaps between chunks
    assert lat.itl_ms == pytest.approx([200.0, 300.0])


def test_one_token_has_no_tpot_and_no_output_has_no_ttft():
    lat = request_latencies(1.0, [1.25], 1.5, 1)
    assert lat.ttft_ms == pytest.approx(250.0) and lat.e2e_ms == pytest.approx(500.0)
    assert lat.tpot_ms is None and lat.itl_ms == []
    failed = request_latencies(1.0, [], 2.0, None)
    assert failed.ttft_ms is None and failed.e2e_ms == pytest.approx(1000.0)


def test_latency_metrics_pools_itl_over_requests():
    records = [{"ttft_ms": 10.0, "tpot_ms": 2.0, "itl_ms": [1.0, 3.0], "e2e_ms": 14.0},
               {"ttft_ms": 20.0, "tpot_ms": None, "itl_ms": [], "e2e_ms": 20.0}]
    m = latency_metrics(records)
    assert m["ttft_ms"]["mean"] == 15.0
    assert m["tpot_ms"]["n"] == 1  # the one-token request has no TPOT
    assert m["itl_ms"]["n"] == 2 and m["itl_ms"]["mean"] == 2.0


def test_parse_slos():
    assert parse_slos(["ttft:500", "TPOT:50", "e2el:2000"]) == {
        "ttft_ms": 500.0, "tpot_ms": 50.0, "e2e_ms": 2000.0}
    for bad in ("ttft", "latency:5", "ttft:fast", "tpot:-1", "e2e:inf"):
        with pytest.raises(ValueError):
            parse_slos([bad])


def test_goodput_counts_requests_meeting_every_slo():
    recs = [
        {"ok": True, "ttft_ms": 100.0, "tpot_ms": 10.0, "itl_ms": [9.0], "e2e_ms": 500.0},
        {"ok": True, "ttft_ms": 300.0, "tpot_ms": 10.0, "itl_ms": [9.0], "e2e_ms": 500.0},
        {"ok": True, "ttft_ms": 100.0, "tpot_ms": 60.0, "itl_ms": [9.0], "e2e_ms": 500.0},
        {"ok": True, "ttft_ms": 100.0, "tpot_ms": None, "itl_ms": [], "e2e_ms": 100.0},
        {"ok": False, "ttft_ms": None, "tpot_ms": None, "itl_ms": [], "e2e_ms": 5.0},
    ]
    slos = {"ttft_ms": 200.0, "tpot_ms": 50.0}
    assert [meets_slos(r, slos) for r in recs] == [True, False, False, True, False]
    assert goodput(recs, slos, 2.0) == pytest.approx(1.0)  # 2 good requests in 2 s
    assert not meets_slos({"ok": True, "itl_ms": [5.0, 80.0]}, {"itl_ms": 50.0})
    with pytest.raises(ValueError):
        goodput(recs, slos, 0.0)


def test_summary_matches_numpy_on_random_data():
    rng = np.random.default_rng(3)
    values = rng.exponential(20.0, 1000)
    s = summarize(values)
    assert s["p99"] == pytest.approx(np.percentile(values, 99))
    assert math.isclose(s["mean"], values.mean())

"""kiln bench serve against a real ``kiln serve`` subprocess on loopback.

The token counts the benchmark records (from the streamed ``usage``) are checked against three
independent sources: the prompts it sent, the lengths it asked for (ignore_eos), and the
server's own Prometheus counters of prefilled and generated tokens.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from kiln.cli import main

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _counter(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    match = re.search(rf"^kiln:{name}(?:_total)?\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"kiln:{name} missing from /metrics"
    return float(match.group(1))


@pytest.fixture(scope="module")
def kiln_server(tiny_llama, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli", "serve", "--model", str(tiny_llama),
             "--port", str(port), "--device", "cpu", "--dtype", "float32",
             "--num-kv-blocks", "128", "--no-access-log"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", proc, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_bench_serve_token_counts_match_server(kiln_server, tiny_llama, tmp_path):
    base_url, proc, log = kiln_server
    out = tmp_path / "serve"
    args = ["bench", "serve", "--base-url", base_url, "--model", str(tiny_llama),
            "--dataset-name", "random", "--num-prompts", "5", "--input-len", "8",
            "--output-len", "6", "--random-range-ratio", "0.5", "--request-rate", "20,inf",
            "--num-warmups", "0", "--goodput", "ttft:60000", "--ready-check-timeout-sec", "120",
            "--output-dir", str(out)]
    # wait for readiness through the bench itself before reading the counters
    ready = CliRunner().invoke(main, [*args[:6], "--num-prompts", "1", "--output-len", "1",
                                      "--num-warmups", "1", "--ready-check-timeout-sec", "120",
                                      "--output-dir", str(tmp_path / "ready")])
    assert ready.exit_code == 0, ready.output + (log.read_text() if proc.poll() else "")
    prompt_before = _counter(base_url, "prompt_tokens")
    gen_before = _counter(base_url, "generation_tokens")
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    r = json.loads((out / "result.json").read_text())
    assert r["kind"] == "serve" and len(r["metrics"]) == 2 and len(r["requests"]) == 10
    assert r["config"]["served_model"] == str(tiny_llama)
    for q in r["requests"]:
        assert q["ok"], q["error"]
        assert q["prompt_tokens"] == q["requested_prompt_tokens"]  # usage == ids we sent
        assert q["output_tokens"] == q["requested_output_tokens"]  # ignore_eos honoured
        assert 1 <= q["num_chunks"] <= q["output_tokens"]
        assert 0 < q["ttft_ms"] <= q["e2e_ms"]
    sent_prompt = sum(q["prompt_tokens"] for q in r["requests"])
    sent_output = sum(q["output_tokens"] for q in r["requests"])
    assert _counter(base_url, "prompt_tokens") - prompt_before == sent_prompt
    assert _counter(base_url, "generation_tokens") - gen_before == sent_output
    for m in r["metrics"]:
        assert m["num_completed"] == 5 and m["num_missing_usage"] == 0
        assert m["goodput_requests_per_s"] == pytest.approx(m["requests_per_s"])
    assert sum(m["total_output_tokens"] for m in r["metrics"]) == sent_output
    assert (out / "rate_sweep.png").exists() and (out / "latency_cdf.png").exists()

    # the same prompt, non-streaming: the server's usage agrees with what the bench recorded
    from kiln.bench.workload import WorkloadSpec, build_requests

    spec = WorkloadSpec(**{k: v for k, v in r["workload"].items()})
    first = build_requests(spec, vocab_size=320)[0]
    body = {"model": r["config"]["served_model"], "prompt": first.prompt,
            "max_tokens": first.output_len, "temperature": 0.0, "ignore_eos": True}
    usage = httpx.post(base_url + "/v1/completions", json=body, timeout=60).json()["usage"]
    assert usage["prompt_tokens"] == r["requests"][0]["prompt_tokens"]
    assert usage["completion_tokens"] == r["requests"][0]["output_tokens"]

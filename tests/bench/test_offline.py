"""kiln bench latency / throughput / workload on the tiny model, with the transformers peer."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kiln.cli import main

TOP_LEVEL = {"schema_version", "kind", "created", "device", "versions", "git_commit", "command",
             "config", "workload", "ceilings", "metrics", "requests"}
SUMMARY = {"mean", "p50", "p90", "p99", "min", "max", "n"}


def _run(args: list[str]) -> None:
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output + repr(res.exception)


def test_latency_grid_with_hf_peer(tiny_llama, tmp_path):
    out = tmp_path / "lat"
    _run(["bench", "latency", "--model", str(tiny_llama), "--device", "cpu",
          "--num-kv-blocks", "64", "--batch-size", "1,3", "--input-len", "6",
          "--output-len", "5", "--num-iters", "2", "--num-iters-warmup", "1", "--peer", "hf",
          "--bandwidth-gbps", "10", "--output-dir", str(out)])
    assert {"result.json", "summary.md", "latency_cdf.png", "decode.png"} <= {
        p.name for p in out.iterdir()}
    r = json.loads((out / "result.json").read_text())
    assert set(r) >= TOP_LEVEL and r["kind"] == "latency"
    assert r["ceilings"]["bandwidth_gbps"] == 10 and r["ceilings"]["bandwidth_source"] == "given"
    assert [m["case"]["batch_size"] for m in r["metrics"]] == [1, 3]
    assert len(r["requests"]) == 2 * (1 + 3)  # measured iterations only, not the warm-up
    for req in r["requests"]:
        assert req["ok"] and req["prompt_tokens"] == 6 and req["output_tokens"] == 5
        assert len(req["itl_ms"]) == 4 and len(req["output_times_s"]) == 5
        assert 0 < req["ttft_ms"] <= req["e2e_ms"]
        # TPOT is the mean gap after the first token, so it is the mean of the ITLs here
        assert req["tpot_ms"] == pytest.approx(sum(req["itl_ms"]) / 4, rel=1e-3)
    for m in r["metrics"]:
        b = m["case"]["batch_size"]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "latency_s"):
            assert set(m[key]) >= SUMMARY
        assert m["decode_tokens_per_s"] == pytest.approx(b / (m["tpot_ms"]["mean"] / 1e3))
        gbps = m["bytes_per_decode_step"] / (m["tpot_ms"]["mean"] / 1e3) / 1e9
        assert m["achieved_gbps"] == pytest.approx(gbps)
        assert m["bandwidth_utilization"] == pytest.approx(gbps / 10)
        peer = m["peer"]
        assert peer["decode_tokens_per_s"] > 0 and peer["ttft_ms"]["n"] == b
        assert m["peer_speedup"]["decode_tokens_per_s"] == pytest.approx(
            m["decode_tokens_per_s"] / peer["decode_tokens_per_s"])
    assert r["config"]["peer_engine"].startswith("hf-transformers")
    assert r["config"]["weight_bytes"] > 0
    assert r["config"]["scheduler"]["max_num_batched_tokens"] == 8192  # resolved: a CPU run
    assert "speedup vs HF" in (out / "summary.md").read_text()
    assert all(m["gpu"]["available"] is False for m in r["metrics"])


def test_throughput_from_jsonl_with_hf_peer(tiny_llama, tmp_path):
    data = tmp_path / "w.jsonl"
    _run(["bench", "workload", "--dataset-name", "random", "--num-prompts", "5",
          "--input-len", "8", "--output-len", "6", "--random-range-ratio", "0.5",
          "--vocab-size", "320", "--seed", "7", "--out", str(data)])
    lines = [json.loads(x) for x in data.read_text().splitlines()]
    assert len(lines) == 5 and all(max(x["prompt_token_ids"]) < 320 for x in lines)
    with data.open("a") as f:  # a text prompt too: the engine tokenizes and counts it
        f.write(json.dumps({"prompt": "The quick brown fox", "output_len": 3}) + "\n")
    out = tmp_path / "tp"
    _run(["bench", "throughput", "--model", str(tiny_llama), "--device", "cpu",
          "--num-kv-blocks", "64", "--dataset-name", "jsonl", "--dataset-path", str(data),
          "--num-prompts", "6", "--num-warmups", "1", "--peer", "hf", "--peer-batch-size", "3",
          "--output-dir", str(out)])
    r = json.loads((out / "result.json").read_text())
    assert set(r) >= TOP_LEVEL and r["kind"] == "throughput"
    assert r["workload"]["dataset_name"] == "jsonl"
    m = r["metrics"][0]
    reqs = r["requests"]
    assert len(reqs) == 6 and all(q["ok"] for q in reqs)
    assert [q["output_tokens"] for q in reqs] == [x["output_len"] for x in lines] + [3]
    assert [q["prompt_tokens"] for q in reqs[:5]] == [len(x["prompt_token_ids"]) for x in lines]
    assert m["total_output_tokens"] == sum(q["output_tokens"] for q in reqs)
    assert m["output_tokens_per_s"] == pytest.approx(m["total_output_tokens"] / m["elapsed_s"])
    assert m["total_tokens_per_s"] == pytest.approx(
        (m["total_input_tokens"] + m["total_output_tokens"]) / m["elapsed_s"])
    assert m["requests_per_s"] == pytest.approx(6 / m["elapsed_s"])
    assert m["peer"]["total_output_tokens"] == m["total_output_tokens"]
    assert m["peer"]["total_input_tokens"] == m["total_input_tokens"]  # same prompts
    assert m["peer_speedup"]["output_tokens_per_s"] > 0
    assert r["config"]["scheduler"]["max_num_seqs"] == 256  # the engine's, as resolved
    # a CPU run has no GPU counters: the result says so, and the summary names why
    assert m["gpu"] == {"available": False, "reason": "no GPU counters on a cpu device"}
    assert "GPU telemetry: none (no GPU counters on a cpu device)" in (
        out / "summary.md").read_text()


def test_canonical_workload_file_with_override(tiny_llama, tmp_path):
    spec = tmp_path / "w.json"
    spec.write_text(json.dumps({"dataset_name": "fixed", "num_prompts": 64, "input_len": 4,
                                "output_len": 3, "seed": 5}))
    out = tmp_path / "tp"
    _run(["bench", "throughput", "--model", str(tiny_llama), "--device", "cpu",
          "--num-kv-blocks", "64", "--workload", str(spec), "--num-prompts", "2",
          "--num-warmups", "0", "--output-dir", str(out)])
    r = json.loads((out / "result.json").read_text())
    assert r["workload"]["num_prompts"] == 2 and r["workload"]["seed"] == 5
    assert [q["output_tokens"] for q in r["requests"]] == [3, 3]


def test_bad_flags_are_clean_errors(tiny_llama):
    res = CliRunner().invoke(main, ["bench", "latency", "--batch-size", "1,x"])
    assert res.exit_code == 2 and "comma-separated" in res.output
    res = CliRunner().invoke(main, ["bench", "throughput", "--model", str(tiny_llama),
                                    "--device", "cpu", "--dataset-name", "jsonl"])
    assert res.exit_code != 0 and "dataset-path" in res.output


def test_requests_that_would_stop_short_of_their_output_are_refused(tiny_llama, tmp_path):
    """A prompt and output past max_model_len would stop early and the figures would cover
    fewer tokens than the case says: refused, with both numbers, and no directory written."""
    out = tmp_path / "short"
    res = CliRunner().invoke(main, [
        "bench", "throughput", "--model", str(tiny_llama), "--device", "cpu", "--dtype",
        "float32", "--max-model-len", "32", "--num-prompts", "2", "--input-len", "30",
        "--output-len", "8", "--output-dir", str(out)])
    assert res.exit_code == 1, res.output
    assert "30 prompt tokens and 8 to generate needs 38 tokens" in res.output
    assert "max_model_len=32" in res.output and not out.exists()


def test_an_output_dir_holding_a_run_is_refused_before_the_run(tmp_path, monkeypatch):
    """Its plots would stay beside the new result.json; refused before any model loads."""
    (tmp_path / "result.json").write_text("{}")
    monkeypatch.setattr("kiln.bench.throughput.run_throughput",
                        lambda cfg: pytest.fail("the run started"))
    res = CliRunner().invoke(main, ["bench", "throughput", "--output-dir", str(tmp_path)])
    assert res.exit_code == 2 and "already holds a run's results" in res.output, res.output


def test_a_bad_jsonl_dataset_fails_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr("kiln.bench.offline.build_llm",
                        lambda *args: pytest.fail("the model loaded"))
    data = tmp_path / "w.jsonl"
    for text, message in [("", "holds 0 prompts"), ("not json\n", "w.jsonl:1: not valid JSON")]:
        data.write_text(text)
        res = CliRunner().invoke(main, ["bench", "throughput", "--dataset-name", "jsonl",
                                        "--dataset-path", str(data), "--num-prompts", "1",
                                        "--output-dir", str(tmp_path / "tp")])
        assert res.exit_code == 2 and message in res.output, res.output


def test_bench_workload_errors_are_one_line_and_keep_the_dataset(tmp_path):
    data = tmp_path / "w.jsonl"
    res = CliRunner().invoke(main, ["bench", "workload", "--dataset-name", "jsonl",
                                    "--dataset-path", str(data), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and f"dataset file {data} does not exist" in res.output, res.output
    _run(["bench", "workload", "--num-prompts", "3", "--input-len", "4", "--out", str(data)])
    res = CliRunner().invoke(main, ["bench", "workload", "--dataset-name", "jsonl",
                                    "--dataset-path", str(data), "--num-prompts", "1",
                                    "--out", str(data)])
    assert res.exit_code == 2 and "is also the --dataset-path" in res.output, res.output
    assert len(data.read_text().splitlines()) == 3
    res = CliRunner().invoke(main, ["bench", "workload", "--dataset-name", "jsonl",
                                    "--dataset-path", str(data), "--num-prompts", "1",
                                    "--vocab-size", "11", "--out", str(tmp_path / "o")])
    assert res.exit_code == 1 and "outside the model's vocabulary of 11" in res.output
    assert not isinstance(res.exception, ValueError)  # a clean exit, not a traceback


def test_a_latency_case_past_the_context_fails_before_any_case_runs(tiny_llama, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setattr("kiln.bench.offline.run_requests",
                        lambda *args: pytest.fail("a case ran"))
    out = tmp_path / "lat"
    res = CliRunner().invoke(main, [
        "bench", "latency", "--model", str(tiny_llama), "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "32", "--batch-size", "1", "--input-len", "8,30", "--output-len", "4",
        "--bandwidth-gbps", "10", "--output-dir", str(out)])
    assert res.exit_code == 1, res.output
    assert "--input-len 30 + --output-len 4 needs 34 tokens" in res.output
    assert "max_model_len=32" in res.output and not out.exists()

"""``kiln bench latency | throughput | serve | workload``.

Flag names follow vLLM's benchmark scripts (``--num-prompts``, ``--input-len``,
``--dataset-name`` ...) so scripts carry over; every engine flag of ``kiln serve`` is accepted
by the offline modes too (``--seed`` seeds the engine and the workload).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from kiln.bench.workload import DATASET_NAMES, WorkloadSpec, build_requests
from kiln.cli_options import HELP_OPTIONS, engine_options, result_dir
from kiln.zoo import DEFAULT_MODEL


def _int_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        items = [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None
    if not items or any(v < 1 for v in items):
        raise click.BadParameter(f"{value!r}: give integers >= 1, comma-separated")
    return items


def _rate_list(ctx: click.Context, param: click.Parameter, value: str) -> list[float]:
    try:
        rates = [math.inf if v.strip() == "inf" else float(v) for v in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r}: give rates in requests/s (or inf), "
                                 f"comma-separated") from None
    if any(not r > 0 for r in rates):
        raise click.BadParameter(f"{value!r}: rates must be > 0")
    return rates


def workload_options(command: Any) -> Any:
    options = [
        click.option("--workload", "workload_file", type=click.Path(exists=True, dir_okay=False),
                     help="a canonical workload JSON (benchmarks/workloads/); flags given "
                          "explicitly override its fields"),
        click.option("--dataset-name", type=click.Choice(DATASET_NAMES), default="fixed",
                     show_default=True),
        click.option("--dataset-path", type=click.Path(dir_okay=False),
                     help="JSONL of prompts for --dataset-name jsonl"),
        click.option("--num-prompts", type=click.IntRange(min=1), default=16, show_default=True),
        click.option("--input-len", "--random-input-len", "input_len", type=click.IntRange(min=1),
                     default=128, show_default=True, help="prompt tokens (fixed / random)"),
        click.option("--output-len", "--random-output-len", "output_len",
                     type=click.IntRange(min=1), default=64, show_default=True),
        click.option("--random-range-ratio", type=click.FloatRange(0, 1, max_open=True),
                     default=0.0, show_default=True,
                     help="random: lengths uniform in [len*(1-r), len*(1+r)]"),
        click.option("--prefix-len", "--random-prefix-len", "prefix_len",
                     type=click.IntRange(min=0), default=0, show_default=True,
                     help="tokens every prompt opens with (a shared system prompt), before "
                          "its own --input-len"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def make_spec(seed: int | None, workload_file: str | None, dataset_name: str,
              dataset_path: str | None, num_prompts: int, input_len: int, output_len: int,
              random_range_ratio: float, prefix_len: int) -> WorkloadSpec:
    """The workload from flags, or from ``--workload FILE`` with explicit flags winning.

    ``seed`` is None when not given on the command line.
    """
    ctx = click.get_current_context()
    values = {"dataset_name": dataset_name, "dataset_path": dataset_path,
              "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
              "random_range_ratio": random_range_ratio, "prefix_len": prefix_len}
    try:
        if workload_file is None:
            spec = WorkloadSpec(**values, seed=seed or 0)
        else:
            given = {k: v for k, v in values.items()
                     if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
            if seed is not None:
                given["seed"] = seed
            spec = WorkloadSpec.from_file(workload_file, **given)
        if spec.dataset_name == "jsonl":
            # read now: a bad line or a short file fails here, not after the model has loaded
            # (the model's vocabulary bound is checked again once it is known)
            build_requests(spec)
    except (ValueError, FileNotFoundError) as exc:
        raise click.BadParameter(str(exc)) from None
    return spec


def _given_seed(seed: int) -> int | None:
    source = click.get_current_context().get_parameter_source("seed")
    return seed if source == ParameterSource.COMMANDLINE else None


output_dir_option = click.option("--output-dir", "--result-dir", "output_dir",
                                 type=click.Path(file_okay=False),
                                 help="where result.json, summary.md and plots go "
                                      "[default: out/bench/<kind>-<time>]")
peer_option = click.option("--peer", type=click.Choice(["none", "hf"]), default="none",
                           show_default=True,
                           help="hf: also run the workload through transformers generate")


@click.group("bench", context_settings=HELP_OPTIONS)
def bench_group() -> None:
    """Benchmarks: offline latency and throughput, and load against a serving endpoint."""


@bench_group.command("latency")
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--batch-size", "batch_sizes", default="1,8", show_default=True,
              callback=_int_list, help="comma-separated batch sizes")
@click.option("--input-len", "input_lens", default="128", show_default=True, callback=_int_list)
@click.option("--output-len", "output_lens", default="128", show_default=True,
              callback=_int_list)
@click.option("--num-iters", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--num-iters-warmup", default=1, show_default=True, type=click.IntRange(min=0))
@click.option("--bandwidth-gbps", type=click.FloatRange(min=0, min_open=True),
              help="the bandwidth ceiling; measured (device copy) when not given")
@peer_option
@click.option("--peer-num-iters", default=1, show_default=True, type=click.IntRange(min=1))
@output_dir_option
@engine_options
def latency_command(model: str, batch_sizes: list[int], input_lens: list[int],
                    output_lens: list[int], num_iters: int, num_iters_warmup: int,
                    bandwidth_gbps: float | None, peer: str, peer_num_iters: int,
                    output_dir: str | None, engine_kwargs: dict[str, Any]) -> None:
    """TTFT, per-token latency, decode tok/s and achieved GB/s for each batch x length case."""
    from kiln.bench.latency import LatencyConfig, run_latency
    from kiln.bench.report import save_and_print

    cfg = LatencyConfig(model, batch_sizes, input_lens, output_lens, num_iters,
                        num_iters_warmup, None if peer == "none" else peer, peer_num_iters,
                        bandwidth_gbps, engine_kwargs)
    out = result_dir("latency", output_dir)  # (checked before the run)
    save_and_print(_guard(run_latency, cfg), out)


@bench_group.command("throughput")
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@workload_options
@click.option("--num-warmups", default=4, show_default=True, type=click.IntRange(min=0),
              help="short requests run first, not counted")
@peer_option
@click.option("--peer-batch-size", type=click.IntRange(min=1),
              help="requests per transformers generate call [default: all]")
@output_dir_option
@engine_options
def throughput_command(model: str, num_warmups: int, peer: str,
                       peer_batch_size: int | None, output_dir: str | None,
                       engine_kwargs: dict[str, Any], **workload: Any) -> None:
    """Submit every request of a workload at once; output, total tok/s and requests/s."""
    from kiln.bench.report import save_and_print
    from kiln.bench.throughput import ThroughputConfig, run_throughput

    spec = make_spec(engine_kwargs.get("seed"), **workload)
    cfg = ThroughputConfig(model, spec, num_warmups, None if peer == "none" else peer,
                           peer_batch_size, engine_kwargs)
    out = result_dir("throughput", output_dir)  # (checked before the run)
    save_and_print(_guard(run_throughput, cfg), out)


@bench_group.command("serve")
@click.option("--base-url", default="http://127.0.0.1:8000", show_default=True,
              help="any OpenAI-compatible server (Kiln's or another engine's)")
@click.option("--endpoint", default="/v1/completions", show_default=True)
@click.option("--model", help="local checkpoint directory: its vocabulary bounds the random "
                              "token ids (the server's model name comes from /v1/models)")
@click.option("--served-model-name", help="the model name sent in each request")
@workload_options
@click.option("--request-rate", "request_rates", default="inf", show_default=True,
              callback=_rate_list, help="requests/s, comma-separated for a sweep; inf: all at "
                                        "once")
@click.option("--arrival", type=click.Choice(["poisson", "constant"]), default="poisson",
              show_default=True)
@click.option("--max-concurrency", type=click.IntRange(min=1),
              help="cap on requests in flight (with --request-rate inf: a fixed concurrency)")
@click.option("--num-warmups", default=1, show_default=True, type=click.IntRange(min=0))
@click.option("--goodput", "slos", multiple=True,
              help="SLOs in ms, e.g. ttft:500,tpot:50 (also e2el, itl); repeatable")
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True,
              help="send vLLM's ignore_eos so every request runs to --output-len")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--ready-check-timeout-sec", default=60.0, show_default=True, type=float)
@click.option("--request-timeout-sec", default=600.0, show_default=True, type=float)
@output_dir_option
def serve_command(base_url: str, endpoint: str, model: str | None,
                  served_model_name: str | None, request_rates: list[float], arrival: str,
                  max_concurrency: int | None, num_warmups: int, slos: tuple[str, ...],
                  ignore_eos: bool, seed: int, ready_check_timeout_sec: float,
                  request_timeout_sec: float, output_dir: str | None, **workload: Any) -> None:
    """Load a running server at a request rate (or a sweep of them); client-side latencies."""
    from kiln.bench.report import save_and_print
    from kiln.bench.serve import ServeConfig, run_serve
    from kiln.bench.stats import parse_slos

    spec = make_spec(_given_seed(seed), **workload)
    try:
        slo_ms = parse_slos(item for value in slos for item in value.split(",") if item)
        cfg = ServeConfig(base_url, spec, request_rates, arrival, max_concurrency, num_warmups,
                          served_model_name, endpoint, ignore_eos, slo_ms,
                          ready_check_timeout_sec, request_timeout_sec, _vocab_size(model))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    out = result_dir("serve", output_dir)  # (checked before the run)
    save_and_print(_guard(run_serve, cfg), out)


@bench_group.command("workload")
@workload_options
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--vocab-size", type=click.IntRange(min=11), help="bound the random token ids")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="JSONL to write: prompt_token_ids and output_len per line")
def workload_command(seed: int, vocab_size: int | None, out_path: str,
                     **workload: Any) -> None:
    """Write a workload's requests as token ids, to replay them on any engine."""
    from kiln.bench.workload import write_jsonl

    spec = make_spec(_given_seed(seed), **workload)
    if spec.dataset_name == "jsonl" and Path(out_path).resolve() == Path(
            str(spec.dataset_path)).resolve():
        raise click.BadParameter(f"{out_path} is also the --dataset-path: writing it would "
                                 "replace that dataset (and lose its lines past --num-prompts); "
                                 "choose another --out", param_hint="--out")
    requests = _guard(build_requests, spec, vocab_size)
    write_jsonl(requests, Path(out_path))
    click.echo(f"wrote {len(requests)} requests to {out_path}")


def _vocab_size(model: str | None) -> int | None:
    if model is None:
        return None
    from kiln.models.loader import read_json, resolve_model_path

    try:
        return int(read_json(resolve_model_path(model) / "config.json")["vocab_size"])
    except (ValueError, FileNotFoundError, KeyError, RuntimeError) as exc:
        raise click.BadParameter(f"--model {model}: {exc}") from None


def _guard(fn: Any, *args: Any) -> Any:
    """Turn expected failures (bad input, unreachable server) into a clean CLI error."""
    try:
        return fn(*args)
    except (ValueError, TypeError, FileNotFoundError, TimeoutError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None

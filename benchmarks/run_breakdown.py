"""Where a whole offline run's time goes, step by step and kernel by kernel.

    PYTHONPATH=. python3 benchmarks/run_breakdown.py --model benchmarks/workloads/llama-3.1-8b \
        --workload benchmarks/workloads/throughput-512x512x256.json --max-num-seqs 512 \
        --max-model-len 4096 [--kernels] [--output-dir DIR]

The workload runs as ``kiln bench throughput`` runs it (warm-up first, every request at once),
with every engine step bracketed by CUDA events on the stream it launches on. A step's device
time is its two events apart; the GPU idles between one step's end and the next one's start
(the host was late). Steps are grouped by what they ran (decode-only by batch size, prompt
chunks alone or beside decodes) and set against their floor at the measured ceilings:

- GEMMs (projections, MLP, LM head): max(FLOPs / compute ceiling, weight bytes / bandwidth);
- decode attention: the K/V bytes its queries read / bandwidth;
- prefill attention: causal FLOPs / the prefill kernel's rate (``--prefill-tflops``).

Norms, rotary, KV writes and sampling have no floor here: they are what the steps spend over.
``--kernels`` runs the workload once more under torch.profiler (device activity only) and sums
the device time of every kernel of the run by name, graph-replayed kernels included.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.bench import offline
from kiln.bench.env import ceilings
from kiln.bench.workload import WARMUP_SEED_OFFSET, WorkloadSpec, build_requests, derived_requests
from kiln.engine.scheduler import SchedulerOutput
from kiln.models.arch import ArchConfig

DECODE_BATCH_BUCKETS = (1, 8, 64, 128, 256, 384, 511, 512)
KERNEL_KINDS = (  # (kind, substrings of kernel names): the first match names a kernel's kind
    ("attention decode", ("_decode_kernel", "_decode_reduce")),
    ("attention prefill", ("_prefill_kernel",)),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "wint", "_wq_", "sm90_")),
    ("rms norm", ("_rms_norm",)),
    ("rotary + kv write", ("_rotary", "_rope", "_copy_heads")),
    ("silu-and-mul", ("silu",)),
    ("argmax", ("argmax",)),
)


@dataclass
class Step:
    decodes: int  # sequences adding one token
    decode_keys: int  # keys the decode queries attend to, summed
    prompt_tokens: int  # prompt-chunk tokens
    prompt_pairs: int  # causal (query, key) pairs of the prompt chunks
    samples: int  # rows that sample a token (LM head rows)
    host_ms: float  # Python time of execute(): launching the step
    start: Any
    end: Any

    @property
    def kind(self) -> str:
        if not self.prompt_tokens:
            bucket = next(b for b in DECODE_BATCH_BUCKETS if self.decodes <= b)
            return f"decode <= {bucket}"
        return "prompts + decodes" if self.decodes else "prompts"


def describe(out: SchedulerOutput, host_ms: float, start: Any, end: Any) -> Step:
    decodes = [item for item in out.scheduled if item.num_new_tokens == 1]
    prompts = [item for item in out.scheduled if item.num_new_tokens != 1]
    pairs = sum(n * item.start + n * (n + 1) // 2
                for item in prompts for n in [item.num_new_tokens])
    return Step(len(decodes), sum(item.start + 1 for item in decodes),
                sum(item.num_new_tokens for item in prompts), pairs,
                sum(1 for item in out.scheduled if item.samples), host_ms, start, end)


class StepClock:
    """Brackets ``runner.execute`` with timing events (or host clocks off CUDA)."""

    def __init__(self, runner: Any, on_cuda: bool) -> None:
        self.steps: list[Step] = []
        self.on_cuda = on_cuda
        self._execute = runner.execute
        runner.execute = self.execute

    def _mark(self) -> Any:
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def execute(self, out: SchedulerOutput, lookahead_ids: torch.Tensor | None = None,
                before_sampling: Callable[[], None] | None = None) -> Any:
        start = self._mark()
        host = time.perf_counter()
        result = self._execute(out, lookahead_ids, before_sampling)
        host_ms = (time.perf_counter() - host) * 1e3
        self.steps.append(describe(out, host_ms, start, self._mark()))
        return result

    def apart_ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.on_cuda else (b - a) * 1e3


def floors_ms(step: Step, arch: ArchConfig, elsize: int, roofs: dict[str, Any],
              prefill_tflops: float) -> dict[str, float]:
    h, layers = arch.hidden_size, arch.num_layers
    linear = layers * (h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h
                       + 3 * h * arch.intermediate_size)  # weights of the layers' GEMMs
    head = h * arch.vocab_size
    flops_per_ms, bytes_per_ms = roofs["compute_tflops"] * 1e9, roofs["bandwidth_gbps"] * 1e6
    tokens = step.decodes + step.prompt_tokens

    def gemm(rows: int, weights: int) -> float:
        return max(2 * rows * weights / flops_per_ms, weights * elsize / bytes_per_ms)

    kv_bytes_per_key = 2 * arch.kv_size * layers * elsize
    return {"gemm": gemm(tokens, linear), "lm head": gemm(step.samples, head),
            "attention decode": step.decode_keys * kv_bytes_per_key / bytes_per_ms,
            "attention prefill": (4 * arch.num_heads * arch.head_dim * layers * step.prompt_pairs
                                  / (prefill_tflops * 1e9))}


def step_table(clock: StepClock, arch: ArchConfig, elsize: int, roofs: dict[str, Any],
               prefill_tflops: float) -> dict[str, Any]:
    steps = clock.steps
    groups: dict[str, dict[str, float]] = {}
    for i, step in enumerate(steps):
        floors = floors_ms(step, arch, elsize, roofs, prefill_tflops)
        group = groups.setdefault(step.kind, dict.fromkeys(
            ["steps", "device_ms", "host_launch_ms", "idle_after_ms",
             *(f"floor {name} ms" for name in floors)], 0.0))
        group["steps"] += 1
        group["device_ms"] += clock.apart_ms(step.start, step.end)
        group["host_launch_ms"] += step.host_ms
        if i + 1 < len(steps):  # idle before the next step starts, charged to this one
            group["idle_after_ms"] += max(clock.apart_ms(step.end, steps[i + 1].start), 0.0)
        for name, ms in floors.items():
            group[f"floor {name} ms"] += ms
    rows = []
    for kind, group in sorted(groups.items()):
        floor = sum(v for k, v in group.items() if k.startswith("floor"))
        rows.append({"kind": kind, **group, "floor_ms": floor,
                     "device_over_floor": group["device_ms"] / floor if floor else None})
    total = {k: sum(r[k] for r in rows) for k in ("steps", "device_ms", "idle_after_ms",
                                                     "floor_ms", "host_launch_ms")}
    total["span_ms"] = clock.apart_ms(steps[0].start, steps[-1].end)
    return {"groups": rows, "total": total}


def kernel_table(events: list[Any], on_cuda: bool) -> list[dict[str, Any]]:
    """Device time per kernel name on CUDA; off it, self CPU time per op (a smoke test's)."""
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in events:
        if on_cuda and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        row = per_name[event.name]
        row[0] += 1
        row[1] += (event.time_range.elapsed_us() if on_cuda else event.self_cpu_time_total) / 1e3
    rows = [{"kernel": name, "kind": next((kind for kind, keys in KERNEL_KINDS
                                            if any(k in name for k in keys)), "other"),
             "calls": calls, "ms": ms} for name, (calls, ms) in per_name.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def print_report(steps: dict[str, Any], kernels: list[dict[str, Any]]) -> None:
    total = steps["total"]
    print(f"span {total['span_ms']:.0f} ms: {total['steps']:.0f} steps, device "
          f"{total['device_ms']:.0f} ms, idle between steps {total['idle_after_ms']:.0f} ms, "
          f"floor {total['floor_ms']:.0f} ms, host launch {total['host_launch_ms']:.0f} ms")
    print("| steps | n | device ms | idle after ms | floor ms | device / floor | gemm | lm head "
          "| attn decode | attn prefill |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in steps["groups"]:
        ratio = f"{r['device_over_floor']:.3f}" if r["device_over_floor"] else "-"
        print(f"| {r['kind']} | {r['steps']:.0f} | {r['device_ms']:.1f} | "
              f"{r['idle_after_ms']:.1f} | {r['floor_ms']:.1f} | {ratio} | "
              f"{r['floor gemm ms']:.1f} | {r['floor lm head ms']:.1f} | "
              f"{r['floor attention decode ms']:.1f} | {r['floor attention prefill ms']:.1f} |")
    if not kernels:
        return
    kinds: dict[str, float] = defaultdict(float)
    for r in kernels:
        kinds[r["kind"]] += r["ms"]
    print("\nkernel time by kind (ms): " + ", ".join(
        f"{k} {v:.0f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
    print("| kernel | kind | calls | ms | mean us |\n|---|---|---|---|---|")
    for r in kernels[:40]:
        print(f"| {r['kernel'][:90]} | {r['kind']} | {r['calls']} | {r['ms']:.1f} | "
              f"{r['ms'] * 1e3 / r['calls']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--kernels", action="store_true", help="a second, profiled run")
    parser.add_argument("--prefill-tflops", type=float, default=470.0,
                        help="prefill attention rate for its floor (gpu_kernels.py's d128 row)")
    parser.add_argument("--peak-gbps", type=float, default=None)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args()
    spec = WorkloadSpec(**{k: v for k, v in json.loads(args.workload.read_text()).items()
                           if k != "description"})
    kwargs = {"load_format": args.load_format, "max_num_seqs": args.max_num_seqs}
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    llm = offline.build_llm(args.model, kwargs)
    loaded = llm.engine.loaded
    on_cuda = loaded.device.type == "cuda"
    roofs = ceilings(loaded.device, args.peak_gbps, args.peak_tflops)
    vocab = loaded.arch.vocab_size
    offline.run_requests(llm, derived_requests(spec, vocab, WARMUP_SEED_OFFSET, 4, 16))
    requests = build_requests(spec, vocab)
    clock = StepClock(llm.engine.runner, on_cuda)
    offline.sync(loaded.device)
    t0 = time.monotonic()
    outs = offline.run_requests(llm, requests)
    offline.sync(loaded.device)
    elapsed = time.monotonic() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(outs)} requests, {tokens} output tokens in {elapsed:.3f} s: "
          f"{tokens / elapsed:.1f} output tok/s (ceilings: {roofs['bandwidth_gbps']:.0f} GB/s, "
          f"{roofs['compute_tflops']:.0f} TFLOP/s)")
    elsize = torch.empty((), dtype=loaded.dtype).element_size()
    steps = step_table(clock, loaded.arch, elsize, roofs, args.prefill_tflops)
    kernels: list[dict[str, Any]] = []
    if args.kernels:
        llm.engine.runner.execute = clock._execute  # the profiled run is not event-bracketed
        activities = [torch.profiler.ProfilerActivity.CUDA if on_cuda
                      else torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities) as prof:
            offline.run_requests(llm, build_requests(spec, vocab))
            offline.sync(loaded.device)
        kernels = kernel_table(list(prof.events()), on_cuda)
    print_report(steps, kernels)
    if args.output_dir:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / "breakdown.json").write_text(json.dumps(
            {"elapsed_s": elapsed, "output_tokens": tokens, "ceilings": roofs, "steps": steps,
             "kernels": kernels}, indent=1, default=str))


if __name__ == "__main__":
    main()

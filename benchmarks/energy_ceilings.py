"""Energy per unit of work on the GPU, each kind of work sustained long enough for the board's
power limit to act (issue 4: the 512 x 512/256 run sits at the 700 W cap, so its speed is its
energy budget divided by the energy its work needs).

    PYTHONPATH=. python3 benchmarks/energy_ceilings.py [--seconds 4] [--out energy.json]

Each case replays one operation back to back (ten calls a CUDA graph) for ``--seconds`` after a
warm-up, inside kiln.bench.telemetry's NVML sampling (the board's energy counter, power, SM clock):

- gemm_prefill: bf16 [16384, 4096] x [4096, 14336] (cuBLAS; a prefill step's MLP GEMMs);
- gemm_decode:  bf16 [512, 4096] x [4096, 28672] (cuBLAS; the gate_up GEMM of a batch-512 decode);
- decode_layer_bf16 / decode_layer_int4: one Llama-3.1-8B layer's four GEMMs at 512 rows as the
  engine calls them (qkv, o, gate_up with silu(gate) * up, down), bf16 weights through ``linear``
  or int4 g128 ones through ``wint_linear`` (issue 8: int4 against bf16 at batch 512);
- decode_attention: Kiln's split-KV decode kernel, 512 sequences of 640 tokens, 32 query heads
  over 8 KV heads of 128 (one layer of a batch-512 decode step of that workload);
- copy: a 1 GiB device-to-device copy (read + write counted; in the graph a memcpy node, which
  the copy engines run, not SM kernels);
- idle: the board doing nothing.

Printed per case: time per call, the rate (TFLOP/s, or GB/s of K/V read or of copy traffic),
mean power and SM clock, and the energy per unit (J per PFLOP, J per TB). A run's energy floor
is then the sum over its work of work x energy per unit (see benchmarks/results/README.md).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
from gpu_kernels import paged_problem  # benchmarks/ is the script's sys.path[0]

from kiln.bench.telemetry import GpuTelemetry
from kiln.kernels.attention_decode import paged_attention_decode_triton
from kiln.kernels.quant_gemm import linear, wint_linear
from kiln.quant.rtn import rtn_quantize

CALLS_PER_REPLAY = 10


def sustained(fn: Callable[[], object], seconds: float, device: torch.device) -> dict:
    """Replay ``fn`` back to back for ``seconds`` under NVML sampling: warmed up for 1 s, then
    captured ten calls to a CUDA graph, so that host launch time (~tens of us a Triton launch)
    cannot leave the GPU idle between short calls, as the engine's decode graphs do."""
    deadline = time.perf_counter() + 1.0
    while time.perf_counter() < deadline:
        fn()
        torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_REPLAY):
            fn()
    replays = 0
    with GpuTelemetry.of(device) as gpu:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(4):  # queue a few replays between host checks
                graph.replay()
            replays += 4
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
    calls = replays * CALLS_PER_REPLAY
    return {"calls": calls, "seconds": elapsed, "ms_per_call": elapsed / calls * 1e3,
            **gpu.summary(elapsed)}


def gemm_case(m: int, n: int, k: int, device: torch.device) -> tuple[Callable, float, str]:
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    return (lambda: x @ w.t()), 2 * m * n * k / 1e15, "PFLOP"


# one Llama-3.1-8B layer's projections (N, K, gated): qkv, o, gate_up, down
LAYER = ((6144, 4096, False), (4096, 4096, False), (28672, 4096, True), (4096, 14336, False))


def decode_layer_case(fmt: str, rows: int, device: torch.device) -> tuple[Callable, float, str]:
    calls = []
    for n, k, gated in LAYER:
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device) * 0.02
        if fmt == "bf16":
            w16 = w.to(torch.bfloat16)
            calls.append(lambda x=x, w16=w16, gated=gated: linear(x, w16, gated=gated))
        else:
            q4 = rtn_quantize(w, 4, 128, True, scale_dtype=torch.bfloat16)
            weight = (q4.qweight(), q4.scales.to(torch.bfloat16), None, 4, 128)
            calls.append(lambda x=x, weight=weight, gated=gated: wint_linear(x, *weight,
                                                                             gated=gated))
    flops = sum(2 * rows * n * k for n, k, _ in LAYER)
    return (lambda: [call() for call in calls]), flops / 1e15, "PFLOP"


def decode_attention_case(device: torch.device) -> tuple[Callable, float, str]:
    batch, ctx, heads, kv_heads, head_dim = 512, 640, 32, 8, 128
    args, scale = paged_problem([ctx] * batch, [1] * batch, heads, kv_heads, head_dim)
    return ((lambda: paged_attention_decode_triton(*args, scale)),
            2 * batch * ctx * kv_heads * head_dim * 2 / 1e12, "TB")  # K and V, read once


def copy_case(device: torch.device) -> tuple[Callable, float, str]:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * (1 << 30) / 1e12, "TB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--out", default=None, help="write the cases as JSON here")
    args = parser.parse_args()
    device = torch.device("cuda")
    cases = {
        "gemm_prefill": lambda: gemm_case(16384, 14336, 4096, device),
        "gemm_decode": lambda: gemm_case(512, 28672, 4096, device),
        "decode_layer_bf16": lambda: decode_layer_case("bf16", 512, device),
        "decode_layer_int4": lambda: decode_layer_case("int4", 512, device),
        "decode_attention": lambda: decode_attention_case(device),
        "copy": lambda: copy_case(device),
    }
    results = {}
    print("| case | ms / call | rate | power W | SM clock MHz | energy per unit |")
    print("|---|---|---|---|---|---|")
    for name, make in cases.items():
        fn, units, unit = make()
        r = sustained(fn, args.seconds, device)
        joules_per_call = r["energy_j"] / r["calls"]
        r.update(units_per_call=units, unit=unit, joules_per_unit=joules_per_call / units)
        rate = units / (r["ms_per_call"] * 1e-3)
        rate_text = f"{rate * 1e3:,.0f} TFLOP/s" if unit == "PFLOP" else f"{rate * 1e3:,.0f} GB/s"
        print(f"| {name} | {r['ms_per_call']:.3f} | {rate_text} | {r['mean_power_w']:.0f} | "
              f"{r['mean_sm_clock_mhz']:,.0f} | {r['joules_per_unit']:,.0f} J/{unit} |", flush=True)
        results[name] = r
        del fn
        torch.cuda.empty_cache()
    with GpuTelemetry.of(device) as gpu:
        time.sleep(args.seconds)
    results["idle"] = gpu.summary(args.seconds)
    print(f"| idle | | | {results['idle']['mean_power_w']:.0f} | "
          f"{results['idle']['mean_sm_clock_mhz']:,.0f} | |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""How much of a decode step's memory-bound work can hide under a prefill's compute-bound GEMMs
when the two run on two CUDA streams at once (issue 4: the 512 x 512/256 workload runs them one
after the other; shared/GPU.md's vLLM figure and the 10,800 tok/s target).

    PYTHONPATH=. python3 benchmarks/gpu_overlap.py --out $OUT/overlap.json

P: the GEMMs of `--layers` decoder layers of a `--prefill-tokens` prefill of the Llama-3.1-8B
shapes (cuBLAS, as the engine's prefill). D: `--layers` calls of Kiln's paged decode attention
over `--decode-batch` sequences of `--decode-ctx` tokens, optionally with the decode GEMMs of
those layers (`--decode-gemms`). Each is timed alone, then both launched together on two
streams (the decode one at normal or high priority); the saving is alone(P) + alone(D) -
together, as a share of alone(D): 100% would mean D ran entirely in P's shadow. `--carveout N`
runs P's GEMMs through cuBLASLt told to leave N SMs free (torch's experimental SM carveout),
so that D has SMs of its own. `--green N` splits the SMs instead (CUDA green contexts,
benchmarks/green_split.py): D on N of them, P on the others, alone, together on their two
streams and together in one CUDA graph (results/h100/sm_partition.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable

import torch
import triton
from gpu_kernels import paged_problem  # benchmarks/ is the script's sys.path[0]
from green_split import split

from kiln.kernels.attention_decode import paged_attention_decode_triton

HIDDEN, KV_HEADS, HEADS, HEAD_DIM, INTER = 4096, 8, 32, 128, 14336
# (in, out) features of one layer's GEMMs: qkv, o_proj, gate_up (merged), down_proj
LAYER_GEMMS = [(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), (HIDDEN, HIDDEN),
               (HIDDEN, 2 * INTER), (INTER, HIDDEN)]  # fmt: skip
DTYPE = torch.bfloat16


def gemm_work(tokens: int, layers: int) -> Callable[[], None]:
    """A closure that runs `layers` layers' GEMMs on `tokens` rows (one weight set, reused: at
    these sizes the GEMMs are compute-bound, so L2 reuse of the weights changes little)."""
    weights = [torch.randn(n, k, device="cuda", dtype=DTYPE) * k**-0.5 for k, n in LAYER_GEMMS]
    xs = [torch.randn(tokens, k, device="cuda", dtype=DTYPE) for k, _ in LAYER_GEMMS]

    def run() -> None:
        for _ in range(layers):
            for x, w in zip(xs, weights, strict=True):
                torch.matmul(x, w.t())

    return run


def decode_work(batch: int, ctx: int, layers: int, with_gemms: bool) -> Callable[[], None]:
    """`layers` decode attention calls, each over its own pages (no L2 reuse between them)."""
    problems = [paged_problem([ctx] * batch, [1] * batch, HEADS, KV_HEADS, HEAD_DIM)
                for _ in range(layers)]  # fmt: skip
    gemms = gemm_work(batch, 1) if with_gemms else None

    def run() -> None:
        for args, scale in problems:
            paged_attention_decode_triton(*args, scale)
            if gemms is not None:
                gemms()

    return run


def time_ms(launch: Callable[[], None], reps: int = 5) -> float:
    """Median wall time of `launch` (which may use several streams) from the current stream's
    point of view: every stream it uses joins the current one before the end event."""
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])  # the first run warms up


def on_stream(work: Callable[[], None], stream: torch.cuda.Stream) -> Callable[[], None]:
    """`work` launched on `stream`, which joins the current one before and after."""
    main = torch.cuda.current_stream()

    def launch() -> None:
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            work()
        main.wait_stream(stream)

    return launch


def together(prefill: Callable[[], None], decode: Callable[[], None], priority: int,
             streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
             ) -> Callable[[], None]:
    """Both launched at once, each on its own stream (the decode one at `priority`), or on
    `streams` (P's, D's)."""
    side_p, side_d = streams or (torch.cuda.Stream(), torch.cuda.Stream(priority=priority))

    def launch() -> None:
        main = torch.cuda.current_stream()  # (a graph's capture stream inside graphed)
        for s in (side_p, side_d):
            s.wait_stream(main)
        with torch.cuda.stream(side_p):
            prefill()
        with torch.cuda.stream(side_d):
            decode()
        for s in (side_p, side_d):
            main.wait_stream(s)

    return launch


def graphed(launch: Callable[[], None]) -> Callable[[], None]:
    """`launch` captured once into a CUDA graph (its streams forked and joined inside), then
    replayed."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        launch()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--decode-batch", type=int, default=256)
    parser.add_argument("--decode-ctx", type=int, default=640)
    parser.add_argument("--decode-gemms", action="store_true")
    parser.add_argument("--carveout", type=int, default=0, help="SMs P's GEMMs leave free")
    parser.add_argument("--green", type=int, default=0,
                        help="D on a green context of this many SMs, P on one of the others")
    args = parser.parse_args()
    if args.carveout:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(args.carveout)
    prefill = gemm_work(args.prefill_tokens, args.layers)
    decode = decode_work(args.decode_batch, args.decode_ctx, args.layers, args.decode_gemms)
    streams = None
    if args.green:
        d_stream, d_sms, p_stream, p_sms = split(args.green)
        streams = (p_stream, d_stream)
    p_ms = time_ms(on_stream(prefill, streams[0]) if streams else prefill)
    d_ms = time_ms(on_stream(decode, streams[1]) if streams else decode)
    kv_gb = 2 * args.decode_batch * args.decode_ctx * KV_HEADS * HEAD_DIM * 2 * args.layers / 1e9
    flop = 2 * args.prefill_tokens * sum(k * n for k, n in LAYER_GEMMS) * args.layers
    report = {"config": vars(args), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__,
              "commit": os.environ.get("KILN_GIT_COMMIT", "unknown"), "prefill_ms": p_ms,
              "decode_ms": d_ms, "prefill_tflop_s": flop / p_ms / 1e9}
    if streams:
        report.update(prefill_sms=p_sms, decode_sms=d_sms)
    if not args.decode_gemms:  # D is the attention alone: its rate over the K/V it reads
        report["decode_kv_gb_s"] = kv_gb / d_ms * 1e3
    _, high = torch.cuda.Stream.priority_range()  # (lowest, highest)
    runs = [("same_priority", together(prefill, decode, 0, streams))]
    if streams:  # (a green context's stream has its own priority)
        runs.append(("one_graph", graphed(runs[0][1])))
    else:
        runs.append(("decode_high_priority", together(prefill, decode, high)))
    for name, launch in runs:
        both = time_ms(launch)
        report[name] = {"together_ms": both, "saved_ms": p_ms + d_ms - both,
                        "saved_share_of_decode": (p_ms + d_ms - both) / d_ms}
    print(json.dumps(report, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

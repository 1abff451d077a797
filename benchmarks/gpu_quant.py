"""Check and time Kiln's quantized GEMMs at the Llama-3.1-8B shapes; JSON out, table last.

    PYTHONPATH=. python3 benchmarks/gpu_quant.py --out $OUT/quant.json [--sweep small|full|none]
                                                 [--pytest]

1. checks: each path (fused Triton, dequantize + cuBLAS, the dispatching wrapper, W8A8 through
   torch._scaled_mm / torch._int_mm, the Triton activation quantizer) against float64 math on the
   dequantized weights, fresh random inputs, every shape and M;
2. timings: bf16 cuBLAS vs W8A16 / W4A16 g128 (fused and dequantize + cuBLAS) vs FP8 W8A8 (and
   FP8 weights through the weight-only GEMV) vs INT8 W8A8, for M = 1, 16, 64, 256. Each op is
   captured in a CUDA graph that cycles through enough weight copies to defeat the 50 MB L2, so
   the time is what a decode step inside the engine's graphs would see;
3. sweep: tile configurations of the fused kernel per (bits, M) at two shapes; the best ones
   are what kiln/kernels/quant_gemm._default_config should pick.

GB/s counts the weight bytes read (packed codes + scales + zeros) plus activations in and out;
the W4A16 GEMV target is >= 70% of the 2831 GB/s copy bandwidth (shared/GPU.md).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import subprocess
import sys
import time
import traceback

if "--smoke" in sys.argv:  # must precede the @triton.jit decorators
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from kiln.kernels import quant_gemm as qg  # noqa: E402
from kiln.quant import w8a8  # noqa: E402
from kiln.quant.rtn import rtn_quantize  # noqa: E402

COPY_GBPS = 2831.0
SHAPES = [(6144, 4096, "qkv"), (4096, 4096, "o_proj"), (28672, 4096, "gate_up (merged)"),
          (14336, 4096, "gate or up"), (4096, 14336, "down_proj")]
MS = [1, 16, 64, 256]
DTYPE = torch.bfloat16
L2_BYTES = 50 * 2**20
DEVICE = "cuda"
SMOKE = False  # --smoke: tiny shapes on CPU under TRITON_INTERPRET=1, to check this script


def time_graph_us(make_fn, bytes_per_call: int, reps: int = 20) -> float:
    """Median-free simple mean over graph replays of ops on rotating weight copies (µs/op)."""
    copies = max(1, min(8, math.ceil(4 * L2_BYTES / max(bytes_per_call, 1))))
    if SMOKE:
        fn = make_fn(0)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    fns = [make_fn(i) for i in range(copies)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns * 2:  # compile and warm up outside the capture
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for f in fns:
                f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps * copies)


def rotating(tensors, make):
    """make_fn(i) for time_graph_us: copy i > 0 works on fresh clones of the weight tensors."""
    def make_fn(i):
        args = tensors if i == 0 else [t.clone() if isinstance(t, torch.Tensor) else t
                                       for t in tensors]
        return make(args)
    return make_fn


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


class Formats:
    """The quantized copies of one dense weight [N, K], built on the GPU."""

    def __init__(self, n: int, k: int, seed: int) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        dense = torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5
        self.bf16 = dense.to(DTYPE)
        q8 = rtn_quantize(dense, 8, -1, True, scale_dtype=DTYPE)
        q4 = rtn_quantize(dense, 4, 128, True, scale_dtype=DTYPE)
        self.w8 = (q8.qweight(), q8.scales.to(DTYPE), None, 8, -1)
        self.w4 = (q4.qweight(), q4.scales.to(DTYPE), None, 4, 128)
        self.fp8 = w8a8.quantize_weight(dense, "fp8", "channel")
        self.int8 = w8a8.quantize_weight(dense, "int8", "channel")

    @staticmethod
    def nbytes(*tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def checks(results: list[dict]) -> None:
    for (n, k, name), m in itertools.product(SHAPES, MS):
        check_one(results, n, k, m)
        print(f"checked {name} {n}x{k} m={m}", flush=True)


def check_one(results: list[dict], n: int, k: int, m: int) -> None:
    f = Formats(n, k, seed=n + k + m)
    x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
    for label, args in (("w8a16", f.w8), ("w4a16-g128", f.w4)):
        w64 = qg.wint_dequant_ref(*args, torch.float64).double()
        ref = x.double() @ w64.t()
        paths = {"wrapper": lambda a=args: qg.wint_linear(x, *a),
                 "fused": lambda a=args: qg.wint_gemm_triton(x, *a),
                 "dequant+cublas": lambda a=args: x @ qg.wint_dequant_triton(*a, DTYPE).t()}
        for path, fn in paths.items():
            err = rel_err(fn(), ref)
            results.append(dict(check=label, path=path, n=n, k=k, m=m, rel_err=err,
                                ok=err < 1e-2))
    for kind in ("fp8", "int8"):
        wq, ws = getattr(f, kind)
        ref = w8a8.w8a8_linear_ref(x.float(), wq, ws, kind).double()
        err = rel_err(w8a8.w8a8_linear(x, wq, ws, kind), ref)
        results.append(dict(check=f"{kind}-w8a8", path="cublas", n=n, k=k, m=m,
                            rel_err=err, ok=err < 2e-2))
        q, s = w8a8.quant_per_token_triton(x, kind)
        q_ref, s_ref = w8a8.quant_per_token_ref(x, kind)
        same = (q.float() == q_ref.float()).float().mean().item()
        results.append(dict(check=f"{kind}-act-quant", path="triton", n=n, k=k, m=m,
                            rel_err=rel_err(s, s_ref), ok=same > 0.999, codes_equal=same))
    wq, ws = f.fp8
    err = rel_err(qg.wint_gemm_triton(x, wq, ws[:, None], None, 8, -1),
                  x.double() @ (wq.double() * ws.double()[:, None]).t())
    results.append(dict(check="fp8-weight-only", path="fused", n=n, k=k, m=m, rel_err=err,
                        ok=err < 1e-2))


def timings(results: list[dict]) -> None:
    for (n, k, name), m in itertools.product(SHAPES, MS):
        time_one(results, n, k, m)
        print(f"timed {name} {n}x{k} m={m}", flush=True)


def time_one(results: list[dict], n: int, k: int, m: int) -> None:
    f = Formats(n, k, seed=1)
    act = 2 * m * (n + k)  # bf16 x in, y out
    x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
    ops = {"bf16 cublas": ((f.bf16,), lambda a: lambda: torch.matmul(x, a[0].t()))}
    for label, args in (("w8a16", f.w8), ("w4a16-g128", f.w4)):
        ops[f"{label} fused"] = (args, lambda a: lambda: qg.wint_gemm_triton(x, *a))
        ops[f"{label} dequant+cublas"] = (
            args, lambda a: lambda: x @ qg.wint_dequant_triton(*a, DTYPE).t())
    wq, ws = f.fp8
    ops["fp8-w8a8 scaled_mm"] = ((wq, ws), lambda a: lambda: w8a8.w8a8_linear(x, *a, "fp8"))
    ops["fp8 weight-only fused"] = ((wq, ws[:, None].contiguous()), lambda a: lambda:
                                    qg.wint_gemm_triton(x, a[0], a[1], None, 8, -1))
    ops["int8-w8a8 int_mm"] = (f.int8, lambda a: lambda: w8a8.w8a8_linear(x, *a, "int8"))
    for label, (tensors, make) in ops.items():
        wbytes = Formats.nbytes(*tensors)
        try:
            us = time_graph_us(rotating(tensors, make), wbytes)
        except Exception as exc:  # record and go on: one failing path must not hide others
            results.append(dict(op=label, n=n, k=k, m=m, error=repr(exc)[:300]))
            continue
        gbps = (wbytes + act) / (us * 1e-6) / 1e9
        results.append(dict(op=label, n=n, k=k, m=m, us=us, weight_bytes=wbytes, gb_s=gbps,
                            copy_ratio=gbps / COPY_GBPS, tflop_s=2 * m * n * k / us / 1e6))


SWEEPS = {
    "small": {1: dict(bm=[1], bn=[16, 32, 64], bk=[128, 256, 512], split=[1, 4], warps=[4],
                      stages=[3]),
              16: dict(bm=[16], bn=[32, 64, 128], bk=[128, 256], split=[1, 4], warps=[4],
                       stages=[3]),
              64: dict(bm=[32, 64], bn=[64, 128], bk=[64, 128], split=[1], warps=[4, 8],
                       stages=[3]),
              256: dict(bm=[64, 128], bn=[128], bk=[64, 128], split=[1], warps=[4, 8],
                        stages=[3, 4])},
}
SWEEPS["full"] = {m: {**g, "split": sorted({*g["split"], 2, 8}) if m <= 16 else [1, 2],
                      "warps": [4, 8], "stages": [2, 3, 4]} for m, g in SWEEPS["small"].items()}


def sweep(results: list[dict], grid: dict) -> None:
    shapes = [(n, k) for n, k, _ in SHAPES[:1]] if SMOKE else [(4096, 4096), (28672, 4096)]
    for (n, k), m, bits in itertools.product(shapes, MS, (4, 8)):
        best = sweep_one(results, grid[m], n, k, m, bits)
        print(f"swept bits={bits} {n}x{k} m={m}: best {best}", flush=True)


def sweep_one(results: list[dict], g: dict, n: int, k: int, m: int, bits: int):
    f = Formats(n, k, seed=2)
    args = f.w4 if bits == 4 else f.w8
    wbytes = Formats.nbytes(*args)
    x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
    best = None
    for bm, bn, bk, split, warps, stages in itertools.product(
            g["bm"], g["bn"], g["bk"], g["split"], g["warps"], g["stages"]):
        cfg = qg.GemmConfig(bm, bn, bk, split, warps, stages)
        make = lambda a, c=cfg: lambda: qg.wint_gemm_triton(x, *a, config=c)
        try:
            us = time_graph_us(rotating(args, make), wbytes)
        except Exception:  # out of shared memory / registers: not a candidate
            continue
        if best is None or us < best[0]:
            best = (us, cfg)
    default_cfg = qg._default_config(m, n, k, bits, x.device)
    default_us = time_graph_us(rotating(args, lambda a: lambda: qg.wint_gemm_triton(x, *a)),
                               wbytes)
    results.append(dict(bits=bits, n=n, k=k, m=m, best_us=best and best[0],
                        best_config=best and best[1].__dict__, default_us=default_us,
                        default_config=default_cfg.__dict__))
    return best


def table(report: dict) -> None:
    rows = {}
    for r in report["timings"]:
        if "us" in r:
            rows.setdefault((r["n"], r["k"], r["m"]), {})[r["op"]] = r
    ops = list(dict.fromkeys(r["op"] for r in report["timings"] if "us" in r))
    print("\nµs per GEMM (GB/s on the weights + activations)")
    print("N x K, M".ljust(18) + "".join(o[:22].rjust(24) for o in ops))
    for (n, k, m), cols in rows.items():
        cells = [f"{cols[o]['us']:8.1f} ({cols[o]['gb_s']:5.0f})" if o in cols else "-"
                 for o in ops]
        print(f"{n}x{k}, {m}".ljust(18) + "".join(c.rjust(24) for c in cells))
    bad = [c for c in report["checks"] if not c["ok"]]
    print(f"\nchecks: {len(report['checks']) - len(bad)}/{len(report['checks'])} ok")
    for c in bad:
        print("  FAIL", c)
    gemv = [r for r in report["timings"] if r.get("op") == "w4a16-g128 fused" and r["m"] == 1]
    for r in gemv:
        print(f"W4A16 GEMV {r['n']}x{r['k']}: {r['gb_s']:.0f} GB/s = "
              f"{100 * r['copy_ratio']:.0f}% of copy bandwidth (target >= 70%)")


SMOKE_HELP = "check this script on CPU: TRITON_INTERPRET=1, tiny shapes, no CUDA graphs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", choices=["none", "small", "full"], default="small")
    parser.add_argument("--pytest", action="store_true", help="also run pytest -m gpu on quant")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    if args.smoke:
        global SMOKE, DEVICE, SHAPES, MS, DTYPE
        SMOKE, DEVICE, SHAPES, MS = True, "cpu", [(64, 256, "tiny"), (32, 512, "tiny-k")], [1, 3]
        DTYPE = torch.float16  # the interpreter computes bf16 wrongly (shared/GPU.md)
        for grid in SWEEPS.values():
            grid[3] = grid[16]
    elif not torch.cuda.is_available():
        sys.exit("gpu_quant.py needs a CUDA GPU (or --smoke)")
    device = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()
    report = {"device": device, "torch": torch.__version__,
              "triton": triton.__version__, "command": " ".join(sys.argv),
              "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
              "checks": [], "timings": [], "sweep": []}
    stages = [("checks", checks), ("timings", timings)]
    if args.sweep != "none":
        stages.append(("sweep", lambda res: sweep(res, SWEEPS[args.sweep])))
    for key, fn in stages:
        try:
            fn(report[key])
        except Exception:
            report.setdefault("errors", []).append(traceback.format_exc())
            traceback.print_exc()
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:  # after every stage: a timeout keeps what was done
            json.dump(report, fh, indent=1)
    if args.pytest:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q",
                               "tests/kernels/test_quant_gemm.py"], capture_output=True, text=True)
        report["pytest"] = {"rc": proc.returncode, "tail": proc.stdout[-3000:]}
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    table(report)


if __name__ == "__main__":
    main()

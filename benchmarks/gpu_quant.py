"""Check and time Kiln's quantized GEMMs at the Llama-3.1-8B shapes; JSON out, table last.

    PYTHONPATH=. python3 benchmarks/gpu_quant.py --out $OUT/quant.json
        [--sweep small|next|full|decode1|none] [--only-sweep] [--ms 1,16] [--check-ms 1,3,16]
        [--pytest] [--budget SECONDS] [--asm DIR]

1. checks: each path (the dispatching wrapper, the fused kernels, dequantize + cuBLAS, W8A8
   through torch._scaled_mm / torch._int_mm, the Triton activation quantizer, FP8 weights
   through the weight-only kernels) against float64 math on the dequantized weights, fresh
   random inputs, every shape and M;
2. timings: bf16 cuBLAS vs W8A16 / W4A16 g128 (fused and dequantize + cuBLAS) vs FP8 W8A8 (and
   FP8 weights through the weight-only kernels) vs INT8 W8A8, for M = 1, 16, 64, 256. Each op
   is captured in a CUDA graph that cycles through enough weight copies to defeat the 50 MB
   L2, so the time is what a decode step inside the engine's graphs would see;
3. sweep: configurations of the small-M kernels (kiln/kernels/quant_gemm.GemvConfig: the
   CUDA-core GEMV, the tensor-core word kernel; GemmConfig: the tile kernel) at M = 1..16,
   each checked against float64 and timed next to the current default ("default" rows); the
   best ones are what quant_gemm._gemv_config should pick. The tensor-core weight-only GEMM's
   tiles (kiln/kernels/wint_mma.MmaTiles) have their own sweep: benchmarks/wint_mma_sweep.py.

A GEMM timed here runs in a graph of itself. For 8-bit codes that disagreed with the same
kernels inside the engine's step by up to 25% and ranked two split counts the other way round
(benchmarks/results/h100/wint_mma_tiles.txt, 7.-9.): confirm a choice with ``kiln profile``
(its launch-grid table) and an end-to-end A/B before making it a default.

GB/s counts the weight bytes read (packed codes + scales + zeros) plus activations in and out;
the W4A16 GEMV target is >= 70% of the 2831 GB/s copy bandwidth (shared/GPU.md). At M = 1 the
timings include a load-only kernel that reads what the int4 GEMV reads, at its tiles, and does
nothing with it: the floor of that kernel's structure at each shape. ``--budget``
stops the sweep when the whole run has used that many seconds (the JSON is written after every
stage); ``--asm DIR`` copies the Triton cache entries of the small-M kernels (TTGIR, PTX,
cubin) there as one tarball, for reading their SASS off the device.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import itertools
import json
import math
import os
import subprocess
import sys
import tarfile
import time
import traceback

if "--smoke" in sys.argv:  # must precede the @triton.jit decorators
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from kiln.kernels import quant_gemm as qg  # noqa: E402
from kiln.kernels._triton import pdl, tl, wait_for_inputs  # noqa: E402
from kiln.quant import w8a8  # noqa: E402
from kiln.quant.rtn import rtn_quantize  # noqa: E402

COPY_GBPS = 2831.0
SHAPES = [(6144, 4096, "qkv"), (4096, 4096, "o_proj"), (28672, 4096, "gate_up (merged)"),
          (14336, 4096, "gate or up"), (4096, 14336, "down_proj")]
MS = [1, 16, 64, 256]
CHECK_MS = [1, 3, 16, 64, 256]
DTYPE = torch.bfloat16
L2_BYTES = 50 * 2**20
DEVICE = "cuda"
SMOKE = False  # --smoke: tiny shapes on CPU under TRITON_INTERPRET=1, to check this script
START = time.time()


def time_graph_us(make_fn, bytes_per_call: int, reps: int = 20) -> float:
    """Mean over graph replays of ops on rotating weight copies (µs/op)."""
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


@triton.jit
def _load_only_kernel(w_ptr, s_ptr, out_ptr, N, KW, stride_wn, stride_sn, WPG: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, EVEN_K: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """The int4 GEMV's reads and nothing else: the words of its tiles (the next one loaded
    before the current is used, the first before the PDL wait, as the GEMV does) and the group
    scales, folded with one XOR / add per value into a row result so none is dropped."""
    BLOCK_C: tl.constexpr = BLOCK_KW // 4
    offs_w = tl.arange(0, BLOCK_KW)
    offs_c = tl.arange(0, BLOCK_C) * 4
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    bits = tl.zeros([BLOCK_N, BLOCK_KW], tl.int32)
    sums = tl.zeros([BLOCK_N, BLOCK_C], tl.float32)
    packed = qg._load_words(w_rows, offs_w, KW > 0, KW, EVEN_K)
    wait_for_inputs(USE_PDL)
    for kw0 in range(0, KW, BLOCK_KW):
        words = packed
        packed = qg._load_words(w_rows, kw0 + BLOCK_KW + offs_w, kw0 + BLOCK_KW < KW, KW, EVEN_K)
        bits ^= words
        g = tl.minimum(kw0 + offs_c, KW - 1) // WPG
        sums += tl.load(s_ptr + rows[:, None] * stride_sn + g[None, :]).to(tl.float32)
    y = tl.sum(bits, axis=1).to(tl.float32) + tl.sum(sums, axis=1)
    tl.store(out_ptr + offs_n, y, mask=offs_n < N)


def load_only(words: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """``_load_only_kernel`` with the tiles the batch-1 int4 GEMV takes at this shape."""
    n, kw = words.shape
    cfg = qg._gemv_config(1, n, kw * 8, 4)
    block_kw = min(cfg.block_kw, triton.next_power_of_2(kw))
    out = torch.empty(n, device=words.device, dtype=torch.float32)
    _load_only_kernel[(triton.cdiv(n, cfg.block_n),)](
        words, scales, out, n, kw, words.stride(0), scales.stride(0), WPG=group // 8,
        BLOCK_N=cfg.block_n, BLOCK_KW=block_kw, EVEN_K=kw % block_kw == 0,
        num_warps=cfg.num_warps, **pdl(words.device))
    return out


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
        self.fp8_wo = (self.fp8[0], self.fp8[1][:, None].contiguous(), None, 8, -1)
        self.int8 = w8a8.quantize_weight(dense, "int8", "channel")

    @staticmethod
    def nbytes(*tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def checks(results: list[dict]) -> None:
    for n, k, name in SHAPES:
        for m in CHECK_MS:
            check_one(results, n, k, m)
        print(f"checked {name} {n}x{k} m={CHECK_MS}", flush=True)


def check_one(results: list[dict], n: int, k: int, m: int) -> None:
    f = Formats(n, k, seed=n + k + m)
    x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
    for label, args in (("w8a16", f.w8), ("w4a16-g128", f.w4), ("fp8-weight-only", f.fp8_wo)):
        w64 = qg.wint_dequant_ref(*args, torch.float64).double()
        ref = x.double() @ w64.t()
        paths = {"wrapper": lambda a=args: qg.wint_linear(x, *a),
                 "fused": lambda a=args: qg.wint_gemm_triton(x, *a),
                 "dequant+cublas": lambda a=args: x @ qg.wint_dequant_triton(*a, DTYPE).t()}
        for path, fn in paths.items():
            # poison: the output's allocation most likely reuses this NaN-filled block, so an
            # element the kernel never writes fails the check
            poison = torch.full((m, n), float("nan"), device=DEVICE, dtype=DTYPE)
            del poison
            err = rel_err(fn(), ref)
            results.append(dict(check=label, path=path, n=n, k=k, m=m, rel_err=err,
                                ok=err < 1e-2))
        if m == 1:  # the dequantization kernel against the PyTorch reference, bit for bit
            same = torch.equal(qg.wint_dequant_triton(*args, DTYPE),
                               qg.wint_dequant_ref(*args, DTYPE))
            results.append(dict(check=label, path="dequant==ref", n=n, k=k, m=m, ok=same))
    for kind in ("fp8", "int8"):
        wq, ws = getattr(f, kind)
        ref = w8a8.w8a8_linear_ref(x.float(), wq, ws, kind).double()
        for triton_gemm in (False, True) if kind == "fp8" else (False,):
            err = rel_err(w8a8.w8a8_linear(x, wq, ws, kind, triton_gemm=triton_gemm), ref)
            results.append(dict(check=f"{kind}-w8a8", path="triton" if triton_gemm else "cublas",
                                n=n, k=k, m=m, rel_err=err, ok=err < 2e-2))
        q, s = w8a8.quant_per_token_triton(x, kind)
        q_ref, s_ref = w8a8.quant_per_token_ref(x, kind)
        same = (q.float() == q_ref.float()).float().mean().item()
        results.append(dict(check=f"{kind}-act-quant", path="triton", n=n, k=k, m=m,
                            rel_err=rel_err(s, s_ref), ok=same > 0.999, codes_equal=same))


def timings(results: list[dict]) -> None:
    for n, k, name in SHAPES:
        f = Formats(n, k, seed=1)
        for m in MS:
            time_one(results, f, n, k, m)
        print(f"timed {name} {n}x{k} m={MS}", flush=True)


def time_one(results: list[dict], f: Formats, n: int, k: int, m: int) -> None:
    act = 2 * m * (n + k)  # bf16 x in, y out
    x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
    ops = {"bf16 cublas": ((f.bf16,), lambda a: lambda: torch.matmul(x, a[0].t()))}
    for label, args in (("w8a16", f.w8), ("w4a16-g128", f.w4)):
        # "fused" is the dispatching wrapper: the fused kernels up to FUSED_MAX_M rows
        ops[f"{label} fused"] = (args, lambda a: lambda: qg.wint_linear(x, *a))
        ops[f"{label} dequant+cublas"] = (
            args, lambda a: lambda: x @ qg.wint_dequant_triton(*a, DTYPE).t())
    wq, ws = f.fp8
    for triton_gemm in (False, True):  # torch._scaled_mm, kiln/kernels/fp8_gemm.py
        ops[f"fp8-w8a8 {'triton' if triton_gemm else 'scaled_mm'}"] = (
            (wq, ws), lambda a, t=triton_gemm: lambda: w8a8.w8a8_linear(x, *a, "fp8",
                                                                      triton_gemm=t))
    if m == 1:  # what the batch-1 int4 GEMV's reads alone take, at its own tiles
        ops["w4 load-only floor"] = (f.w4[:2], lambda a: lambda: load_only(a[0], a[1], 128))
    if m <= qg.SMALL_M:
        ops["fp8 weight-only fused"] = (f.fp8_wo, lambda a: lambda: qg.wint_gemm_triton(x, *a))
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


G = qg.GemvConfig
T = qg.GemmConfig
# candidates per M, in sweep order (each is checked, then timed next to the current default).
# "small" is the list of the H100 run in benchmarks/results/h100/quant_kernels.*; "next" the
# candidates written after it, not run yet (the tensor-core "natural" variant, 4-row GEMV).
SWEEPS = {
    "small": {
        1: [G(1, 16, 512, 1), G(1, 32, 512, 1), G(1, 8, 256, 1),
            G(1, 16, 1024, 1, num_warps=8), G(1, 8, 512, split_k=2)],
        16: [G(16, 32, 32, 1, mma=True), G(16, 64, 32, 1, mma=True), G(16, 64, 64, 1, mma=True),
             G(16, 128, 32, 1, num_warps=8, mma=True), T(16, 64, 128, num_warps=4, num_stages=4),
             T(16, 64, 128, 2, num_warps=4, num_stages=4)],
        2: [G(1, 8, 512, 1), G(1, 16, 512, 1), G(16, 64, 32, 1, mma=True)],
        4: [G(1, 16, 512, 1), G(16, 64, 32, 1, mma=True), G(16, 64, 64, 1, mma=True)],
        8: [G(16, 64, 32, 1, mma=True), G(16, 64, 64, 1, mma=True), G(16, 32, 32, 1, mma=True)],
    },
    "next": {
        1: [G(1, 4, 512), G(1, 16, 512)],
        16: [G(16, 64, 32, mma=True, natural=True), G(16, 64, 16, mma=True, natural=True),
             G(16, 128, 16, num_warps=8, mma=True, natural=True),
             G(16, 32, 32, mma=True, natural=True), G(16, 64, 32, mma=True),
             T(16, 64, 128, 1, num_warps=4, num_stages=4),
             T(16, 64, 128, 2, num_warps=4, num_stages=4),
             T(16, 64, 128, 4, num_warps=4, num_stages=4)],
        8: [G(1, 8, 512), G(16, 64, 16, mma=True, natural=True), G(16, 64, 32, mma=True),
            T(16, 64, 128, 2, num_warps=4, num_stages=4)],
        4: [G(1, 8, 512), G(16, 64, 32, mma=True, natural=True)],
    },
}
SWEEPS["full"] = {**SWEEPS["small"], 1: SWEEPS["small"][1] + [
    G(1, 32, 256), G(1, 8, 1024, num_warps=8), G(1, 16, 512, num_warps=8),
    G(1, 16, 512, split_k=2)]}
# shapes per sweep and M (fewer where the sweep only picks a kernel family)
SWEEP_SHAPES = {
    "small": {1: [(4096, 4096), (28672, 4096), (4096, 14336)],
              16: [(4096, 4096), (28672, 4096)], 2: [(4096, 4096)], 4: [(4096, 4096)],
              8: [(4096, 4096)]},
    "next": {1: [(4096, 4096), (6144, 4096), (4096, 14336)],
             16: [(4096, 4096), (28672, 4096), (4096, 14336)], 8: [(4096, 4096)],
             4: [(4096, 4096)]},
}
SWEEP_SHAPES["full"] = SWEEP_SHAPES["small"]
# batch-1 decode only, every layer shape of Llama-3.1-8B plus its LM head (W8A16 in every
# weight-only format)
SWEEPS["decode1"] = {1: SWEEPS["full"][1] + [
    # with the next tile loaded while the current one is multiplied (and the first before the
    # PDL wait), tiles shorter than K pipeline inside a program: K = 4096 in 2 or 4 steps
    G(1, 8, 256), G(1, 16, 256), G(1, 4, 256), G(1, 8, 128), G(1, 4, 512), G(1, 8, 256, 2)]}
SWEEP_SHAPES["decode1"] = {1: [(n, k) for n, k, _ in SHAPES] + [(128256, 4096)]}


def sweep(results: list[dict], name: str, budget: float) -> None:
    grid, formats = SWEEPS[name], {}
    for m in grid:
        shapes = [(n, k) for n, k, _ in SHAPES[:1]] if SMOKE else SWEEP_SHAPES[name][m]
        kinds = ("w4", "w8", "fp8_wo", "w16") if name == "decode1" else ("w4", "w8", "fp8_wo")
        for (n, k), kind in itertools.product(shapes, kinds):
            if kind == "fp8_wo" and (m not in (1, 16) or k != 4096):
                continue
            if time.time() - START > budget:
                print(f"sweep stopped at the {budget:.0f} s budget", flush=True)
                return
            if (n, k) not in formats:
                formats[(n, k)] = Formats(n, k, seed=2)
            best = sweep_one(results, grid[m], formats[(n, k)], kind, n, k, m)
            print(f"swept {kind} {n}x{k} m={m}: best {best}", flush=True)


def sweep_one(results: list[dict], configs: list, f: Formats, kind: str, n: int, k: int,
              m: int):
    """Check and time the default (None) and each candidate config on one shape; for w16
    (dense_gemv's configs) bf16 cuBLAS ("cublas") alongside."""
    qargs = (f.bf16,) if kind == "w16" else getattr(f, kind)
    x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
    w64 = f.bf16.double() if kind == "w16" else qg.wint_dequant_ref(*qargs, torch.float64).double()
    ref, ref_bf16 = x.double() @ w64.t(), x.double() @ f.bf16.double().t()
    best = None
    for cfg in ["cublas", None, *configs] if kind == "w16" else [None, *configs]:
        args, expected = qargs, ref
        if cfg == "cublas":
            args, expected = (f.bf16,), ref_bf16
            make = lambda a: lambda: torch.matmul(x, a[0].t())
        elif kind == "w16":
            make = lambda a, c=cfg: lambda: qg.dense_gemv(x, a[0], config=c)
        else:
            make = lambda a, c=cfg: lambda: qg.wint_gemm_triton(x, *a, config=c)
        wbytes = Formats.nbytes(*args)
        try:
            err = rel_err(make(args)(), expected)  # every candidate is checked before it is timed
            us = time_graph_us(rotating(args, make), wbytes)
        except Exception as exc:  # out of shared memory / registers: not a candidate
            results.append(dict(kind=kind, n=n, k=k, m=m, config=repr(cfg), error=repr(exc)[:200]))
            continue
        gbps = (wbytes + 2 * m * (n + k)) / (us * 1e-6) / 1e9
        name = "default" if cfg is None else cfg if isinstance(cfg, str) else repr(cfg)
        results.append(dict(kind=kind, n=n, k=k, m=m, config=name, us=us, gb_s=gbps,
                            rel_err=err, ok=err < 1e-2))
        if err < 1e-2 and (best is None or us < best[0]):
            best = (us, name, round(gbps))
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
    if report["sweep"]:
        print("\nsweep: best small-M config per (format, shape, M) vs the default")
        best = {}  # (default, best candidate, bf16 cuBLAS) per key
        for r in report["sweep"]:
            if "us" in r and r["ok"]:
                key = (r["kind"], r["n"], r["k"], r["m"])
                row = best.setdefault(key, [None, None, None])
                if r["config"] == "cublas":
                    row[2] = r
                if r["config"] == "default":
                    row[0] = r
                elif (r["config"] != "cublas" or r["kind"] == "w16") and (
                        row[1] is None or r["us"] < row[1]["us"]):
                    row[1] = r
        for (kind, n, k, m), (d, b, c) in best.items():
            dd = f"{d['us']:7.1f} us {d['gb_s']:5.0f} GB/s" if d else "-"
            bb = f"{b['us']:7.1f} us {b['gb_s']:5.0f} GB/s {b['config']}" if b else "-"
            cc = f" | bf16 cuBLAS {c['us']:.1f} us" if c else ""
            print(f"  {kind:7s} {n}x{k} m={m:<3d} default {dd}{cc} | best {bb}")
    bad = [c for c in report["checks"] + report["sweep"] if "ok" in c and not c["ok"]]
    n_checks = len(report["checks"])
    print(f"\nchecks: {n_checks - len([c for c in report['checks'] if not c['ok']])}/{n_checks}"
          f" ok; sweep candidates failing their check: "
          f"{len([c for c in report['sweep'] if 'ok' in c and not c['ok']])}")
    for c in bad[:20]:
        print("  FAIL", c)
    for c in report.get("errors", []):
        print("  ERROR", c.strip().splitlines()[-1])
    if "pytest" in report:
        print("pytest -m gpu:", report["pytest"]["tail"].strip().splitlines()[-1:])
    for label in ("w4a16-g128 fused", "w4 load-only floor", "w8a16 fused"):
        gemv = [r for r in report["timings"] if r.get("op") == label and r["m"] == 1]
        for r in gemv:
            print(f"{label} M=1 {r['n']}x{r['k']}: {r['gb_s']:.0f} GB/s = "
                  f"{100 * r['copy_ratio']:.0f}% of copy bandwidth (W4 target >= 70%)")


def dump_asm(out_dir: str) -> None:
    """Tar the Triton cache entries of the small-M kernels (TTGIR, PTX, cubin, metadata)."""
    cache = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
    files = [p for p in glob.glob(os.path.join(cache, "*", "*"))
             if os.path.basename(p).startswith(("_wq_", "_wint_"))]
    os.makedirs(out_dir, exist_ok=True)
    with tarfile.open(os.path.join(out_dir, "quant_asm.tar.gz"), "w:gz") as tar:
        for p in files:
            tar.add(p, arcname=os.path.relpath(p, cache))
    print(f"asm: {len(files)} cache files -> {out_dir}/quant_asm.tar.gz", flush=True)


SMOKE_HELP = "check this script on CPU: TRITON_INTERPRET=1, tiny shapes, no CUDA graphs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", choices=["none", "small", "next", "full", "decode1"],
                        default="small")
    parser.add_argument("--pytest", action="store_true", help="also run pytest -m gpu on quant")
    parser.add_argument("--budget", type=float, default=1e9, help="seconds before the sweep stops")
    parser.add_argument("--asm", help="folder for a tarball of the small-M kernels' TTGIR etc.")
    parser.add_argument("--pytest-timeout", type=float, default=600)
    parser.add_argument("--ms", help="comma-separated M values to time (default 1,16,64,256)")
    parser.add_argument("--check-ms", help="comma-separated M values to check (1,3,16,64,256)")
    parser.add_argument("--only-sweep", action="store_true", help="skip checks and timings")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    global MS, CHECK_MS
    if args.ms:
        MS = [int(v) for v in args.ms.split(",")]
    if args.check_ms:
        CHECK_MS = [int(v) for v in args.check_ms.split(",")]
    if args.smoke:
        global SMOKE, DEVICE, SHAPES, DTYPE
        SMOKE, DEVICE, MS, CHECK_MS = True, "cpu", [1, 3], [1, 3]
        SHAPES = [(64, 512, "tiny"), (32, 1024, "tiny-k")]
        DTYPE = torch.float16  # the interpreter computes bf16 wrongly (shared/GPU.md)
        for grid in SWEEPS.values():
            for m in list(grid):
                grid[m] = [c for c in grid[m] if isinstance(c, qg.GemvConfig)][:2]
    elif not torch.cuda.is_available():
        sys.exit("gpu_quant.py needs a CUDA GPU (or --smoke)")
    device = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()
    report = {"device": device, "torch": torch.__version__,
              "triton": triton.__version__, "command": " ".join(sys.argv),
              "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
              "checks": [], "timings": [], "sweep": []}
    stages = [] if args.only_sweep else [("checks", checks), ("timings", timings)]
    if args.sweep != "none":
        stages.append(("sweep", lambda res: sweep(res, args.sweep, args.budget)))
    for key, fn in stages:
        t0 = time.time()
        try:
            fn(report[key])
        except Exception:
            report.setdefault("errors", []).append(traceback.format_exc())
            traceback.print_exc()
        report.setdefault("stage_s", {})[key] = round(time.time() - t0, 1)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:  # after every stage: a timeout keeps what was done
            json.dump(report, fh, indent=1)
    if args.asm:
        try:
            dump_asm(args.asm)
        except Exception:
            traceback.print_exc()
    if args.pytest:
        t0 = time.time()
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q",
               "tests/kernels/test_quant_gemm.py"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=args.pytest_timeout)
            report["pytest"] = {"rc": proc.returncode, "tail": proc.stdout[-3000:]}
        except subprocess.TimeoutExpired as exc:
            tail = (exc.stdout or b"")[-3000:]
            tail = tail.decode() if isinstance(tail, bytes) else tail
            report["pytest"] = {"rc": "timeout", "tail": tail + "\n(timed out)"}
        report.setdefault("stage_s", {})["pytest"] = round(time.time() - t0, 1)
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    table(report)
    print("stage seconds:", report.get("stage_s"))


if __name__ == "__main__":
    main()

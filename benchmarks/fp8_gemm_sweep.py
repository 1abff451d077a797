"""Tile sweep of kiln/kernels/fp8_gemm.py against torch._scaled_mm at decode batch sizes.

    PYTHONPATH=. python3 benchmarks/fp8_gemm_sweep.py --out $OUT/fp8_gemm.json [--ms 8,16,32,64,128]

For each Llama-3.1-8B GEMM shape and M: the activation quantizer + GEMM through _scaled_mm, the
Triton kernel with its default tiles (fp8_gemm_config), and a handful of alternative tiles, each
checked against float64 math and timed in a CUDA graph over rotating weight copies (the timer of
benchmarks/gpu_quant.py). Prints one line per case and writes every row to JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

import gpu_quant as gq  # benchmarks/ is on sys.path when this file runs
import torch

from kiln.kernels._triton import num_sms
from kiln.kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm_config, fp8_gemm_triton
from kiln.quant import w8a8

ALTERNATIVES = [(16, 32, 128, 4, 5), (16, 64, 128, 4, 5), (64, 32, 128, 4, 5),
                (64, 64, 128, 4, 5), (64, 64, 128, 4, 3), (64, 128, 128, 4, 4),
                (64, 64, 256, 4, 3), (32, 64, 128, 4, 5), (64, 32, 128, 8, 6)]


def run_case(n: int, k: int, m: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    dense = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
    wq, ws = w8a8.quantize_weight(dense, "fp8", "channel")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = w8a8.w8a8_linear_ref(x.float(), wq, ws, "fp8").double()
    default = fp8_gemm_config(m, n, k, num_sms(x.device))
    configs = {"default": default} | {
        str(c): Fp8GemmConfig(*c) for c in ALTERNATIVES if c[0] >= min(m, 64) or c[0] == 16}
    paths = {"scaled_mm": lambda a: lambda: w8a8.w8a8_linear(x, *a, "fp8", triton_gemm=False)}
    for label, cfg in configs.items():
        def make(a, cfg=cfg):
            def fn():
                xq, xs = w8a8.quant_per_token_triton(x, "fp8")
                return fp8_gemm_triton(xq, xs, *a, config=cfg)
            return fn
        paths[label] = make
    rows = []
    wbytes = wq.numel() + 4 * ws.numel()
    for label, make in paths.items():
        try:
            err = gq.rel_err(make((wq, ws))(), ref)
            us = gq.time_graph_us(gq.rotating((wq, ws), make), wbytes)
        except Exception as exc:  # noqa: BLE001 - one failing tile must not hide the others
            rows.append(dict(n=n, k=k, m=m, path=label, error=repr(exc)[:200]))
            continue
        rows.append(dict(n=n, k=k, m=m, path=label, us=us, rel_err=err, ok=err < 2e-2,
                         gb_s=wbytes / us / 1e3, config=str(default) if label == "default"
                         else label))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ms", default="8,16,32,64,128")
    args = parser.parse_args()
    rows = []
    print(f"{'N x K':>12} {'M':>4} {'scaled_mm':>10} {'triton':>8} {'best':>8}  best tiles  ok",
          flush=True)
    for n, k, _ in gq.SHAPES:
        for m in (int(v) for v in args.ms.split(",")):
            case = run_case(n, k, m)
            rows += case
            timed = {r["path"]: r for r in case if "us" in r}
            best = min((r for p, r in timed.items() if p != "scaled_mm"), key=lambda r: r["us"])
            ok = all(r.get("ok", False) for r in case)
            print(f"{n:>6}x{k:<5} {m:>4} {timed['scaled_mm']['us']:10.1f} "
                  f"{timed['default']['us']:8.1f} {best['us']:8.1f}  {best['config']}  {ok}",
                  flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "argv": sys.argv, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Tile sweep of kiln/kernels/gemm.py against cuBLAS at decode batch sizes (and beyond 64 rows,
where the engine leaves the GEMMs to cuBLAS: --ms 128,256,512 --dtypes bf16 shows by how much).

    PYTHONPATH=. python3 benchmarks/gemm_sweep.py --out $OUT/gemm.json [--ms 16,32,64,128]
        [--dtypes bf16,fp8]

For each Llama-3.1-8B GEMM shape (gate_up also gated: silu(gate) * up, and the LM head with
float32 logits), M and operand type: cuBLAS (torch.mm for bf16, torch._scaled_mm for FP8
W8A8; + silu_and_mul where gated), the Triton kernel with its default tiles (gemm_config), and
alternative tiles, each checked against float64 math and timed in a CUDA graph over
rotating weight copies (the timer of benchmarks/gpu_quant.py). FP8 paths take activation codes
quantized beforehand, as the engine's RMSNorm hands them to qkv and gate_up; the standalone
quantizer that o_proj and down_proj add is timed on its own row. Prints one line per case and
writes every row to JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

import gpu_quant as gq  # benchmarks/ is on sys.path when this file runs
import torch

from kiln.kernels._triton import num_sms
from kiln.kernels.activation import silu_and_mul, silu_and_mul_ref
from kiln.kernels.gemm import GemmTiles, gemm_config, gemm_triton
from kiln.quant import w8a8

# (block_m, block_n, block_k, num_warps, num_stages) per operand width; K splits were swept
# until they lost at every shape (gemm_sweep.txt) and left the kernel
ALTERNATIVES = {
    "fp8": [(64, 32, 128, 8, 6), (64, 64, 256, 4, 3), (64, 128, 128, 4, 4), (64, 128, 256, 8, 3),
            (64, 32, 256, 4, 4), (64, 32, 256, 4, 6), (64, 32, 256, 8, 6), (64, 16, 256, 4, 6),
            (64, 16, 512, 4, 4), (64, 32, 512, 4, 3), (64, 64, 256, 4, 4), (64, 64, 128, 4, 6),
            (64, 64, 512, 4, 2), (64, 128, 256, 4, 2), (64, 32, 128, 4, 8), (64, 32, 256, 4, 7),
            (64, 32, 256, 4, 8), (64, 64, 256, 4, 5), (64, 64, 128, 4, 8), (64, 32, 512, 4, 4),
            (64, 128, 256, 4, 3)],
    "bf16": [(64, 32, 128, 8, 6), (64, 32, 64, 4, 8), (64, 64, 64, 4, 6), (64, 64, 128, 4, 4),
             (64, 128, 64, 4, 5),
             (64, 128, 128, 8, 3), (64, 128, 128, 4, 3), (128, 64, 64, 8, 4), (64, 32, 256, 4, 4),
             (64, 32, 256, 8, 4), (64, 64, 256, 4, 3), (64, 32, 128, 4, 6), (64, 16, 256, 4, 4),
             (64, 64, 128, 8, 5), (64, 32, 128, 4, 7), (64, 32, 128, 4, 8), (64, 64, 128, 4, 5),
             (64, 128, 128, 4, 4)],
    # M > 64 (mixed steps, the 512-request workload's decode steps): compute-bound tiles
    "bf16_large": [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3),
                   (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 256, 64, 8, 3),
                   (128, 128, 128, 8, 3), (128, 64, 128, 4, 3), (64, 128, 128, 4, 3)],
}


SHAPES = [(6144, 4096, "qkv"), (4096, 4096, "o_proj"), (28672, 4096, "gate_up"),
          (4096, 14336, "down_proj"), (28672, 4096, "gate_up gated"), (128256, 4096, "lm_head")]


def run_case(n: int, k: int, m: int, dtype: str, layer: str) -> list[dict]:
    """gated: silu(gate) * up in the epilogue against cuBLAS + silu_and_mul; lm_head: float32
    logits; both only with the default tiles."""
    gated = layer.endswith("gated")
    out_dtype = torch.float32 if layer == "lm_head" else None
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    dense = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if dtype == "fp8":
        weights = w8a8.quantize_weight(dense, "fp8", "channel")
        ref = w8a8.w8a8_linear_ref(x.float(), *weights, "fp8")
        # quantized once, outside the timed ops: the engine's RMSNorm writes these codes for
        # qkv and gate_up (o_proj and down_proj add a quantizer, timed on its own row)
        codes = w8a8.quant_per_token(x, "fp8")

        def cublas(a):
            return lambda: w8a8.w8a8_linear(codes, *a, "fp8", triton_gemm=False, gated=gated,
                                            dtype=x.dtype)

        def triton_path(cfg):
            return lambda a: lambda: gemm_triton(codes.codes, a[0], None, out_dtype, codes.scales,
                                                 a[1], gated=gated, config=cfg)
    else:
        weights = (dense.bfloat16(),)
        ref = x.float() @ weights[0].float().t()

        def cublas(a):
            def fn():
                y = torch.mm(x, a[0].t(), out_dtype=out_dtype or x.dtype)
                return silu_and_mul(y) if gated else y
            return fn

        def triton_path(cfg):
            return lambda a: lambda: gemm_triton(x, a[0], None, out_dtype, gated=gated,
                                                 config=cfg)
    ref = (silu_and_mul_ref(ref.bfloat16()) if gated else ref).double()
    default = gemm_config(m, n, k, weights[0].element_size(), num_sms(x.device))
    configs = {"default": default} | {
        str(c): GemmTiles(*c) for c in ALTERNATIVES.get(f"{dtype}_large" if m > 64 else dtype,
                                                          ALTERNATIVES[dtype])
        if layer in ("qkv", "o_proj",
                                                                          "gate_up", "down_proj")
        and k % c[2] == 0 and (c[0] >= min(m, 64) or c[0] == 16)}
    paths = {"cublas": cublas} | {label: triton_path(cfg) for label, cfg in configs.items()}
    rows = []
    wbytes = sum(t.numel() * t.element_size() for t in weights)
    for label, make in paths.items():
        try:
            err = gq.rel_err(make(weights)(), ref)
            us = gq.time_graph_us(gq.rotating(weights, make), wbytes)
        except Exception as exc:  # noqa: BLE001 - one failing tile must not hide the others
            rows.append(dict(n=n, k=k, m=m, dtype=dtype, layer=layer, path=label,
                             error=repr(exc)[:200]))
            continue
        rows.append(dict(n=n, k=k, m=m, dtype=dtype, layer=layer, path=label, us=us, rel_err=err,
                         ok=err < 2e-2, gb_s=wbytes / us / 1e3,
                         config=str(tuple(default)) if label == "default" else label))
    if dtype == "fp8" and layer in ("o_proj", "down_proj"):
        us = gq.time_graph_us(lambda i: lambda: w8a8.quant_per_token(x, "fp8"), x.numel() * 3)
        rows.append(dict(n=n, k=k, m=m, dtype=dtype, layer=layer, path="quantizer", us=us))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ms", default="16,32,64,128")
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--layers", default=",".join(layer for _, _, layer in SHAPES),
                        help="comma-separated layer names of SHAPES")
    args = parser.parse_args()
    rows = []
    layers = args.layers.split(",")
    print(f"{'type':>5} {'layer':>13} {'M':>4} {'cublas':>8} {'default':>8} {'best':>8} "
          f"{'best GB/s':>9}  best tiles  ok  (quantizer us)", flush=True)
    for dtype in args.dtypes.split(","):
        for n, k, layer in SHAPES:
            if layer not in layers or (dtype == "fp8" and layer == "lm_head"):
                continue  # FP8 W8A8 keeps a 16-bit LM head
            for m in (int(v) for v in args.ms.split(",")):
                case = run_case(n, k, m, dtype, layer)
                rows += case
                timed = {r["path"]: r for r in case if "us" in r}
                quantizer = timed.pop("quantizer", None)
                best = min((r for p, r in timed.items() if p != "cublas"), key=lambda r: r["us"])
                ok = all(r.get("ok", False) for r in case if r["path"] != "quantizer")
                print(f"{dtype:>5} {layer:>13} {m:>4} {timed['cublas']['us']:8.1f} "
                      f"{timed['default']['us']:8.1f} {best['us']:8.1f} {best['gb_s']:9.0f}  "
                      f"{best['config']}  {ok}"
                      + (f"  ({quantizer['us']:.1f})" if quantizer else ""), flush=True)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "argv": sys.argv, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

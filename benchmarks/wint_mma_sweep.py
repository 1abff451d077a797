"""Sweep the tiles and K splits of the tensor-core weight-only GEMM (kiln/kernels/wint_mma.py) at
the Llama-3.1-8B layer shapes, next to bf16 cuBLAS; JSON out, one line a (layer, bits, M).

    PYTHONPATH=. python3 benchmarks/wint_mma_sweep.py --out F [--ms 16,32,64,128,256,512,1024]
        [--default-only] [--ws [--ws-tiles T,...] [--ws-only]] [--shapes S,...] [--bits 4,8]

Whichever kiln is first on the path is swept, so two trees compare on one machine (an older
tree's kiln first on PYTHONPATH, with --default-only: its wint_mma_tiles picks). Weights are
random words (every code value) with random positive scales: int4 g128 and 8-bit codes per
channel. Each candidate is checked against float64 math on the weight dequantized by
quant_gemm.wint_dequant_ref (relative error < 1e-2) before it is timed, the same way as
benchmarks/gpu_quant.py (a graph of the op on rotating weight copies, so the weights come from
HBM, not the 50 MB L2). Candidates: 64 or 128 rows of W against x tiles of the next power of
two >= M rows (at most MMA_X_TILE_MAX) or half that, 4 or 8 warps, 3 or 4 stages; each at the
split _split picks ("*" in its key), half and twice it. Each row also times what the library
runs at that M (quant_gemm.wint_linear_triton: dequantize + cuBLAS past MMA_MAX_M) and
dequantize + cuBLAS itself, the alternative MMA_MAX_M is set against. --ws adds the persistent
Gluon kernel (kiln/kernels/wint_ws.py) at each of WS_TILES or --ws-tiles ("ws 128x256s4k1":
rows of W x rows of x, stages, K split), and at the library's pick (ws_plan: one launch, or two
over W's rows, then also ws_tiles' one launch), checked the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_quant import rel_err, rotating, time_graph_us  # noqa: E402

from kiln.kernels import wint_mma as wm  # noqa: E402
from kiln.kernels.quant_gemm import (  # noqa: E402
    wint_dequant_ref,
    wint_dequant_triton,
    wint_linear_triton,
)
from kiln.kernels.wint_mma import MmaTiles  # noqa: E402

try:  # a tree from before the Gluon kernel: --ws not available
    from kiln.kernels import wint_ws as ws  # noqa: E402
except ImportError:
    ws = None

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
FORMATS = ((4, 128), (8, 0))  # (bits, group); 0: per channel
WS_TILES = ((128, 256, 4), (128, 256, 5), (128, 128, 6), (64, 256, 6), (64, 128, 8))


def make_weight(n: int, k: int, bits: int, group: int, gen: torch.Generator):
    """Random int32 words [N, K bits / 32] and positive bf16 scales [N, K / group or 1]."""
    words = torch.randint(-2**31, 2**31 - 1, (n, k * bits // 32), device="cuda",
                          dtype=torch.int32, generator=gen)
    scales = torch.rand(n, k // group if group else 1, device="cuda", generator=gen) * 0.02
    return words, (scales + 0.005).to(torch.bfloat16)


def candidates(m: int, bits: int, k_step: int) -> list[MmaTiles]:
    bm = min(wm.MMA_X_TILE_MAX, max(16, 1 << (m - 1).bit_length()))
    tiles = {MmaTiles(64, 0, bm, k_step=k_step), MmaTiles(128, 0, bm, k_step=k_step),
             MmaTiles(64, 0, bm, num_stages=4, k_step=k_step),
             MmaTiles(128, 0, bm, num_warps=8, k_step=k_step),
             MmaTiles(128, 0, bm, num_warps=8, num_stages=4, k_step=k_step)}
    if bm > 16:
        tiles |= {MmaTiles(64, 0, bm // 2, k_step=k_step)}
    return sorted(tiles, key=str)


def sweep_one(n: int, k: int, bits: int, group: int, m: int, gen: torch.Generator,
              dense: torch.Tensor, default_only: bool,
              with_ws: bool = False, ws_tiles: tuple[ws.WsTiles, ...] = (),
              ws_only: bool = False) -> dict:
    words, scales = make_weight(n, k, bits, group, gen)
    g = group or k
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    def packed(w: torch.Tensor) -> torch.Tensor:  # int32 words in kiln/quant's packing
        return w if bits == 4 else w.view(torch.uint8)

    ref = x.double() @ wint_dequant_ref(packed(words), scales, None, bits, g, torch.float64).t()
    wbytes = words.numel() * 4 + scales.numel() * 2

    def checked(run) -> float | str:  # run(args): the op on (words, scales) copies
        try:
            err = rel_err(run((words, scales))(), ref)
            if not err < 1e-2:
                return f"relative error {err:.3g}"
            return time_graph_us(rotating([words, scales], run), wbytes)
        except Exception as exc:  # out of shared memory / registers: not a candidate
            return repr(exc)[:160]

    def timed(tiles: MmaTiles | None) -> float | str:
        return checked(lambda a: lambda: wm.wint_mma_gemm(x, a[0], a[1], bits, g, tiles=tiles))

    row = dict(bits=bits, m=m, bf16_us=time_graph_us(
        rotating([dense], lambda a: lambda: x @ a[0].t()), dense.numel() * 2))
    if not ws_only:
        row.update(default=str(wm.wint_mma_tiles(m, n, k, g, bits, x.device)),
                   default_us=timed(None),
                   library_us=checked(lambda a: lambda: wint_linear_triton(
                       x, packed(a[0]), a[1], None, bits, g)),
                   dequant_us=checked(lambda a: lambda: x @ wint_dequant_triton(
                       packed(a[0]), a[1], None, bits, g, x.dtype).t()))
    for t in ws_tiles:  # (a split K does not divide: wint_ws_gemm's assertion, recorded)
        row[f"ws {t.name}"] = checked(
            lambda a, t=t: lambda: ws.wint_ws_gemm(x, a[0], a[1], bits, g, tiles=t))
    if with_ws:  # the library's launches (ws_plan), and ws_tiles' one launch where they differ
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        plan, one = ws.ws_plan(m, n, k, sms, bits), ws.ws_tiles(m, n, k, sms, bits)
        row["ws_default"] = " + ".join(f"{p.tiles.name} x {p.rows}" for p in plan)
        row["ws_default_us"] = checked(lambda a: lambda: ws.wint_ws_gemm(x, a[0], a[1], bits, g))
        if len(plan) > 1:
            row["ws_one"] = one.name
            row["ws_one_us"] = checked(
                lambda a: lambda: ws.wint_ws_gemm(x, a[0], a[1], bits, g, tiles=one))
    if default_only or ws_only:
        return row
    k_step = g if g < k else wm._per_channel_step(k)
    for t in candidates(m, bits, k_step):
        out_tiles = -(-m // t.block_m) * -(-n // t.block_n)
        rule = wm._split(t, out_tiles, k // k_step, x.device)
        for split in sorted({max(1, rule // 2), rule, rule * 2}):
            key = (f"{t.block_n}x{t.block_m}w{t.num_warps}s{t.num_stages}k{split}"
                   f"{'*' if split == rule else ''}")
            row[key] = timed(MmaTiles(t.block_n, split, t.block_m, t.num_warps, t.num_stages,
                                      t.k_step))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ms", default="16,32,64,128,256,512,1024")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down",
                        help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--default-only", action="store_true",
                        help="time wint_mma_tiles' picks only (and bf16)")
    parser.add_argument("--ws", action="store_true",
                        help="also time wint_ws at --ws-tiles and at the library's pick (ws_plan)")
    parser.add_argument("--ws-tiles", default=",".join(f"{n}x{m}s{s}" for n, m, s in WS_TILES),
                        help="with --ws: wint_ws tilings, rows of W x rows of x s stages "
                             "[k split], as 128x64s8k4, or two wgmmas' rows of x as "
                             "128x128+32s6; empty: the library's pick only")
    parser.add_argument("--ws-only", action="store_true",
                        help="with --ws: time wint_ws and bf16 only (not wint_mma, the library's "
                             "path, dequantize + cuBLAS)")
    parser.add_argument("--bits", default="4,8", help="code widths: int4 g128, 8-bit per channel")
    args = parser.parse_args()
    if args.ws and ws is None:
        parser.error("--ws: this tree's kiln has no kiln/kernels/wint_ws.py")
    tiling = re.compile(r"(\d+)x(\d+)(?:\+(\d+))?s(\d+)(?:k(\d+))?")

    def parsed(name: str) -> ws.WsTiles:
        block_n, block_m, block_m2, stages, split = tiling.fullmatch(name).groups()
        return ws.WsTiles(int(block_n), int(block_m), int(stages), int(split or 1),
                          int(block_m2 or 0))

    ws_tiles = tuple(parsed(t) for t in args.ws_tiles.split(",") if t) if args.ws else ()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        dense = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
        for bits, group in FORMATS:
            if str(bits) not in args.bits.split(","):
                continue
            for m in (int(v) for v in args.ms.split(",")):
                row = dict(shape=name, **sweep_one(n, k, bits, group, m, gen, dense,
                                                   args.default_only, args.ws, ws_tiles,
                                                   args.ws_only))
                print(json.dumps(row), flush=True)
                rows.append(row)
                with open(args.out, "w") as f:  # after every row: a cut-short run keeps its data
                    json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Compile a variant of the decode GEMM kernels for sm_90 on a host without a GPU and report what
the machine code says: registers, spill stack, shared memory, and the K loop (the innermost
loop holding the wgmmas): its instruction count and the loads in it. For checking a kernel
change before a GPU run, not for speed: a shorter loop or fewer registers is a hint, no more.

    python3 benchmarks/sm90_compile.py wint_mma --bits 4 --block-n 128 --block-m 256 --warps 8
        [--stages 3] [--k-step 128] [--per-channel] [--split 2] [--ragged-m]
    python3 benchmarks/sm90_compile.py gemm --block-n 64 --block-k 128 --stages 4 [--fp8] [--pdl]
    python3 benchmarks/sm90_compile.py gated_gemm  (the prefill gate/up GEMM, at its H100 tiles)
    python3 benchmarks/sm90_compile.py wint_ws --bits 4 --group 128 --block-n 128 --block-m 256
        --stages 4 [--ragged-m]  (the Gluon kernel, compiled as launched: M unspecialized, N
        divisible by 16; --ragged-m: the variant for an M no multiple of the tile's rows)
    ... [--dump DIR]  (writes the TTGIR, PTX and SASS there)
    ... [--unspecialized M,stride_om]

Integer arguments of the Triton kernels are compiled as a launch specializes them (divisible by
16), except those named by --unspecialized (default M: the GEMM keeps it unspecialized; for
wint_mma: a batch size that is not a multiple of 16; add e.g. stride_om for an output row of a
width that is not); wint_ws is compiled as it is launched. Triton's ptxas and nvdisasm do the
work: whichever triton is first on the path is used (put the device's version first to see what
it compiles).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from sass_hazards import wgmma_hazards  # noqa: E402 (this script's folder)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kiln.kernels import gated_gemm, gemm, wint_mma, wint_ws  # noqa: E402


def wint_mma_variant(a: argparse.Namespace) -> tuple:
    """_wint_mma_kernel's signature and constants for the options (bf16 x), with the wait after
    each step where wint_mma launches it so under the Triton that compiles it."""
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "smooth_ptr": "*bf16",
           "out_ptr": "*fp32" if a.out_fp32 else "*bf16", "part_ptr": "*fp32",
           "count_ptr": "*i32"}
    consts = dict(BITS=a.bits, STEP_W=a.k_step * a.bits // 32, GROUPED=not a.per_channel,
                  HAS_SMOOTH=False, SPLIT=a.split, ASM=True, BLOCK_N=a.block_n,
                  BLOCK_M=a.block_m, EVEN_M=not a.ragged_m, USE_PDL=a.pdl,
                  RETIRE=wint_mma.retire_each_step(wint_mma.MmaTiles(
                      a.block_n, a.split, a.block_m, a.warps, a.stages, a.k_step)))
    return wint_mma._wint_mma_kernel, sig, consts


def gemm_variant(a: argparse.Namespace) -> tuple:
    """_gemm_kernel's signature and constants (bf16 operands, or e4m3 with --fp8)."""
    el = "fp8e4nv" if a.fp8 else "bf16"
    sig = {"x_ptr": f"*{el}", "xs_ptr": "*fp32", "w_ptr": f"*{el}", "ws_ptr": "*fp32",
           "bias_ptr": "*bf16", "y_ptr": "*bf16"}
    consts = dict(SCALED=a.fp8, HAS_BIAS=False, GATED=False, BLOCK_M=a.block_m,
                  BLOCK_N=a.block_n, BLOCK_K=a.block_k, EVEN=not a.ragged_m,
                  PREFETCH_STEPS=gemm.PREFETCH_K_STEPS,
                  USE_PDL=a.pdl)
    return gemm._gemm_kernel, sig, consts


def gated_gemm_variant(a: argparse.Namespace) -> tuple:
    """_gated_gemm_kernel's signature (bf16 TMA descriptors of its tiles) and constants."""
    t = gated_gemm.H100_TILES
    sig = {"x_desc": f"tensordesc<bf16[{t.block_m},{t.block_k}]>",
           "w_desc": f"tensordesc<bf16[{t.block_n},{t.block_k}]>",
           "y_desc": f"tensordesc<bf16[{t.block_m},{t.block_n}]>"}
    consts = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
                  NUM_PROGRAMS=132)
    return gated_gemm._gated_gemm_kernel, sig, consts


def machine_code(kernel) -> tuple[int, int, str]:
    """A compiled kernel's registers a thread, spill stack bytes and SASS (Triton's own cuobjdump
    and nvdisasm read its cubin)."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin],
                              capture_output=True, text=True, check=True).stdout
    return (int(re.search(r"REG:(\d+)", usage).group(1)),
            int(re.search(r"STACK:(\d+)", usage).group(1)), sass)


def k_loop_lines(sass: str) -> list[str]:
    """The SASS lines of the innermost loop with wgmmas (a label, then a branch back to it)."""
    lines = sass.splitlines()
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.match(r"^\.L_x_\d+:$", line)}
    best: list[str] = []
    for i, line in enumerate(lines):
        back = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if back and labels.get(back.group(1), i) < i:
            body = lines[labels[back.group(1)]:i + 1]
            if any("GMMA" in b for b in body) and (not best or len(body) < len(best)):
                best = body
    return best


def opcodes(lines: list[str]) -> list[str]:
    """The opcodes of SASS lines, predicates dropped."""
    return re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)",
                      "\n".join(lines), re.M)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=["wint_mma", "gemm", "wint_ws", "gated_gemm"])
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--block-n", type=int, default=128)
    parser.add_argument("--block-m", type=int, default=None,
                        help="x rows a tile (wint_mma: 256; gemm: 64)")
    parser.add_argument("--block-k", type=int, default=128)
    parser.add_argument("--k-step", type=int, default=128)
    parser.add_argument("--group", type=int, default=128,
                        help="wint_ws: codes a scale group (>= --k: per channel)")
    parser.add_argument("--k", type=int, default=4096, help="wint_ws: K")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--split", type=int, default=1, help="programs sharing K")
    parser.add_argument("--block-m2", type=int, default=0,
                        help="wint_ws: a second wgmma's rows of x (tiles of --block-m + this)")
    for flag in ("per-channel", "ragged-m", "fp8", "pdl", "out-fp32"):
        parser.add_argument(f"--{flag}", action="store_true")
    parser.add_argument("--dump", help="a directory for the TTGIR, PTX and SASS")
    parser.add_argument("--unspecialized", default="M",
                        help="comma-separated integer arguments compiled as not divisible by 16")
    a = parser.parse_args()
    if a.kernel == "gated_gemm":  # compiled as launched: its H100 tiles, not the flags
        t = gated_gemm.H100_TILES
        a.block_m, a.block_n, a.block_k, a.warps, a.stages = (t.block_m, t.block_n, t.block_k,
                                                              t.num_warps, t.num_stages)
    a.block_m = a.block_m or (64 if a.kernel == "gemm" else 256)
    if a.kernel == "wint_ws":
        kernel = wint_ws.compile_sm90(a.bits, a.group, a.k,
                                      wint_ws.WsTiles(a.block_n, a.block_m, a.stages, a.split,
                                                      a.block_m2),
                                      out_dtype="fp32" if a.out_fp32 else None,
                                      shift=a.ragged_m)
    else:
        kernel = _compile_triton(parser, a)
    registers, spill_bytes, sass = machine_code(kernel)
    report(a, kernel, registers, spill_bytes, sass)


def _compile_triton(parser: argparse.ArgumentParser, a: argparse.Namespace):
    variant = {"wint_mma": wint_mma_variant, "gemm": gemm_variant,
               "gated_gemm": gated_gemm_variant}[a.kernel]
    fn, sig, consts = variant(a)
    for name in fn.arg_names:  # the remaining arguments: int32 scalars
        if name not in sig and name not in consts:
            sig[name] = "i32"
    sig.update({name: "constexpr" for name in consts})
    unspecialized = set(a.unspecialized.split(",")) - {""}
    unknown = unspecialized - {n for n, t in sig.items() if t == "i32"}
    if unknown:
        parser.error(f"--unspecialized: {sorted(unknown)} are not integer arguments of "
                     f"{fn.__name__}")
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t == "i32" and n not in unspecialized or t.startswith("*")}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 128),
                          options=dict(num_warps=a.warps, num_stages=a.stages))


def report(a: argparse.Namespace, kernel, registers: int, spill_bytes: int, sass: str) -> None:
    loop_lines = k_loop_lines(sass)
    loop = Counter(opcodes(loop_lines))
    report = dict(kernel=a.kernel, triton=triton.__version__,
                  options={k: v for k, v in vars(a).items() if k not in ("kernel", "dump")},
                  registers=registers, spill_stack_bytes=spill_bytes,
                  shared_bytes=kernel.metadata.shared, k_loop_instructions=sum(loop.values()),
                  k_loop_loads={op: n for op, n in loop.items()
                                if op in ("LDG", "LDGSTS", "UTMALDG", "LDS", "LDL")},
                  k_loop_wgmmas=loop["HGMMA"], l2_prefetches=len(re.findall(r"CCTL\.E\.PF2", sass)),
                  wgmma_hazards=wgmma_hazards(loop_lines, True)
                  + wgmma_hazards(sass.splitlines(), False),
                  k_loop_l2_prefetches=loop["CCTL"])
    print(json.dumps(report))
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for name, text in [("ttgir", kernel.asm["ttgir"]), ("ptx", kernel.asm["ptx"]),
                           ("sass", sass)]:
            with open(os.path.join(a.dump, f"{a.kernel}.{name}"), "w") as f:
                f.write(text)
        with open(os.path.join(a.dump, "k_loop.sass"), "w") as f:
            f.write("\n".join(loop_lines))


if __name__ == "__main__":
    main()

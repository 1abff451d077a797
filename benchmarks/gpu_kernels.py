"""Check and time every Kiln kernel on one GPU, in one run; write JSON and print a table last.

    PYTHONPATH=. python3 benchmarks/gpu_kernels.py --out $OUT/kernels.json
    PYTHONPATH=. python3 benchmarks/gpu_kernels.py --decode-sweep --out $OUT/decode_sweep.json
    PYTHONPATH=. python3 benchmarks/gpu_kernels.py --window-sweep --out $OUT/window_sweep.json

Each kernel's Triton path is compared with its PyTorch reference on fresh random inputs, then
timed with triton.testing.do_bench (median, ms) at the target shapes; the rate is set against the
ceilings measured on the H100 (shared/GPU.md). The attention kernels are also timed over a few
tile configurations, and torch SDPA (flash, cuDNN) on the same problem for comparison.

--decode-sweep runs only decode attention at the short contexts a decode CUDA graph captured with
max_seqlen_k = 4096 sees: the launch policy before partitions followed the real length ("old"),
decode_launch_config ("new") and alternative tiles / split counts / partition floors, each timed
inside a CUDA graph over enough copies of the problem that its K/V come from DRAM, not L2.
--window-sweep does the same for sliding-window layers (GB/s of the window's K/V) under a decode
graph of max_seqlen_k 32768, the policy given the window as the launcher gives it.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time
import traceback
import types

import torch
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

# Load kiln.kernels without running kiln/__init__.py, which pulls in the engine and its
# dependencies: the kernels import only torch and triton, and so does this benchmark.
if "kiln" not in sys.modules:
    _kiln = types.ModuleType("kiln")
    _kiln.__path__ = [
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kiln")
    ]
    sys.modules["kiln"] = _kiln

from kiln.kernels._triton import num_sms
from kiln.kernels.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton
from kiln.kernels.argmax import argmax_rows_ref, argmax_rows_triton
from kiln.kernels.attention import paged_attention_ref
from kiln.kernels.attention_decode import (
    decode_launch_config,
    paged_attention_decode_triton,
)
from kiln.kernels.attention_prefill import paged_attention_prefill_triton, prefill_config
from kiln.kernels.gated_gemm import H100_TILES, GatedTiles, gated_gemm_ref, gated_gemm_triton
from kiln.kernels.rms_norm import rms_norm_ref, rms_norm_triton
from kiln.kernels.rotary import (
    apply_rotary_ref,
    apply_rotary_triton,
    rotary_write_kv_cache_ref,
    rotary_write_kv_cache_triton,
)

COPY_GBPS = 2831.0  # device-to-device copy, read + write (H100, shared/GPU.md)
BF16_TFLOPS = 770.0  # cuBLAS bf16 GEMM 8192^3
DTYPE = torch.bfloat16
DEVICE = "cuda"
SMOKE = False  # --smoke: tiny shapes on CPU under TRITON_INTERPRET=1, to check this script
BF16_TOL = 1e-2  # bf16 outputs: one rounding of 2^-8 relative plus bf16 probabilities
PREFILL_SWEEP = [
    (256, 64, 16, 4), (256, 64, 16, 3), (256, 64, 8, 3), (256, 64, 8, 4), (128, 128, 8, 3),
    (128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 4, 3), (64, 64, 4, 3),
]  # fmt: skip
DECODE_SWEEP = [(128, 4, 2), (64, 4, 3), (32, 4, 3), (128, 4, 3), (64, 4, 2)]

results: list[dict] = []
sweeps: list[dict] = []


def bench_ms(fn) -> float:
    if SMOKE:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    # a long warm-up: the first config timed after another benchmark ran up to 15% slow
    return triton.testing.do_bench(fn, warmup=100, rep=100, return_mode="median")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return (
        float("inf") if not torch.isfinite(out).all() else ((out - ref).norm() / ref.norm()).item()
    )


def record(name, shape, ms, *, gbytes=None, tflop=None, err=None, baseline_ms=None, extra=None):
    row = {"kernel": name, "shape": shape, "dtype": str(DTYPE), "ms": ms, "rel_err": err}
    if gbytes is not None:
        row.update(gb_s=gbytes / (ms * 1e-3), ceiling="copy 2831 GB/s")
        row["ratio"] = row["gb_s"] / COPY_GBPS
    if tflop is not None:
        row.update(tflop_s=tflop / (ms * 1e-3), ceiling="bf16 GEMM 770 TFLOP/s")
        row["ratio"] = row["tflop_s"] / BF16_TFLOPS
    if baseline_ms is not None:
        row["reference_ms"] = baseline_ms
    row["ok"] = err is not None and err <= BF16_TOL
    row.update(extra or {})
    results.append(row)
    print(json.dumps(row), flush=True)


def bench_rms_norm(num_tokens=8192, hidden=4096):
    x, res = (torch.randn(num_tokens, hidden, device=DEVICE, dtype=DTYPE) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(DTYPE)
    for with_res in (True, False):
        r = res if with_res else None
        out = rms_norm_triton(x, weight, 1e-5, r)
        ref = rms_norm_ref(x.float(), weight.float(), 1e-5, None if r is None else r.float())
        if with_res:
            err = max(rel_err(out[0], ref[0]), rel_err(out[1], ref[1]))
        else:
            err = rel_err(out, ref)
        ms = bench_ms(lambda r=r: rms_norm_triton(x, weight, 1e-5, r))
        eager_ms = bench_ms(lambda r=r: rms_norm_ref(x, weight, 1e-5, r))
        tensors = 4 if with_res else 2  # reads x (+ residual), writes out (+ new residual)
        name = "rms_norm+residual" if with_res else "rms_norm"
        gbytes = tensors * x.numel() * x.element_size() / 1e9
        record(name, [num_tokens, hidden], ms, gbytes=gbytes, err=err, baseline_ms=eager_ms)


def bench_silu_and_mul(num_tokens=8192, inter=14336):
    x = torch.randn(num_tokens, 2 * inter, device=DEVICE, dtype=DTYPE)
    err = rel_err(silu_and_mul_triton(x), silu_and_mul_ref(x.float()))
    ms = bench_ms(lambda: silu_and_mul_triton(x))
    eager_ms = bench_ms(lambda: silu_and_mul_ref(x))
    gbytes = 1.5 * x.numel() * x.element_size() / 1e9  # read 2I, write I
    record(
        "silu_and_mul", [num_tokens, 2 * inter], ms, gbytes=gbytes, err=err, baseline_ms=eager_ms
    )


def bench_gated_gemm(num_tokens=8192, hidden=4096, inter=14336, tiles=H100_TILES):
    """The prefill gate/up GEMM with silu(gate) * up in its epilogue, against cuBLAS +
    silu_and_mul (the path it replaces)."""
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=DTYPE)
    w = (torch.randn(2 * inter, hidden, device=DEVICE) / hidden**0.5).to(DTYPE)
    err = rel_err(gated_gemm_triton(x, w, tiles), gated_gemm_ref(x.float(), w.float()))
    ms = bench_ms(lambda: gated_gemm_triton(x, w, tiles))
    unfused_ms = bench_ms(lambda: silu_and_mul(x @ w.t()))
    record("gated_gemm (gate_up + silu)", [num_tokens, hidden, 2 * inter], ms,
           tflop=2 * num_tokens * hidden * 2 * inter / 1e12, err=err, baseline_ms=unfused_ms)


def bench_argmax(rows=1, vocab=128256):
    """Greedy's argmax over float32 logits; exact: the error is the share of rows whose index
    differs from torch.argmax (the reference, and the timed baseline)."""
    logits = torch.randn(rows, vocab, device=DEVICE) * 4
    err = (argmax_rows_triton(logits) != argmax_rows_ref(logits)).float().mean().item()
    ms = bench_ms(lambda: argmax_rows_triton(logits))
    torch_ms = bench_ms(lambda: argmax_rows_ref(logits))
    record("argmax", [rows, vocab], ms, gbytes=logits.numel() * 4 / 1e9, err=err,
           baseline_ms=torch_ms)


def bench_rotary(num_tokens=8192, num_heads=32, num_kv_heads=8, head_dim=128):
    q = torch.randn(num_tokens, num_heads, head_dim, device=DEVICE, dtype=DTYPE)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    positions = torch.randint(0, 8192, (num_tokens,), device=DEVICE)
    angles = torch.rand(8192, head_dim // 2, device=DEVICE) * 6.3
    cache = torch.cat((angles.cos(), angles.sin()), -1)
    q_out, k_out = apply_rotary_triton(q, k, positions, cache)
    q_ref, k_ref = apply_rotary_ref(q.float(), k.float(), positions, cache)
    err = max(rel_err(q_out, q_ref), rel_err(k_out, k_ref))
    ms = bench_ms(lambda: apply_rotary_triton(q, k, positions, cache))
    eager_ms = bench_ms(lambda: apply_rotary_ref(q, k, positions, cache))
    gbytes = 2 * (q.numel() + k.numel()) * q.element_size() / 1e9
    record("rotary", [num_tokens, num_heads, num_kv_heads, head_dim], ms, gbytes=gbytes, err=err,
           baseline_ms=eager_ms)  # fmt: skip


def bench_rotary_kv_cache(num_tokens=8192, num_heads=32, num_kv_heads=8, head_dim=128,
                          block_size=16):
    """The attention front end's one launch: rotary on q and k, k and v into the paged cache."""
    q = torch.randn(num_tokens, num_heads, head_dim, device=DEVICE, dtype=DTYPE)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
            for _ in "kv")
    positions = torch.randint(0, 8192, (num_tokens,), device=DEVICE)
    angles = torch.rand(8192, head_dim // 2, device=DEVICE) * 6.3
    table = torch.cat((angles.cos(), angles.sin()), -1)
    num_blocks = 4 * num_tokens // block_size
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape, device=DEVICE, dtype=DTYPE) for _ in range(2)]
    caches += [c.clone() for c in caches]  # the reference writes into equal copies
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    q_out = rotary_write_kv_cache_triton(q, k, v, positions, table, caches[0], caches[1], slots,
                                         1.0, 1.0)
    q_ref = rotary_write_kv_cache_ref(q, k, v, positions, table, caches[2], caches[3], slots,
                                      1.0, 1.0)
    err = max(rel_err(q_out, q_ref), rel_err(caches[0], caches[2]), rel_err(caches[1], caches[3]))
    ms = bench_ms(lambda: rotary_write_kv_cache_triton(
        q, k, v, positions, table, caches[0], caches[1], slots, 1.0, 1.0))
    eager_ms = bench_ms(lambda: rotary_write_kv_cache_ref(
        q, k, v, positions, table, caches[2], caches[3], slots, 1.0, 1.0))
    gbytes = 2 * (q.numel() + 2 * k.numel()) * q.element_size() / 1e9  # read q, k, v; write all
    record("rotary+write_kv_cache", [num_tokens, num_heads, num_kv_heads, head_dim], ms,
           gbytes=gbytes, err=err, baseline_ms=eager_ms)  # fmt: skip


def paged_problem(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size=16):
    """Random q and caches with each sequence's pages scattered over a shuffled pool."""
    pages = [triton.cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(pages)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    perm = torch.randperm(num_blocks, device=DEVICE).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device=DEVICE)
    start = 0
    for b, n in enumerate(pages):
        block_tables[b, :n] = perm[start : start + n]
        start += n
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=DEVICE, dtype=DTYPE)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, cu.to(DEVICE), seq, block_tables, max(q_lens), max(seq_lens))
    return args, head_dim**-0.5


def dense_kv(args):
    """The same K/V gathered into contiguous [B, H_kv, L, D] tensors (equal lengths only)."""
    q, k_cache, v_cache, _, seq, block_tables, _, max_k = args
    k = k_cache[block_tables.long()].flatten(1, 2)[:, :max_k].transpose(1, 2).contiguous()
    v = v_cache[block_tables.long()].flatten(1, 2)[:, :max_k].transpose(1, 2).contiguous()
    return k, v


def time_sdpa(q, k, v, backend, **kwargs):
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        with sdpa_kernel(backend):
            sdpa(q, k, v, **kwargs)
            return bench_ms(lambda: sdpa(q, k, v, **kwargs))
    except Exception as exc:  # a backend may not support the shape here
        print(f"sdpa {backend}: {exc!r}", flush=True)
        return None


def bench_prefill(batch=4, seq_len=4096, num_heads=32, num_kv_heads=8, head_dim=128, page=16,
                  new_kv=True):
    """Full-length causal prefill. new_kv: the new K/V passed as k_new / v_new, as the engine
    does in 16-bit; otherwise every key read back from the pages (the fp8-cache path)."""
    args, scale = paged_problem([seq_len] * batch, [seq_len] * batch, num_heads, num_kv_heads,
                                head_dim, page)  # fmt: skip
    ref = paged_attention_ref(*args, scale)
    k_dense, v_dense = dense_kv(args)  # [B, H_kv, L, D]
    kwargs = {}
    if new_kv:
        kwargs = {name: t.transpose(1, 2).reshape(batch * seq_len, num_kv_heads, head_dim)
                  for name, t in (("k_new", k_dense), ("v_new", v_dense))}  # fmt: skip
    tflop = 4 * batch * num_heads * seq_len * seq_len * head_dim / 2 / 1e12  # causal half
    default = prefill_config(head_dim, seq_len, DTYPE, new_kv)
    best = None
    for config in [default] + [c for c in PREFILL_SWEEP if c != default]:
        try:
            out = paged_attention_prefill_triton(*args, scale, **kwargs, config=config)
            err = rel_err(out, ref)
            ms = bench_ms(lambda c=config: paged_attention_prefill_triton(*args, scale, **kwargs,
                                                                          config=c))
        except Exception as exc:
            print(f"prefill config {config}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        sweeps.append({"kernel": "prefill", "batch": batch, "seq_len": seq_len,
                       "head_dim": head_dim, "page": page, "new_kv": new_kv,
                       "config": config, "ms": ms, "tflop_s": tflop / (ms * 1e-3),
                       "rel_err": err})  # fmt: skip
        print(json.dumps(sweeps[-1]), flush=True)
        if config == default:
            main = (ms, err)
        if best is None or ms < best[1]:
            best = (config, ms, err)
    q = args[0].view(batch, seq_len, num_heads, head_dim).transpose(1, 2)
    k, v = (t.repeat_interleave(num_heads // num_kv_heads, 1) for t in (k_dense, v_dense))
    # the headline is the default config (what the engine runs); the sweep's best beside it
    extra = {"config": default, "best_sweep_config": best[0],
             "best_sweep_tflop_s": tflop / (best[1] * 1e-3)}  # fmt: skip
    for label, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ):
        sdpa_ms = time_sdpa(q, k, v, backend, is_causal=True)
        extra[f"sdpa_{label}_tflop_s"] = None if sdpa_ms is None else tflop / (sdpa_ms * 1e-3)
    shape = [batch, seq_len, num_heads, num_kv_heads, head_dim]
    name = (f"prefill_causal_d{head_dim}" + ("" if new_kv else "_from_pages")
            + ("" if page == 16 else f"_page{page}")
            + ("" if (batch, seq_len) == (4, 4096) else f"_{batch}x{seq_len}"))  # fmt: skip
    record(name, shape, main[0], tflop=tflop, err=main[1], extra=extra)


def bench_decode(batch, ctx, num_heads=32, num_kv_heads=8, head_dim=128, page=16, sweep=True):
    args, scale = paged_problem([ctx] * batch, [1] * batch, num_heads, num_kv_heads, head_dim, page)
    ref = paged_attention_ref(*args, scale)
    gbytes = 2 * batch * ctx * num_kv_heads * head_dim * 2 / 1e9  # K and V, read once
    # the headline is what the engine runs: decode_launch_config's tiles with its split count
    default = decode_launch_config(batch, num_kv_heads, ctx, num_sms(torch.device(DEVICE)))[:3]
    configs = [default] + [c for c in DECODE_SWEEP if c != default] if sweep else [default]
    best = None
    for config in configs:
        for splits in (None, 1, 4, 8):
            kw = {"config": config, "num_splits": splits}
            try:
                out = paged_attention_decode_triton(*args, scale, **kw)
                err = rel_err(out, ref)
                ms = bench_ms(lambda kw=kw: paged_attention_decode_triton(*args, scale, **kw))
            except Exception as exc:
                print(f"decode {kw}: {exc!r}", flush=True)
                continue
            row = {"kernel": f"decode_b{batch}_ctx{ctx}", "page": page, **kw, "ms": ms,
                   "gb_s": gbytes / (ms * 1e-3), "rel_err": err}  # fmt: skip
            sweeps.append(row)
            print(json.dumps(row), flush=True)
            if splits is None and config == default:
                main = (ms, err)
            if best is None or ms < best[1]:
                best = (kw, ms)
    q = args[0].view(batch, 1, num_heads, head_dim).transpose(1, 2)
    k, v = dense_kv(args)  # GQA in SDPA itself, so that it reads the same K/V bytes
    sdpa_ms = time_sdpa(q, k, v, SDPBackend.FLASH_ATTENTION, enable_gqa=True)
    sdpa_gbs = None if sdpa_ms is None else gbytes / (sdpa_ms * 1e-3)
    extra = {"config": default, "num_splits": "auto", "sdpa_flash_dense_gb_s": sdpa_gbs,
             "best_sweep": best[0], "best_sweep_gb_s": gbytes / (best[1] * 1e-3)}  # fmt: skip
    shape = [batch, ctx, num_heads, num_kv_heads, head_dim]
    name = f"decode_b{batch}_ctx{ctx}" + ("" if page == 16 else f"_page{page}")
    record(name, shape, main[0], gbytes=gbytes, err=main[1], extra=extra)


def bench_decode_window(batch=64, ctx=8192, window=4096, num_heads=32, num_kv_heads=8,
                        head_dim=128):
    """A sliding-window layer's decode (Mistral's 4096 keys) over a longer context: it reads its
    window's K/V alone; the whole context's decode is the timed baseline."""
    args, scale = paged_problem([ctx] * batch, [1] * batch, num_heads, num_kv_heads, head_dim)
    err = rel_err(paged_attention_decode_triton(*args, scale, window=window),
                  paged_attention_ref(*args, scale, window=window))
    ms = bench_ms(lambda: paged_attention_decode_triton(*args, scale, window=window))
    full_ms = bench_ms(lambda: paged_attention_decode_triton(*args, scale))
    gbytes = 2 * batch * min(window, ctx) * num_kv_heads * head_dim * 2 / 1e9  # the window's K/V
    record(f"decode_window{window}_b{batch}_ctx{ctx}",
           [batch, ctx, num_heads, num_kv_heads, head_dim], ms, gbytes=gbytes, err=err,
           baseline_ms=full_ms)


# --decode-sweep: real contexts under the max_seqlen_k a decode CUDA graph is captured with (the
# engine's default max_model_len), then eager-shaped big-batch guards (max_seqlen_k = the context)
# that are already near the copy ceiling and must not get slower
SWEEP_BATCHES = (1, 8, 64)
SWEEP_CONTEXTS = (128, 256, 512, 1024)
SWEEP_MAX_SEQLEN_K = 4096
SWEEP_GUARDS = ((64, 1024), (8, 16384))
# --window-sweep: sliding-window layers (batch, context, window) under a Mistral-length decode
# graph; the eager suite rows of batch 1-8 are host-bound (results/h100/gpu_check_ced70c2.txt)
WINDOW_SWEEP = ((1, 16384, 4096), (8, 16384, 4096), (8, 8192, 1024), (64, 8192, 4096))
WINDOW_SWEEP_MAX_SEQLEN_K = 32768
# (BLOCK_N, num_warps, num_stages, times the policy's split count, min partition in tiles)
DECODE_ALTERNATIVES = [
    (128, 4, 2, 1, 1), (64, 4, 2, 1, 1), (32, 4, 2, 1, 1), (64, 2, 2, 1, 1), (64, 8, 2, 1, 1),
    (64, 4, 3, 1, 1), (64, 4, 2, 2, 1), (64, 4, 2, 4, 1), (64, 4, 2, 1, 2), (128, 4, 2, 2, 1),
    (64, 2, 3, 1, 1), (64, 2, 4, 1, 1), (32, 2, 2, 1, 1), (32, 2, 3, 1, 1), (32, 2, 4, 1, 1),
    (64, 2, 2, 2, 1), (128, 2, 2, 1, 1), (128, 8, 3, 1, 1),
    (64, 2, 1, 1, 1), (64, 4, 1, 1, 1), (32, 2, 1, 1, 1), (128, 4, 1, 1, 1), (64, 1, 2, 1, 1),
    (32, 1, 2, 1, 1), (32, 1, 3, 1, 1),
]  # fmt: skip
# a graph cycles through this many L2 sizes of K/V, so that each call reads them from DRAM as a
# real step does (a whole model's weights pass through L2 between two reads of a layer's cache)
L2_COPIES = 4
OLD_DECODE_CONFIG = (128, 4, 2)
MAX_COPIES = 256


def old_decode_launch(num_seqs: int, num_kv_heads: int, max_seqlen_k: int, sms: int) -> dict:
    """The sweep's baseline, the policy before partitions followed the real length: tiles of
    128 keys, 4 warps, ~2 programs per SM, every partition max_seqlen_k / num_splits keys (at
    least 256) long."""
    programs = max(num_seqs * num_kv_heads, 1)
    splits = max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(max_seqlen_k, 256)))
    block_n = OLD_DECODE_CONFIG[0]
    partition_len = triton.cdiv(triton.cdiv(max_seqlen_k, splits), block_n) * block_n
    return {"config": OLD_DECODE_CONFIG, "num_splits": triton.cdiv(max_seqlen_k, partition_len),
            "min_partition_len": partition_len}  # fmt: skip


def launch_label(kw: dict) -> str:
    """BLOCK_N/num_warps w num_stages s x num_splits p min_partition_len, e.g. 64/4w2s x16 p64."""
    block_n, num_warps, num_stages = kw["config"]
    return f"{block_n}/{num_warps}w{num_stages}s x{kw['num_splits']} p{kw['min_partition_len']}"


def decode_settings(num_seqs: int, num_kv_heads: int, max_keys: int, sms: int) -> dict:
    """Name -> paged_attention_decode_triton kwargs: old, new (decode_launch_config, one-tile
    partitions) and the alternatives that differ from both. ``max_keys``: what the launcher
    passes the policy, max_seqlen_k or a sliding window's width if smaller."""
    policy = decode_launch_config(num_seqs, num_kv_heads, max_keys, sms)
    settings = {
        "old": old_decode_launch(num_seqs, num_kv_heads, max_keys, sms),
        "new": {"config": tuple(policy[:3]), "num_splits": policy.num_splits,
                "min_partition_len": policy.block_n},
    }  # fmt: skip
    for block_n, num_warps, num_stages, times, tiles in DECODE_ALTERNATIVES:
        kw = {"config": (block_n, num_warps, num_stages), "num_splits": policy.num_splits * times,
              "min_partition_len": block_n * tiles}  # fmt: skip
        if kw not in settings.values():
            settings[launch_label(kw)] = kw
    return settings


def graph_us(calls: list) -> float:
    """Microseconds per call of `calls` captured back to back in one CUDA graph, as the engine
    replays a decode step: median of 5 timed batches of replays (~5 ms each)."""
    if SMOKE:
        return bench_ms(lambda: [call() for call in calls]) * 1e3 / len(calls)
    for call in calls:  # compile, and size the caching allocator, outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def replay_ms(replays: int) -> float:
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    replays = max(1, min(1000, round(5 / max(replay_ms(1), 1e-3))))
    per_replay = sorted(replay_ms(replays) / replays for _ in range(5))[2]
    return per_replay * 1e3 / len(calls)


def bench_decode_sweep(
    batch: int, ctx: int, max_seqlen_k: int, num_heads: int = 32, num_kv_heads: int = 8,
    head_dim: int = 128, page: int = 16, window: int | None = None,
) -> None:  # fmt: skip
    """Decode at a real context `ctx` under `max_seqlen_k`, every setting of decode_settings;
    with a `window`, a sliding-window layer's, counting the window's K/V."""
    keys = ctx if window is None else min(ctx, window)
    kv_bytes = 2 * batch * keys * num_kv_heads * head_dim * DTYPE.itemsize  # one call's K and V
    copies = 1
    if not SMOKE:
        l2_bytes = torch.cuda.get_device_properties(DEVICE).L2_cache_size
        copies = min(MAX_COPIES, triton.cdiv(L2_COPIES * l2_bytes, kv_bytes))
    num_seqs = batch * copies  # `copies` batches over disjoint pages of one cache
    args, scale = paged_problem([ctx] * num_seqs, [1] * num_seqs, num_heads, num_kv_heads,
                                head_dim, page)  # fmt: skip
    q, k_cache, v_cache, _, seq_lens, block_tables, _, _ = args
    # as wide as a decode graph's block table (entries past the context are never read)
    block_tables = torch.nn.functional.pad(
        block_tables, (0, triton.cdiv(max_seqlen_k, page) - block_tables.shape[1])
    )
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)  # one query each
    problems = [
        (q[i * batch : (i + 1) * batch], k_cache, v_cache, cu_seqlens_q, seq_lens[:batch],
         block_tables[i * batch : (i + 1) * batch], 1, max_seqlen_k)
        for i in range(copies)
    ]  # fmt: skip
    ref = paged_attention_ref(*problems[0], scale, window=window)
    max_keys = max_seqlen_k if window is None else min(max_seqlen_k, window)
    for name, kw in decode_settings(batch, num_kv_heads, max_keys, num_sms(q.device)).items():
        kw = {**kw, "window": window}
        try:
            err = rel_err(paged_attention_decode_triton(*problems[0], scale, **kw), ref)
            us = graph_us([
                functools.partial(paged_attention_decode_triton, *p, scale, **kw) for p in problems
            ])  # fmt: skip
        except Exception as exc:
            print(f"decode sweep b{batch} ctx{ctx} {name}: {exc!r}", flush=True)
            continue
        row = {"kernel": "decode_sweep", "batch": batch, "ctx": ctx, "max_seqlen_k": max_seqlen_k,
               "setting": name, "launch": launch_label(kw), **kw, "us": us,
               "gb_s": kv_bytes / (us * 1e3), "rel_err": err, "ok": err <= BF16_TOL,
               "copies": copies}  # fmt: skip
        sweeps.append(row)
        print(json.dumps(row), flush=True)


def print_decode_sweep() -> None:
    """One line per case: old and new policy, and the fastest setting whose error is in bounds."""
    cases: dict[tuple[int, int, int, int | None], list[dict]] = {}
    for r in sweeps:
        cases.setdefault((r["batch"], r["ctx"], r["max_seqlen_k"], r["window"]), []).append(r)
    print("decode attention, us per call in a CUDA graph (K/V from DRAM); launch = "
          "BLOCK_N/num_warps num_stages x num_splits p min partition len")  # fmt: skip
    print(f"{'batch':>5}{'ctx':>7}{'max_k':>7}{'window':>7}{'old us':>9}{'new us':>9}{'new/old':>9}"
          f"  {'new launch':<22}{'best us':>9}  {'best':<22}all ok")  # fmt: skip
    nan = {"us": float("nan"), "launch": "-", "setting": "-"}  # a setting that failed to run
    for (batch, ctx, max_k, window), rows in cases.items():
        by_name = {r["setting"]: r for r in rows}
        old, new = by_name.get("old", nan), by_name.get("new", nan)
        good = [r for r in rows if r["ok"]]
        best = min(good, key=lambda r: r["us"]) if good else nan
        print(f"{batch:>5}{ctx:>7}{max_k:>7}{window or '-':>7}{old['us']:9.1f}{new['us']:9.1f}"
              f"{new['us'] / old['us']:9.2f}  {new['launch']:<22}{best['us']:9.1f}  "
              f"{best['setting']:<22}{len(good) == len(rows)}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernels.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run under the interpreter")
    parser.add_argument(
        "--decode-sweep",
        action="store_true",
        help="only decode attention: launch policies at short contexts, in graphs",
    )
    parser.add_argument(
        "--window-sweep", action="store_true",
        help="only sliding-window decode attention, every launch setting, in graphs",
    )  # fmt: skip
    parser.add_argument(
        "--sweep-cases", default=None,
        help="the decode sweep's cases as BATCH:CONTEXT,... (max_seqlen_k 4096); default: all",
    )  # fmt: skip
    opts = parser.parse_args()
    global DEVICE, DTYPE, SMOKE
    if opts.smoke:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run --smoke with TRITON_INTERPRET=1"
        DEVICE, DTYPE, SMOKE = "cpu", torch.float16, True
    torch.manual_seed(int(datetime.datetime.now().timestamp()))  # fresh inputs every run
    steps = [
        bench_rms_norm, bench_silu_and_mul, bench_gated_gemm, bench_rotary,
        bench_rotary_kv_cache, bench_argmax, lambda: bench_argmax(64), bench_prefill,
        lambda: bench_prefill(new_kv=False), lambda: bench_prefill(page=64, new_kv=False),
        lambda: bench_prefill(16, 512), lambda: bench_prefill(16, 512, new_kv=False),
        lambda: bench_prefill(head_dim=64, num_heads=32, num_kv_heads=32),
        lambda: bench_decode(64, 1024), lambda: bench_decode(8, 16384),
        lambda: bench_decode(64, 1024, page=64, sweep=False),
        lambda: bench_decode(8, 16384, page=64, sweep=False),
        bench_decode_window, lambda: bench_decode_window(8, 16384),
    ]  # fmt: skip
    if SMOKE:
        steps = [
            lambda: bench_rms_norm(5, 64), lambda: bench_silu_and_mul(5, 64),
            lambda: bench_gated_gemm(40, 64, 40, GatedTiles(32, 32, 32, 2, 4, 2)),
            lambda: bench_argmax(3, 5000),
            lambda: bench_rotary(5, 4, 2, 64), lambda: bench_rotary_kv_cache(5, 4, 2, 64),
            lambda: bench_prefill(2, 40, 4, 2, 64), lambda: bench_prefill(2, 40, 4, 2, 64,
                                                                          new_kv=False),
            lambda: bench_decode(3, 100, 4, 1, 64),
            lambda: bench_decode(3, 100, 4, 1, 64, page=64, sweep=False),
            lambda: bench_decode_window(3, 100, 40, 4, 1, 64),
        ]  # fmt: skip
    if opts.decode_sweep:
        cases = [(b, ctx, SWEEP_MAX_SEQLEN_K) for b in SWEEP_BATCHES for ctx in SWEEP_CONTEXTS]
        cases += [(b, ctx, ctx) for b, ctx in SWEEP_GUARDS]
        if opts.sweep_cases:
            cases = [(*map(int, c.split(":")), SWEEP_MAX_SEQLEN_K)
                     for c in opts.sweep_cases.split(",")]
        shape = {}
        if SMOKE:  # the interpreter's 8 nominal SMs: 1 and 2 pairs split, 8 do not
            cases, shape = [(1, 17, 1024), (2, 100, 1024), (8, 40, 40)], {"num_heads": 4,
                            "num_kv_heads": 1, "head_dim": 64}  # fmt: skip
        steps = [lambda c=c: bench_decode_sweep(*c, **shape) for c in cases]
    if opts.window_sweep:
        cases = [(b, ctx, WINDOW_SWEEP_MAX_SEQLEN_K, w) for b, ctx, w in WINDOW_SWEEP]
        shape = {}
        if SMOKE:
            cases, shape = [(1, 100, 1024, 40), (8, 70, 1024, 16)], {"num_heads": 4,
                            "num_kv_heads": 1, "head_dim": 64}  # fmt: skip
        steps = [lambda c=c: bench_decode_sweep(*c[:3], window=c[3], **shape) for c in cases]
    errors = []
    for step in steps:
        try:
            step()
        except Exception:
            errors.append(traceback.format_exc())
            print(errors[-1], file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
    report = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "PYTHONPATH=. python3 " + " ".join(sys.argv),
        "ceilings": {"copy_gb_s": COPY_GBPS, "bf16_gemm_tflop_s": BF16_TFLOPS},
        "results": results,
        "sweeps": sweeps,
        "errors": errors,
    }
    with open(opts.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{report['device']}  torch {report['torch']}  triton {report['triton']}")
    if opts.decode_sweep or opts.window_sweep:
        print_decode_sweep()
    else:
        print_results()
    print(f"{len(errors)} step(s) failed" if errors else "all steps ran")


def print_results() -> None:
    print(f"{'kernel':<22}{'ms':>9}{'rate':>16}{'of ceiling':>12}{'rel err':>10}  ok")
    for r in results:
        rate = f"{r['gb_s']:.0f} GB/s" if "gb_s" in r else f"{r['tflop_s']:.0f} TFLOP/s"
        ref = f"  eager {r['reference_ms']:.3f} ms" if "reference_ms" in r else ""
        sdpa = {
            k: round(v)
            for k, v in r.items()
            if k.startswith(("sdpa", "best_sweep_")) and isinstance(v, float)
        }
        print(f"{r['kernel']:<22}{r['ms']:9.3f}{rate:>16}{r['ratio']:12.1%}{r['rel_err']:10.1e}"
              f"  {r['ok']}{ref} {sdpa or ''}")  # fmt: skip


if __name__ == "__main__":
    main()

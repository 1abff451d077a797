"""Helpers shared by the kernel tests: error measure, GPU marker, paged KV fixtures, the sm_90
compile report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kiln.kernels._triton import HAS_TRITON

# bf16 is wrong under the Triton interpreter (fp16 and fp32 are right): see shared/GPU.md
INTERPRET_DTYPES = [torch.float32, torch.float16]
has_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
# The cases not marked @gpu run the kernels under the Triton interpreter on CPU tensors (conftest
# turns it on where no GPU is visible). Where one is, Triton compiles for it and cannot read CPU
# tensors, so they are skipped there: the @gpu cases run the kernels on the GPU instead.
_COMPILED = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or _COMPILED,
    reason="triton is not installed" if not HAS_TRITON else
    "an interpreter case on CPU tensors; with a GPU visible run it as CUDA_VISIBLE_DEVICES= pytest",
)


SM90_COMPILE = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks",
                            "sm90_compile.py")


def sm90_compile_report(*args: str, timeout: int = 300) -> dict:
    """benchmarks/sm90_compile.py's JSON report for these arguments, run as a user would (it
    turns the interpreter off itself); it must succeed."""
    run = subprocess.run([sys.executable, SM90_COMPILE, *args], capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def gpu(fn):
    """Mark a test as GPU-only: deselected by `-m 'not gpu'`, skipped cleanly without CUDA."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.gpu(skip(has_triton(fn)))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf if out has a NaN or Inf."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = rel_err(out, ref)
    if not err <= tol:
        diff = (out.double() - ref.double()).abs().nan_to_num(float("inf"))
        where = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(
            f"{what}: relative error {err:.3g} > {tol:g}; worst at {where}: "
            f"{out[where].item():.6g} vs {ref[where].item():.6g}"
        )


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
    gen: torch.Generator,
    spare_blocks: int = 3,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense K/V per sequence, scattered into shuffled pages of random-filled caches.

    Returns (ks, vs, k_cache, v_cache, block_tables): ks[b] is [seq_lens[b], H_kv, D]. Pages not
    owned by a sequence hold noise, and block-table padding is 0 (a real page of another
    sequence), so a kernel that reads the wrong page or past the end gets a wrong answer.
    """
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(pages) + 2, dtype=torch.int32)
    ks, vs, used = [], [], 0
    for b, n in enumerate(seq_lens):
        ids = perm[used : used + pages[b]]
        used += pages[b]
        block_tables[b, : pages[b]] = ids.to(torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        k_cache.view(-1, num_kv_heads, head_dim)[_slots(ids, n, block_size)] = k
        v_cache.view(-1, num_kv_heads, head_dim)[_slots(ids, n, block_size)] = v
        ks.append(k.to(device))
        vs.append(v.to(device))
    return ks, vs, k_cache.to(device), v_cache.to(device), block_tables.to(device)


def set_cache_nan(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq: int, positions: range) -> None:
    """NaN into the cache slots of sequence ``seq`` at ``positions``: a kernel that reads them
    (a NaN key or value reaches the output even where its score is masked) returns NaN."""
    block_size = k_cache.shape[1]
    pos = torch.arange(positions.start, positions.stop, device=k_cache.device)
    blocks = block_tables[seq, pos // block_size].long()
    k_cache[blocks, pos % block_size] = float("nan")
    v_cache[blocks, pos % block_size] = float("nan")


def poison_outside_window(k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, q_lens: list[int], seq_lens: list[int],
                          window: int, tile: int) -> None:
    """NaN into every cached key in the whole ``tile``-key tiles before the one holding the first
    key that a sequence's first query sees (position seq_len - q_len - window + 1): the tiles a
    windowed kernel with tiles of ``tile`` keys (or of a divisor of it) must skip, not mask."""
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        first_seen = max(0, seq_len - q_len - window + 1)
        set_cache_nan(k_cache, v_cache, block_tables, b, range(first_seen // tile * tile))


def _slots(block_ids: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    offsets = torch.arange(block_size)
    return (block_ids[:, None] * block_size + offsets[None, :]).flatten()[:n]


def naive_attention(
    qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor], scale: float,
    window: int | None = None, rows_per_chunk: int = 1024,
) -> torch.Tensor:
    """Dense causal attention per sequence in float64; q is the last q_len positions. With a
    sliding ``window`` the query at p sees keys p - window < k <= p (transformers'
    sliding_window_overlay). Queries go ``rows_per_chunk`` at a time, so that an 8k-token prompt's
    float64 scores fit a GPU."""
    outs = []
    for q, k, v in zip(qs, ks, vs, strict=True):
        q_len, num_heads, _ = q.shape
        kv_len, num_kv_heads, _ = k.shape
        group = num_heads // num_kv_heads
        k64 = k.double().repeat_interleave(group, dim=1)  # [kv_len, H, D]
        v64 = v.double().repeat_interleave(group, dim=1)
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        for start in range(0, q_len, rows_per_chunk):
            rows = q[start:start + rows_per_chunk]
            scores = torch.einsum("qhd,khd->hqk", rows.double(), k64) * scale
            q_pos = torch.arange(kv_len - q_len + start, kv_len - q_len + start + rows.shape[0],
                                 device=q.device)[:, None]
            visible = k_pos <= q_pos
            if window is not None:
                visible &= k_pos > q_pos - window
            scores = scores.masked_fill(~visible, float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v64))
    return torch.cat(outs)

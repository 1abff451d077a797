"""Greedy decoding's argmax over the vocabulary, per row of float logits, with torch's rules.

    ids[r] = the first index of the largest logits[r, :], NaN counting as larger than anything
             (the first NaN wins), as ``torch.argmax(logits, dim=-1)``

torch's reduction runs a single row through one thread block: 41 us for a 128k vocabulary on an
H100, where these two passes take 7 (benchmarks/results/h100/argmax.txt). Two passes:
CHUNK-wide pieces of every row in parallel, each leaving its best (value, index), then one
program per row picks among them. Both launch with PDL, as the kernels around them do.
"""

from __future__ import annotations

import torch

from kiln.kernels._triton import next_power_of_2, pdl, tl, triton, use_triton, wait_for_inputs

CHUNK = 4096  # logits per program of the first pass (16 KB of float32: one load per thread)


@triton.jit
def _best(vals, idx, n):
    """(value, index) of the first maximum of ``vals``, NaN > everything; lanes with idx >= n
    are padding. Returns NaN as the value when a NaN won."""
    valid = idx < n
    nan = (vals != vals) & valid
    first_nan = tl.min(tl.where(nan, idx, n), axis=0)
    key = tl.where(valid, vals, float("-inf"))
    top = tl.max(key, axis=0)
    first_top = tl.min(tl.where(valid & (key == top), idx, n), axis=0)
    has_nan = first_nan < n
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, first_nan, first_top)


@triton.jit
def _argmax_chunks_kernel(x_ptr, part_val_ptr, part_idx_ptr, n_cols, stride_x, num_chunks,
                          BLOCK: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    vals = tl.load(x_ptr + row * stride_x + idx, mask=idx < n_cols, other=float("-inf"))
    best, best_idx = _best(vals.to(tl.float32), idx, n_cols)
    tl.store(part_val_ptr + row * num_chunks + chunk, best)
    tl.store(part_idx_ptr + row * num_chunks + chunk, best_idx)


@triton.jit
def _argmax_rows_kernel(part_val_ptr, part_idx_ptr, out_ptr, n_cols, num_chunks,
                        BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = c < num_chunks
    vals = tl.load(part_val_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * num_chunks + c, mask=mask, other=n_cols)
    # chunks are in index order, so the first best chunk holds the first best index; a chunk
    # that only held padding reports index n_cols and never wins
    _, best_chunk = _best(vals, tl.where(idx < n_cols, c, BLOCK_C), BLOCK_C)
    best_idx = tl.sum(tl.where(c == best_chunk, idx, 0), axis=0)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


def argmax_rows_triton(logits: torch.Tensor) -> torch.Tensor:
    """Launch both passes (CUDA, or CPU under TRITON_INTERPRET=1): logits [R, V] -> int64 [R]."""
    assert logits.dim() == 2 and logits.stride(1) == 1
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    assert n > 0, "argmax of an empty row"
    block = min(CHUNK, next_power_of_2(n))
    chunks = triton.cdiv(n, block)
    part_val = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    _argmax_chunks_kernel[(rows, chunks)](
        logits, part_val, part_idx, n, logits.stride(0), chunks, BLOCK=block, num_warps=4,
        **pdl(logits.device))
    _argmax_rows_kernel[(rows,)](
        part_val, part_idx, out, n, chunks, BLOCK_C=next_power_of_2(chunks), num_warps=1,
        **pdl(logits.device))
    return out


def argmax_rows_ref(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the last dim (the CPU path and the test oracle)."""
    return logits.argmax(dim=-1)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """First index of the maximum of each row of logits [R, V] (NaN wins) -> int64 [R]."""
    if use_triton(logits) and logits.dim() == 2 and logits.stride(1) == 1:
        return argmax_rows_triton(logits)
    return argmax_rows_ref(logits)

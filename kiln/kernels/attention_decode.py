"""Decode attention (one query token per sequence) over the paged KV cache, split-KV.

Flash-decoding: the grid has num_splits programs per (sequence, kv head), and each sequence's
real context is cut into partitions of whole BLOCK_N tiles, one program each, so that a small
batch still fills the GPU. Each program loads every K/V tile of its kv head once and scores it
against all GROUP = num_heads / num_kv_heads query heads that share it (a
[GROUP, HEAD_DIM] x [HEAD_DIM, BLOCK_N] product, GROUP padded to 16 rows for the tensor cores).
A partition leaves its normalized output o_s and log-sum-exp lse_s (base 2); the second pass
combines them exactly:

    out = sum_s w_s o_s,    w_s = 2^(lse_s - max lse) / sum_s' 2^(lse_s' - max lse)

num_splits is a host choice (fixed when a CUDA graph is captured, with max_seqlen_k at the model's
maximum length), but the partition length is computed in the kernel from the sequence's real
length: a short context is spread over as many splits as it has tiles, a long one over all of
them, and the splits it does not need exit at once. With a single split (DIRECT) the first pass
writes the output directly and no second pass runs.

A sliding-window layer (the query at p sees keys p - window < k <= p) partitions only the keys
from the tile that holds the window's first one, max(0, seq_len - window) rounded down to BLOCK_N:
a long context reads its window's K/V and nothing before it. Only that first tile is masked
below: it is the first partition's first tile, always masked, and holds the window's first key,
so that every partition sees at least one key.

Under PDL a program loads its first tile's cached K/V before waiting for the kernel before it,
which writes only this step's K/V (the newest position, loaded after the wait): at batch 1 a
partition is often that single tile, so its reads overlap the previous kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kiln.kernels._triton import next_power_of_2, num_sms, pdl, tl, triton, wait_for_inputs
from kiln.kernels.attention_prefill import (
    LOG2E,
    _attn_tile,
    _dot,
    _kv_tile_ptrs,
    _tile_softmax,
    attention_output,
    check_attention_args,
    window_args,
)

# (BLOCK_N, num_warps, num_stages); tuned on an H100 (benchmarks/gpu_kernels.py --decode-sweep,
# benchmarks/results/h100/decode_sweep.txt). From one (sequence, kv head) pair per SM up to
# LARGE_BATCH_PROGRAMS_PER_SM of them, 4 warps and no software pipeline: the K/V tiles go
# straight to registers and several programs an SM hide each other's loads (64 x 512 keys: 49.5
# us against 51.1 for 64/2w2s, 64 x 768: 71.6 against 72.9); with more pairs (512 x 8 kv heads,
# 640 keys) 64/2w2s stays ahead, 458.9 us against 460.8. With fewer pairs than SMs a partition
# is often a single tile, and a smaller tile lets a short context spread over more programs.
DECODE_CONFIG = (64, 4, 1)
LARGE_BATCH_CONFIG = (64, 2, 2)
LARGE_BATCH_PROGRAMS_PER_SM = 8
SMALL_BATCH_CONFIG = (64, 4, 2)
# at most TINY_BATCH_PROGRAMS pairs (batch 1 or 2 with 8 kv heads): 32-key tiles, the sweep's best
# at 128-512 tokens of context (batch 1, 256 tokens: 7.2 us against 8.0 with 64-key tiles)
TINY_BATCH_CONFIG = (32, 4, 2)
TINY_BATCH_PROGRAMS = 16
# at full length (max_seqlen_k keys) shorter partitions cost more in the reduction than they win
# in overlap; a shorter real context still goes down to one tile per partition
MIN_PARTITION_LEN = 256
PROGRAMS_PER_SM = 2  # the split count aims at this many programs per SM at full length


class DecodeLaunch(NamedTuple):
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int


def decode_launch_config(
    num_seqs: int, num_kv_heads: int, max_seqlen_k: int, sms: int
) -> DecodeLaunch:
    """Tile config and split count for a decode launch, from host ints only.

    The result is baked into a CUDA graph captured with max_seqlen_k = max_model_len, so it must
    not read a tensor. The split count gives ~PROGRAMS_PER_SM programs per SM at full length with
    partitions of at least MIN_PARTITION_LEN keys (the previous policy, unchanged). What makes a
    short context fast is that the kernel sizes partitions from the real length, down to one
    BLOCK_N tile: with fewer (sequence, kv head) pairs than SMs the tile is SMALL_BATCH_CONFIG's
    64 keys (TINY_BATCH_CONFIG's 32 for a handful of pairs), so that a 256-token context at batch
    1 (8 kv heads) runs 64 one-tile programs instead of 8 two-tile ones. With at least one pair
    per SM, DECODE_CONFIG (LARGE_BATCH_CONFIG from LARGE_BATCH_PROGRAMS_PER_SM pairs an SM):
    every SM already has a pair to work on (at 64 x 8 pairs there is one split and no
    reduction, as before).
    """
    programs = max(num_seqs * num_kv_heads, 1)
    block_n, num_warps, num_stages = (
        LARGE_BATCH_CONFIG if programs >= LARGE_BATCH_PROGRAMS_PER_SM * sms
        else DECODE_CONFIG if programs >= sms
        else TINY_BATCH_CONFIG if programs <= TINY_BATCH_PROGRAMS else SMALL_BATCH_CONFIG)
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, programs)
    num_splits = max(1, min(wanted, triton.cdiv(max_seqlen_k, MIN_PARTITION_LEN)))
    return DecodeLaunch(block_n, num_warps, num_stages, num_splits)


@triton.jit
def _partitions(seq_len, window, num_splits, min_partition_len, block_n, SLIDING: tl.constexpr):
    """Where a sequence's partitions start (the tile of its window's first key; 0 without a
    window) and how many keys each holds: the keys from there over the splits, in whole tiles
    (so that only the last partition has a ragged tile), never under min_partition_len. Both
    passes call this, so the reduction reads exactly the partitions that ran."""
    kv_start = 0
    if SLIDING:
        kv_start = (tl.maximum(seq_len - window, 0) // block_n) * block_n
    per_split = tl.cdiv(tl.cdiv(seq_len - kv_start, num_splits), block_n) * block_n
    return kv_start, tl.maximum(per_split, min_partition_len)


# these ints change with batch and context length (the window from layer to layer): no
# per-value specialization, so a new step shape never triggers a compile while serving
@triton.jit(do_not_specialize=["stride_bt", "min_partition_len", "num_splits", "window"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    qk_scale, min_partition_len, num_heads, num_splits, window,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, SLIDING: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # kv heads fastest in the grid: the programs of one sequence run side by side and read the
    # adjacent 256-byte head slices of each cache row together (1% faster at 512 x 640 keys,
    # benchmarks/results/h100/decode_grid_order.txt).
    #
    # Before the wait: what the engine wrote before the step (the sequence's lengths and block
    # table) and the K/V of every position but the newest, which the kernel just before (the
    # cache write) stores. The first tile's loads then overlap that kernel instead of following
    # it; at batch 1 a partition is often that one tile.
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(cu_seqlens_q_ptr + seq)
    has_query = tl.load(cu_seqlens_q_ptr + seq + 1) != q_row  # else no query this step
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_start, partition_len = _partitions(seq_len, window, num_splits, min_partition_len,
                                          BLOCK_N, SLIDING)
    start = kv_start + split * partition_len
    active = has_query & (start < seq_len)
    # an idle program looks up no page past its table: page 0, no keys
    end = tl.where(active, tl.minimum(start + partition_len, seq_len), 0)
    start = tl.where(active, start, 0)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    k_ptrs, v_ptrs, offs_n, n_valid = _kv_tile_ptrs(
        start, end, bt_row, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
        PAGE_SIZE, HEAD_DIM, BLOCK_N, True)  # fmt: skip
    cached = n_valid & (offs_n < seq_len - 1)  # none for an idle program (end = 0)
    k_t = tl.load(k_ptrs, mask=cached[None, :], other=0.0)  # [HEAD_DIM, BLOCK_N]
    v = tl.load(v_ptrs, mask=cached[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
    wait_for_inputs(USE_PDL)
    if not active:
        return
    newest = offs_n == seq_len - 1  # this step's key, if it falls in the first tile
    k_t = tl.load(k_ptrs, mask=newest[None, :], other=k_t)
    v = tl.load(v_ptrs, mask=newest[:, None], other=v)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    q_row = q_row.to(tl.int64)
    q = tl.load(
        q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None], other=0.0,
    )  # fmt: skip
    q_pos = tl.full([BLOCK_G], 0, tl.int32) + (seq_len - 1)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    p, acc, l_i, m_i = _tile_softmax(acc, l_i, m_i, q, q_pos, k_t, offs_n, n_valid, qk_scale,
                                     window, True, SLIDING)  # fmt: skip
    acc = _dot(p.to(q.dtype), v.to(q.dtype), acc)
    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
    for start_n in range(start + BLOCK_N, full_end, BLOCK_N):
        acc, l_i, m_i = _attn_tile(
            acc, l_i, m_i, q, q_pos, start_n, end, bt_row, k_head, v_head,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, window,
            PAGE_SIZE, HEAD_DIM, BLOCK_N, False, SLIDING,
        )  # fmt: skip
    for start_n in range(tl.maximum(full_end, start + BLOCK_N), end, BLOCK_N):  # a ragged tile
        acc, l_i, m_i = _attn_tile(
            acc, l_i, m_i, q, q_pos, start_n, end, bt_row, k_head, v_head,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, window,
            PAGE_SIZE, HEAD_DIM, BLOCK_N, True, SLIDING,
        )  # fmt: skip
    out = acc / l_i[:, None]
    if DIRECT:  # a single partition: its output is final
        out_ptrs = out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        part = (q_row * num_heads + heads) * num_splits + split  # [BLOCK_G]
        part_ptrs = part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(part_ptrs, out, mask=g_mask[:, None])
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit(do_not_specialize=["min_partition_len", "num_splits", "window"])
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
    stride_ot, stride_oh, min_partition_len, num_heads, num_splits, block_n, window,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, SLIDING: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(cu_seqlens_q_ptr + seq)  # the engine's inputs: loaded before the wait
    has_query = tl.load(cu_seqlens_q_ptr + seq + 1) != q_row
    seq_len = tl.load(seq_lens_ptr + seq)
    wait_for_inputs(USE_PDL)
    if not has_query:
        return
    kv_start, partition_len = _partitions(seq_len, window, num_splits, min_partition_len,
                                          block_n, SLIDING)
    num_parts = tl.cdiv(seq_len - kv_start, partition_len)  # partitions that ran
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_parts
    part = (q_row.to(tl.int64) * num_heads + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    part_ptrs = part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :]
    parts = tl.load(part_ptrs, mask=s_mask[:, None], other=0.0)  # [BLOCK_S, HEAD_DIM]
    out = tl.sum(parts * w[:, None], 0)
    out_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty))


def paged_attention_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    num_splits: int | None = None,
    config: tuple[int, int, int] | None = None,
    min_partition_len: int | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Launch decode (+ reduction); every sequence has at most one query token. ``out``: see
    attention_output; ``window``: the layer's sliding window (None: the whole context).

    num_splits and config = (BLOCK_N, num_warps, num_stages) override decode_launch_config's
    choice, and min_partition_len the one-tile floor of the partition length (tests and
    benchmarks/gpu_kernels.py sweep them; a floor of the old max_seqlen_k / num_splits
    reproduces partitions sized from max_seqlen_k alone).
    """
    num_seqs, num_heads, num_kv_heads, head_dim = check_attention_args(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables
    )
    assert max_seqlen_q <= 1, "decode kernel takes one query token per sequence"
    assert head_dim in (64, 128), f"head_dim {head_dim} not in [64, 128]"
    out = attention_output(q, out)
    if q.shape[0] == 0 or num_seqs == 0 or max_seqlen_k == 0:
        return out
    # a windowed query reads its window, from the start of the tile that holds its first key
    max_keys = max_seqlen_k if window is None else min(max_seqlen_k, window)
    launch = decode_launch_config(num_seqs, num_kv_heads, max_keys, num_sms(q.device))
    block_n, num_warps, num_stages = config or launch[:3]
    if window is not None:
        max_keys = min(max_seqlen_k, window + block_n - 1)
    if num_splits is None:
        num_splits = launch.num_splits
    # partitions hold whole tiles and at least min_partition_len keys: a split past
    # cdiv(max_keys, min_partition_len) could never run, so none is launched
    min_partition_len = triton.cdiv(min_partition_len or block_n, block_n) * block_n
    num_splits = max(1, min(num_splits, triton.cdiv(max_keys, min_partition_len)))
    group = num_heads // num_kv_heads
    launch_pdl = pdl(q.device)
    assert num_seqs < 65536, f"{num_seqs} sequences: the grid's second axis holds at most 65535"
    if num_splits > 1:
        shape = (q.shape[0], num_heads, num_splits)
        part_out = torch.empty((*shape, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused: DIRECT stores straight into out
    _decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, cu_seqlens_q, seq_lens, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        scale * LOG2E, min_partition_len, num_heads, num_splits,
        GROUP=group, BLOCK_G=max(16, next_power_of_2(group)), PAGE_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_N=block_n, DIRECT=num_splits == 1, **window_args(window),
        num_warps=num_warps, num_stages=num_stages, **launch_pdl,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, cu_seqlens_q, seq_lens, out.stride(0), out.stride(1),
            min_partition_len, num_heads, num_splits, block_n,
            BLOCK_S=next_power_of_2(num_splits), HEAD_DIM=head_dim, **window_args(window),
            num_warps=4, **launch_pdl,
        )  # fmt: skip
    return out

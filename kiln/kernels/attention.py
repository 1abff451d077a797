"""Paged attention: the one entry point the attention layer calls, and its PyTorch reference.

    out[i, h] = sum_{pos(i) - window < j <= pos(i)} softmax_j(scale * q[i, h] . K_b[j, g]) V_b[j, g]

q [T, H, D] holds the query tokens of B sequences laid flat (sequence b owns rows
cu_seqlens_q[b]:cu_seqlens_q[b+1]); they are the last q_len_b of that sequence's seq_lens[b]
positions, so query i of the chunk sits at pos(i) = seq_lens[b] - q_len_b + i. K_b / V_b are the
sequence's keys and values gathered from the paged caches [num_blocks, block_size, H_kv, D]
through block_tables[b] (entries past the context are padding and never read); their K/V for the
new tokens are already written. GQA: query head h reads kv head g = h // (H / H_kv). window is
the layer's sliding window, as transformers' sliding_window_overlay (``kv_idx > q_idx -
sliding_window``): a query sees itself and the window - 1 keys before it; None (a layer that does
not slide) sees every earlier key.

Dispatch: on CUDA with Triton, `max_seqlen_q == 1` runs the split-KV decode kernel and anything
else the FlashAttention-2-style varlen prefill kernel (head dims 64 and 128); everything else
runs `paged_attention_ref`, which is also the engine's CPU ("torch") attention backend.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from kiln.kernels._triton import use_triton
from kiln.kernels.attention_decode import (
    DECODE_CONFIG,
    LARGE_BATCH_CONFIG,
    SMALL_BATCH_CONFIG,
    TINY_BATCH_CONFIG,
    paged_attention_decode_triton,
)
from kiln.kernels.attention_prefill import (
    FLOAT32_CONFIG,
    HEAD_DIMS,
    NEW_KV_CONFIGS,
    PAGED_CONFIGS,
    SHORT_CONFIG,
    attention_output,
    paged_attention_prefill_triton,
)

# The widest key tile (BLOCK_N) of any launch config the kernels pick. A windowed query at p loads
# whole tiles from the one holding its first visible key p - window + 1, so it may load keys down
# to MAX_KEY_TILE - 1 before that one (masked, but a NaN there still reaches the output): the
# engine keeps the KV blocks that hold them (kiln/engine/sizing.py, window_lookback).
MAX_KEY_TILE = max(
    *(config[1] for config in (*PAGED_CONFIGS.values(), *NEW_KV_CONFIGS.values(), SHORT_CONFIG,
                               FLOAT32_CONFIG)),
    *(config[0] for config in (DECODE_CONFIG, LARGE_BATCH_CONFIG, SMALL_BATCH_CONFIG,
                               TINY_BATCH_CONFIG)),
)

_warned_head_dims: set[int] = set()


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    out: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Per sequence: gather the pages of the keys its queries see, then SDPA in float32 with the
    offset causal (and window) mask."""
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = attention_output(q, out)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, kv_len in enumerate(lens):
        q_start, q_end = cu[b], cu[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        assert q_len <= kv_len, f"sequence {b}: {q_len} queries but seq_len {kv_len}"
        # the first key any query sees: the first query's window start
        first = 0 if window is None else max(0, kv_len - q_len + 1 - window)
        skip = first // block_size  # whole pages before it are not gathered
        blocks = block_tables[b, skip : -(-kv_len // block_size)].long()
        rows = slice(first % block_size, kv_len - skip * block_size)
        k = k_cache[blocks].flatten(0, 1)[rows]  # [kv_len - first, H_kv, D]
        v = v_cache[blocks].flatten(0, 1)[rows]
        qb = q[q_start:q_end].transpose(0, 1).float()  # [H, q_len, D]
        kb = k.transpose(0, 1).float()  # [H_kv, kv_len - first, D]
        vb = v.transpose(0, 1).float()
        # a single query sees every key from first; is_causal aligns the top-left corner: right
        # for a whole prompt that no window cuts, else an explicit mask
        plain_causal = q_len == kv_len and (window is None or window >= kv_len)
        mask = None
        if q_len > 1 and not plain_causal:
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
            k_pos = torch.arange(first, kv_len, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask, is_causal=q_len > 1 and plain_causal, scale=scale,
            enable_gqa=group > 1,
        )  # fmt: skip
        out[q_start:q_end] = o.transpose(0, 1).to(q.dtype)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of q [T, H, D] over the paged caches -> out [T, H, D].

    k_new / v_new [T, H_kv, D] (optional) are this step's keys and values, rows aligned with q,
    the same values the caches hold for the new tokens: the prefill kernel then reads them
    directly (contiguous rows, TMA) rather than gathering them back from the pages. ``out``
    (optional): where to write, e.g. the caller's slice of a larger output. ``window``: the
    layer's sliding window (None: full causal attention)."""
    args = (q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, max_seqlen_q, max_seqlen_k)
    head_dim = q.shape[-1]
    if use_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables):
        if head_dim in HEAD_DIMS:
            if max_seqlen_q == 1:
                return paged_attention_decode_triton(*args, scale, out=out, window=window)
            return paged_attention_prefill_triton(*args, scale, k_new, v_new, out=out,
                                                  window=window)
        if head_dim not in _warned_head_dims:
            _warned_head_dims.add(head_dim)
            warnings.warn(
                f"paged_attention: no Triton kernel for head_dim {head_dim} "
                f"(have {list(HEAD_DIMS)}); using the PyTorch reference",
                stacklevel=2,
            )
    return paged_attention_ref(*args, scale, out, window)

"""Attention front-end: rotate q and k, write this step's K/V into the paged cache, then attend.

Rotary happens here rather than in the model so that on the Triton path the rotation and the
cache write are one kernel launch (kiln/kernels/rotary.py); the reference path runs them as
separate PyTorch steps.

The model never sees the cache layout: every forward receives an ``AttentionMetadata`` that
says where each new token's K/V goes (``slot_mapping``) and which blocks each sequence reads
(``block_tables``). The reference generator's contiguous cache is the special case of one block
per sequence, so both paths run the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kiln.kernels.attention import paged_attention, paged_attention_ref
from kiln.kernels.kv_cache import FP8_DTYPE, attention_scales
from kiln.kernels.rotary import rotary_write_kv_cache


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor | None  # [num_tokens] int64, < 0 skips; None: a sub-batch view
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, cached + new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    max_seqlen_q: int
    max_seqlen_k: int
    # per layer (k, v), each [num_blocks, block_size, num_kv_heads, head_dim]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    backend: str = "torch"  # "torch" (reference, any device) or "triton" (CUDA kernels)
    # Mixed batches put their single-token sequences first: rows [0, num_decode_seqs) go to the
    # split-KV decode kernel, the rest to the prefill kernel (which would otherwise spend a whole
    # query tile on each one-token row). The prefill part gets tensors of its own rather than
    # slices: a slice starting mid-tensor is not 16-byte aligned, and Triton would compile a
    # new kernel variant for it in the middle of serving.
    num_decode_seqs: int = 0
    prefill: AttentionMetadata | None = None


@dataclass
class OutputRows:
    """The rows of a flat batch whose final hidden states the caller reads: the last row of each
    sequence that samples (none at all in a step of prompt chunks that sample nothing). The last
    layer attends and runs its MLP for these rows only (every row still writes its K/V, which
    later tokens read); at a prefill step that skips the last layer's o_proj and MLP for all but
    one row a prompt: 2.8% of Llama-3.1-8B's prefill GEMM FLOPs."""

    index: torch.Tensor  # [n] int64, rows of the batch, each the last of its sequence
    meta: AttentionMetadata  # one query per kept row (decode-shaped), over its whole sequence


def last_rows(meta: AttentionMetadata, seqs: torch.Tensor) -> OutputRows:
    """OutputRows keeping the last row of each sequence ``seqs`` ([n] int64 indices of meta's
    sequences, on its device): gathered on the device, so a CUDA graph can hold it too."""
    return OutputRows(
        index=meta.cu_seqlens_q[1:].index_select(0, seqs).long() - 1,
        meta=AttentionMetadata(
            slot_mapping=None,
            cu_seqlens_q=torch.arange(seqs.shape[0] + 1, dtype=torch.int32, device=seqs.device),
            seq_lens=meta.seq_lens.index_select(0, seqs),
            block_tables=meta.block_tables.index_select(0, seqs), max_seqlen_q=1,
            max_seqlen_k=meta.max_seqlen_k, kv_caches=meta.kv_caches, backend=meta.backend))


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 window: int | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.window = window  # sliding window: a query sees itself and window - 1 keys before it
        self.scale = head_dim ** -0.5
        # per-layer scales of an fp8 KV cache (1.0 unless a quantized checkpoint calibrated them)
        self.k_scale = 1.0
        self.v_scale = 1.0

    def write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
              positions: torch.Tensor, cos_sin_cache: torch.Tensor,
              k_new: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate q and k, write k and v into this layer's cache slots (``meta.slot_mapping``);
        returns the rotated q (and the rotated k in ``k_new`` when given)."""
        k_cache, v_cache = meta.kv_caches[self.layer_idx]
        return rotary_write_kv_cache(q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                                     meta.slot_mapping, self.k_scale, self.v_scale, k_new)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                rows: OutputRows | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] before rotary, positions [T] -> [T, H * D], or with
        ``rows`` [len(rows.index), H * D]: every row's K/V is written, only those rows attend.

        q and k are rotated with ``cos_sin_cache`` ([max_positions, rot_dim] float32, see
        kiln/layers/rotary.py). q, k, v stay the first three arguments: calibration's forward
        pre-hooks read k and v there (kiln/quant/calibration.py), k still unrotated."""
        k_cache, v_cache = meta.kv_caches[self.layer_idx]
        scale = self.scale
        fp8 = k_cache.dtype == FP8_DTYPE
        if fp8:  # K and V are stored as x / scale; the scales fold into the softmax and output
            scale, out_scale = attention_scales(scale, self.k_scale, self.v_scale)
        # Decode attention reads the new K/V back from the cache. The prefill kernel takes them
        # as they are (the rotated k from the rotary launch, v itself): contiguous rows load
        # faster than pages. An fp8 cache keeps the read-back, so that every key is attended in
        # the precision it is stored in.
        new_kv = (meta.backend == "triton" and not fp8 and meta.max_seqlen_q > 1
                  and rows is None)
        k_new = torch.empty(k.shape, dtype=k.dtype, device=k.device) if new_kv else None
        v_new = v if new_kv else None
        q = self.write(q, k, v, meta, positions, cos_sin_cache, k_new)
        if rows is not None:  # the kept rows read their sequences back from the cache
            q, meta = q.index_select(0, rows.index), rows.meta
        if meta.backend != "triton":
            out = paged_attention_ref(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens,
                                      meta.block_tables, meta.max_seqlen_q, meta.max_seqlen_k,
                                      scale, window=self.window)
        elif meta.prefill is None:
            out = paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens,
                                  meta.block_tables, meta.max_seqlen_q, meta.max_seqlen_k, scale,
                                  k_new, v_new, window=self.window)
        else:
            nd, pre = meta.num_decode_seqs, meta.prefill
            pre_kv = (k_new[nd:], v_new[nd:]) if new_kv else (None, None)
            out = torch.empty_like(q)  # each part writes its rows in place: no copy after
            paged_attention(q[:nd], k_cache, v_cache, meta.cu_seqlens_q[: nd + 1],
                            meta.seq_lens[:nd], meta.block_tables[:nd], 1, meta.max_seqlen_k,
                            scale, out=out[:nd], window=self.window)
            paged_attention(q[nd:], k_cache, v_cache, pre.cu_seqlens_q, pre.seq_lens,
                            pre.block_tables, pre.max_seqlen_q, pre.max_seqlen_k, scale,
                            *pre_kv, out=out[nd:], window=self.window)
        if fp8:
            out = out * out_scale
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)


def contiguous_kv_caches(num_layers: int, num_seqs: int, max_len: int, num_kv_heads: int,
                         head_dim: int, dtype: torch.dtype, device: torch.device,
                         page_size: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One block of ``max_len`` slots per sequence: a contiguous cache in paged clothing; with
    ``page_size``, each sequence's slots in consecutive blocks of that many (the engine's layout,
    so the attention kernels specialized on it run)."""
    page = page_size or max_len
    shape = (num_seqs * -(-max_len // page), page, num_kv_heads, head_dim)
    return [(torch.empty(shape, dtype=dtype, device=device),
             torch.empty(shape, dtype=dtype, device=device)) for _ in range(num_layers)]


def contiguous_metadata(start_lens: list[int], new_lens: list[int], max_len: int,
                        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                        device: torch.device, backend: str = "torch",
                        rows: list[int] | None = None) -> AttentionMetadata:
    """Metadata for sequences whose KV sits in one row each of a contiguous cache.

    Sequence b lives in cache row ``rows[b]`` (default b), already holds ``start_lens[b]``
    tokens and feeds ``new_lens[b]`` new ones. A row is the cache's blocks
    (``contiguous_kv_caches``: one, or max_len / page_size of them) of that sequence.
    """
    rows = list(range(len(start_lens))) if rows is None else rows
    page = kv_caches[0][0].shape[1]
    pages = -(-max_len // page)  # blocks per row
    slots, cu = [], [0]
    for row, start, new in zip(rows, start_lens, new_lens, strict=True):
        slots.extend(range(row * pages * page + start, row * pages * page + start + new))
        cu.append(cu[-1] + new)
    seq_lens = [s + n for s, n in zip(start_lens, new_lens, strict=True)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([[row * pages + i for i in range(pages)] for row in rows],
                                  dtype=torch.int32, device=device),
        max_seqlen_q=max(new_lens),
        max_seqlen_k=max(seq_lens),
        kv_caches=kv_caches,
        backend=backend,
    )

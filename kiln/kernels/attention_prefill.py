"""Varlen causal attention over the paged KV cache, FlashAttention-2 style (prefill / mixed).

For each sequence b (queries q[cu_seqlens_q[b]:cu_seqlens_q[b+1]], the last q_len of its
seq_lens[b] positions) and query head h with kv head g = h // (num_heads // num_kv_heads):

    out[i] = sum_{pos(i) - window < j <= pos(i)} softmax_j(scale * q[i] . K[j]) V[j],
    pos(i) = ctx_len + i

(window: the layer's sliding window, as transformers' sliding_window_overlay. The constexpr
SLIDING compiles it in: a layer that does not slide runs the plain causal kernel.)

One program owns BLOCK_M query rows of one head and streams BLOCK_N keys at a time through an
online softmax (running max m, running sum l, fp32 accumulator), in base 2 with scale * log2(e)
folded into the logits. Key tiles that every row of the program may see skip the mask; only the
tiles that touch the diagonal, the end of the context or the window's lower edge are masked, and
the key loops start at the first tile the block's first row sees, so a long context costs a
windowed layer only its window.

Where the keys come from:
- the cached context (ctx_len = seq_len - q_len keys, a prefix-cache hit or earlier chunks) is
  gathered row by row from the pages named in the block table;
- the chunk's own keys (the new tokens) are read from the paged cache too, unless the caller
  passes them as k_new / v_new [T, H_kv, D] (rows aligned with q). Then they are loaded through
  TMA tensor descriptors: contiguous rows, no page lookups and no per-element pointers, which
  lets the tiles grow (128 x 128 at head dim 128): 466 against 357 TFLOP/s through the pages at
  4 x 4096 on an H100 (benchmarks/gpu_kernels.py times both paths). q always comes through TMA.
"""

from __future__ import annotations

import math

import torch

from kiln.kernels._triton import TensorDescriptor, pdl, tl, triton, wait_for_inputs

LOG2E = math.log2(math.e)  # exp(x) == exp2(x * LOG2E)

HEAD_DIMS = (64, 128)  # head dims with a kernel; others run the reference
# (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit inputs, tuned on an H100 by
# benchmarks/gpu_kernels.py (results: benchmarks/results/h100_kernels.txt)
PAGED_CONFIGS = {64: (128, 64, 8, 3), 128: (128, 64, 4, 3)}  # every key from the pages
NEW_KV_CONFIGS = {64: (128, 64, 4, 3), 128: (128, 128, 8, 3)}  # the chunk's own from k_new / v_new
# chunks of at most SHORT_MAX_Q queries: smaller query blocks, more programs (16 x 512, d128,
# new K/V: 240 against 199 TFLOP/s with 128 x 128 tiles)
SHORT_MAX_Q = 1024
SHORT_CONFIG = (64, 64, 4, 3)
FLOAT32_CONFIG = (64, 32, 4, 2)  # 4-byte elements: the 16-bit tiles would not fit shared memory


def window_args(window: int | None) -> dict[str, int | bool]:
    """The kernels' window arguments for a layer's sliding window (None: it does not slide)."""
    assert window is None or window >= 1, f"sliding window {window} must be at least 1"
    return {"window": window or 0, "SLIDING": window is not None}


def prefill_config(head_dim: int, max_seqlen_q: int, dtype: torch.dtype,
                   new_kv: bool) -> tuple[int, int, int, int]:
    """The launch config the engine uses for this problem."""
    if dtype == torch.float32:
        return FLOAT32_CONFIG
    if max_seqlen_q <= SHORT_MAX_Q:
        return SHORT_CONFIG
    return (NEW_KV_CONFIGS if new_kv else PAGED_CONFIGS)[head_dim]


@triton.jit
def _dot(a, b, acc):
    """tl.dot, with float32 operands multiplied in full precision (not TF32): a float32 model is
    the engine's precise configuration, compared token for token with the torch backend."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _online_softmax(qk, l_i, m_i, qk_scale):
    """Fold a tile of raw logits qk [rows, keys] into the running max m_i and sum l_i (base 2).
    Returns the tile's probabilities p, the factor alpha that rescales the accumulator, and
    the new l_i, m_i. The scale is applied inside the exponent: one fused multiply-add a logit."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _window_tiles(first, last, full_end, window, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr):
    """Key-tile bounds for query rows at positions first..last (keys p - window < k <= p):
    lo, the tile of the first key any row sees, and mid, from where every row sees every key
    below full_end (lo <= mid <= max(lo, full_end)), so that [lo, mid) is masked and
    [mid, full_end) is not. Multiples of BLOCK_N; both 0 without a window."""
    if SLIDING:
        lo = (tl.maximum(first - window + 1, 0) // BLOCK_N) * BLOCK_N
        every = tl.cdiv(tl.maximum(last - window + 1, 0), BLOCK_N) * BLOCK_N
        mid = tl.maximum(lo, tl.minimum(every, full_end))
    else:
        lo, mid = 0, 0
    return lo, mid


@triton.jit
def _kv_tile_ptrs(
    start_n, kv_end, bt_row_ptr, k_head_ptr, v_head_ptr, stride_kb, stride_ks, stride_vb,
    stride_vs, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """Where the BLOCK_N keys from start_n live in the pages: K^T [HEAD_DIM, BLOCK_N] and
    V [BLOCK_N, HEAD_DIM] pointers, the key positions and which of them are < kv_end."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_valid = offs_n < kv_end
    if PAGE_SIZE % BLOCK_N == 0:  # tiles start on multiples of BLOCK_N: one page per tile
        page = tl.load(bt_row_ptr + start_n // PAGE_SIZE).to(tl.int64)
        in_page = start_n % PAGE_SIZE + tl.arange(0, BLOCK_N)
    else:  # a page id per key row
        if MASKED:  # noqa: SIM108
            page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE, mask=n_valid, other=0)
        else:
            page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE)
        page = page.to(tl.int64)
        in_page = offs_n % PAGE_SIZE
    k_rows = page * stride_kb + in_page * stride_ks  # [BLOCK_N] (or a scalar page plus rows)
    v_rows = page * stride_vb + in_page * stride_vs
    k_ptrs = k_head_ptr + k_rows[None, :] + offs_d[:, None]
    v_ptrs = v_head_ptr + v_rows[:, None] + offs_d[None, :]
    return k_ptrs, v_ptrs, offs_n, n_valid


@triton.jit
def _tile_softmax(acc, l_i, m_i, q, q_pos, k_t, offs_n, n_valid, qk_scale, window,
                  MASKED: tl.constexpr, SLIDING: tl.constexpr):  # fmt: skip
    """Scores of a key tile K^T [HEAD_DIM, BLOCK_N] folded into the online softmax: the tile's
    probabilities p, the accumulator rescaled for them, and the new l_i, m_i."""
    qk = _dot(q, k_t.to(q.dtype), None)  # an fp8 cache is widened in registers (no-op otherwise)
    if MASKED:
        keep = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        if SLIDING:
            keep = keep & (offs_n[None, :] > q_pos[:, None] - window)
        qk = tl.where(keep, qk, float("-inf"))
    p, alpha, l_i, m_i = _online_softmax(qk, l_i, m_i, qk_scale)
    return p, acc * alpha[:, None], l_i, m_i


@triton.jit
def _attn_tile(
    acc, l_i, m_i, q, q_pos, start_n, kv_end, bt_row_ptr, k_head_ptr, v_head_ptr,
    stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, window,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    SLIDING: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N key tile of the online softmax; MASKED applies causality, the window (with
    SLIDING) and kv_end."""
    k_ptrs, v_ptrs, offs_n, n_valid = _kv_tile_ptrs(
        start_n, kv_end, bt_row_ptr, k_head_ptr, v_head_ptr, stride_kb, stride_ks, stride_vb,
        stride_vs, PAGE_SIZE, HEAD_DIM, BLOCK_N, MASKED)  # fmt: skip
    if MASKED:  # noqa: SIM108 (a constexpr branch; keep the unmasked load mask-free)
        k_t = tl.load(k_ptrs, mask=n_valid[None, :], other=0.0)  # [HEAD_DIM, BLOCK_N]
    else:
        k_t = tl.load(k_ptrs)
    p, acc, l_i, m_i = _tile_softmax(acc, l_i, m_i, q, q_pos, k_t, offs_n, n_valid, qk_scale,
                                     window, MASKED, SLIDING)  # fmt: skip
    if MASKED:  # noqa: SIM108
        v = tl.load(v_ptrs, mask=n_valid[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
    else:
        v = tl.load(v_ptrs)
    acc = _dot(p.to(q.dtype), v.to(q.dtype), acc)
    return acc, l_i, m_i


@triton.jit
def _new_kv_tile(
    acc, l_i, m_i, q, offs_m, start_n, k_desc, v_desc, row0, kv_col, qk_scale, window,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SLIDING: tl.constexpr,
):  # fmt: skip
    """One tile of the chunk's own keys, rows row0 + start_n... of k_new / v_new (query-local
    key index start_n..., causal and windowed against query-local rows offs_m when MASKED)."""
    k = k_desc.load([row0 + start_n, kv_col])  # [BLOCK_N, HEAD_DIM]
    # V is requested before the softmax, not after it as in _attn_tile: 454 against 425 TFLOP/s
    # (H100, 4 x 4096, d128)
    v = v_desc.load([row0 + start_n, kv_col])
    qk = _dot(q, k.T, None)
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keep = offs_n[None, :] <= offs_m[:, None]
        if SLIDING:
            keep = keep & (offs_n[None, :] > offs_m[:, None] - window)
        qk = tl.where(keep, qk, float("-inf"))
    p, alpha, l_i, m_i = _online_softmax(qk, l_i, m_i, qk_scale)
    acc = _dot(p.to(q.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_i


# stride_bt is the block-table width, which changes from step to step: specializing on it (Triton
# does for ints divisible by 16 or equal to 1) would compile a new variant mid-serving; nor is a
# variant per window size worth one
@triton.jit(do_not_specialize=["stride_bt", "window"])
def _prefill_kernel(
    q_desc, k_cache_ptr, v_cache_ptr, k_new_desc, v_new_desc, out_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    qk_scale, window,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NEW_KV: tl.constexpr,
    PAGED_STAGES: tl.constexpr, SLIDING: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(USE_PDL)
    head = tl.program_id(0)
    seq = tl.program_id(1)
    # the last query blocks see the most keys: start them first so the tail of the grid is short
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len + m_block * BLOCK_M
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)
    # through TMA, q stays in shared memory as the dot's operand: in registers, a 256-row tile
    # would spill. Rows past the chunk belong to the next sequence (or read as zeros past the
    # tensor): they are computed and never stored.
    q = q_desc.load([q_start + m_block * BLOCK_M, head * HEAD_DIM])  # [BLOCK_M, HEAD_DIM]
    q_pos = first_pos + tl.arange(0, BLOCK_M)
    # the running max starts finite: a row that sees no key of its first tiles (they hold the
    # window's edge for the block's first rows) computes exp2(-inf - -1e30) = 0 and rescales by
    # exp2(0) = 1, where -inf - -inf would be NaN
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head = head // GROUP
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    # the paged keys: the cached context only with NEW_KV, else every key up to the diagonal
    if NEW_KV:
        paged_end = seq_len - q_len
        full_end = (paged_end // BLOCK_N) * BLOCK_N
    else:
        paged_end = tl.minimum(first_pos + BLOCK_M, seq_len)
        full_end = (first_pos // BLOCK_N) * BLOCK_N
    # keys in [mid, full_end) are visible to every stored row (and lie inside the context): no
    # mask; those below lo are outside every row's window: never read
    last_pos = tl.minimum(first_pos + BLOCK_M, seq_len) - 1  # the block's last stored row
    lo, mid = _window_tiles(first_pos, last_pos, full_end, window, BLOCK_N, SLIDING)
    # the window's edge spans at most BLOCK_M / BLOCK_N + 1 tiles: not worth a pipeline's buffers
    for start_n in tl.range(lo, mid, BLOCK_N, num_stages=1):
        acc, l_i, m_i = _attn_tile(
            acc, l_i, m_i, q, q_pos, start_n, paged_end, bt_row, k_head, v_head,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, window,
            PAGE_SIZE, HEAD_DIM, BLOCK_N, True, SLIDING,
        )  # fmt: skip
    for start_n in tl.range(mid, full_end, BLOCK_N, num_stages=PAGED_STAGES):
        acc, l_i, m_i = _attn_tile(
            acc, l_i, m_i, q, q_pos, start_n, paged_end, bt_row, k_head, v_head,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, window,
            PAGE_SIZE, HEAD_DIM, BLOCK_N, False, SLIDING,
        )  # fmt: skip
    for start_n in tl.range(tl.maximum(mid, full_end), paged_end, BLOCK_N,
                            num_stages=PAGED_STAGES):
        acc, l_i, m_i = _attn_tile(
            acc, l_i, m_i, q, q_pos, start_n, paged_end, bt_row, k_head, v_head,
            stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, window,
            PAGE_SIZE, HEAD_DIM, BLOCK_N, True, SLIDING,
        )  # fmt: skip
    if NEW_KV:  # the chunk's own keys, query-local indices: row - window < key <= row
        m_start = m_block * BLOCK_M
        m_end = tl.minimum(m_start + BLOCK_M, q_len)
        kv_col = kv_head * HEAD_DIM
        lo, mid = _window_tiles(m_start, m_end - 1, m_start, window, BLOCK_N, SLIDING)
        for start_n in range(lo, mid, BLOCK_N):
            acc, l_i, m_i = _new_kv_tile(
                acc, l_i, m_i, q, offs_m, start_n, k_new_desc, v_new_desc, q_start, kv_col,
                qk_scale, window, BLOCK_N, True, SLIDING,
            )  # fmt: skip
        for start_n in range(mid, m_start, BLOCK_N):
            acc, l_i, m_i = _new_kv_tile(
                acc, l_i, m_i, q, offs_m, start_n, k_new_desc, v_new_desc, q_start, kv_col,
                qk_scale, window, BLOCK_N, False, SLIDING,
            )  # fmt: skip
        for start_n in range(tl.maximum(mid, m_start), m_end, BLOCK_N):
            acc, l_i, m_i = _new_kv_tile(
                acc, l_i, m_i, q, offs_m, start_n, k_new_desc, v_new_desc, q_start, kv_col,
                qk_scale, window, BLOCK_N, True, SLIDING,
            )  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None],
    )  # fmt: skip


def check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> tuple[int, int, int, int]:
    """Shape/dtype/stride asserts shared by the launchers; returns (B, H, H_kv, head_dim)."""
    assert q.dim() == 3 and k_cache.dim() == 4, "q [T, H, D], caches [blocks, page, H_kv, D]"
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads, {num_kv_heads} kv heads"
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn), (
        f"cache dtype {k_cache.dtype} must be q's ({q.dtype}) or float8_e4m3fn")
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    num_seqs = seq_lens.shape[0]
    assert cu_seqlens_q.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    assert block_tables.stride(-1) == 1
    for t in (cu_seqlens_q, seq_lens, block_tables):
        assert t.dtype in (torch.int32, torch.int64)
    return num_seqs, num_heads, num_kv_heads, head_dim


def attention_output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Where attention writes its [T, H, D] result: ``out`` (checked: q's shape and dtype, rows
    contiguous; the caller's slice of a larger output saves a copy) or a new tensor."""
    if out is None:
        return torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype, (
        f"out {tuple(out.shape)} {out.dtype} must match q {tuple(q.shape)} {q.dtype}")
    assert out.stride(-1) == 1 and out.stride(1) == q.shape[2], "out rows must be contiguous"
    return out


def _tma_rows(t: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """A TMA descriptor over [T, heads, D] rows (one row of heads * D elements a token), loading
    [block_rows, D] tiles. TMA wants a 16-byte aligned base and row stride: a view that has
    neither (an odd slice) is copied first."""
    rows = t.flatten(1)  # a view where heads and head dim are contiguous, else a copy
    if rows.stride(1) != 1 or rows.data_ptr() % 16 or rows.stride(0) * rows.element_size() % 16:
        rows = rows.contiguous()
    return TensorDescriptor.from_tensor(rows, [block_rows, t.shape[2]])


def paged_attention_prefill_triton(
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
    config: tuple[int, int, int, int] | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Launch the prefill kernel. With k_new / v_new ([T, H_kv, D], q's dtype, rows aligned with
    q) the chunk's own keys come from them instead of the cache. `config` = (BLOCK_M, BLOCK_N,
    num_warps, num_stages) overrides prefill_config's choice; `out` (see attention_output);
    `window`: the layer's sliding window (None: full causal attention)."""
    num_seqs, num_heads, num_kv_heads, head_dim = check_attention_args(
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables
    )
    assert head_dim in HEAD_DIMS, f"head_dim {head_dim} not in {HEAD_DIMS}"
    new_kv = k_new is not None
    if new_kv:
        assert v_new is not None and k_new.shape == v_new.shape == (q.shape[0], num_kv_heads,
                                                                     head_dim)
        assert k_new.dtype == v_new.dtype == q.dtype
    block_m, block_n, num_warps, num_stages = config or prefill_config(
        head_dim, max_seqlen_q, q.dtype, new_kv)
    assert block_m % block_n == 0, "query blocks must start on a key tile"
    out = attention_output(q, out)
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    k_desc = _tma_rows(k_new, block_n) if new_kv else None
    v_desc = _tma_rows(v_new, block_n) if new_kv else None
    grid = (num_heads, num_seqs, triton.cdiv(max_seqlen_q, block_m))
    _prefill_kernel[grid](
        _tma_rows(q, block_m), k_cache, v_cache, k_desc, v_desc, out, cu_seqlens_q, seq_lens,
        block_tables, out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        scale * LOG2E,
        GROUP=num_heads // num_kv_heads, PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, NEW_KV=new_kv,
        # with k_new the paged loops only cover a cached context (often none): unpipelined,
        # they leave the shared memory to the TMA loops (466 against 453 TFLOP/s at 4 x 4096)
        PAGED_STAGES=1 if new_kv else num_stages, num_warps=num_warps, num_stages=num_stages,
        **window_args(window), **pdl(q.device),
    )  # fmt: skip
    return out

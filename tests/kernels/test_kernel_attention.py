"""Paged attention: Triton prefill/decode (interpreted on CPU) and the reference vs dense float64.

Every case lays several sequences flat, with their pages shuffled through a noisy cache, so wrong
page indexing, reading past a context or a wrong causal offset all change the answer. Sliding
window cases also set the cached keys of the tiles wholly before a window to NaN, so a kernel
that reads them rather than skipping them fails.
"""

import pytest
import torch
from kernel_testing import (
    INTERPRET_DTYPES,
    assert_rel_close,
    gpu,
    make_paged_kv,
    naive_attention,
    needs_triton,
    poison_outside_window,
    set_cache_nan,
)

from kiln.kernels.attention import paged_attention, paged_attention_ref
from kiln.kernels.attention_decode import paged_attention_decode_triton
from kiln.kernels.attention_prefill import paged_attention_prefill_triton

# Reference and kernels keep fp32 accumulators and an fp32 softmax. fp32: tf32-free CPU math
# (~1e-6). fp16/bf16: inputs exact, probabilities rounded to the dtype for the P.V product and
# the output rounded once (2^-11 / 2^-8 relative each).
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def new_kv_args(ks, vs, q_lens, seq_lens, k_cache, v_cache, block_tables) -> dict:
    """k_new / v_new for the chunks' own tokens, v_new a strided view as the model's qkv split
    gives it. When the call goes to the prefill kernel (some chunk longer than one token), the
    cache slots of those tokens are then set to NaN, so any read of them from the cache shows up
    in the output; decode reads every key from the cache and ignores k_new / v_new."""
    k_new = torch.cat([k[n - q:] for k, q, n in zip(ks, q_lens, seq_lens, strict=True)])
    v_new = torch.cat([v[n - q:] for v, q, n in zip(vs, q_lens, seq_lens, strict=True)])
    v_new = torch.cat([k_new, v_new], dim=1)[:, k_new.shape[1]:]  # row stride 2 * H_kv * D
    for b, (q, n) in enumerate(zip(q_lens, seq_lens, strict=True) if max(q_lens) > 1 else ()):
        set_cache_nan(k_cache, v_cache, block_tables, b, range(n - q, n))
    return {"k_new": k_new, "v_new": v_new}


def run_case(fn, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
             device="cpu", seed=0, new_kv=False, window=None, skip_tile=None):  # fmt: skip
    """fn's output against naive_attention. With a sliding ``window``, the cached keys in the
    whole ``skip_tile``-key tiles before each sequence's window are NaN (poison_outside_window):
    fn must not read them."""
    gen = torch.Generator().manual_seed(seed)
    ks, vs, k_cache, v_cache, block_tables = make_paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, device, gen
    )
    qs = [torch.randn(n, num_heads, head_dim, generator=gen).to(dtype).to(device) for n in q_lens]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim**-0.5
    kwargs = {}
    if new_kv:
        kwargs = new_kv_args(ks, vs, q_lens, seq_lens, k_cache, v_cache, block_tables)
    if window is not None:
        kwargs["window"] = window
        poison_outside_window(k_cache, v_cache, block_tables, q_lens, seq_lens, window,
                              skip_tile or block_size)
    out = fn(
        torch.cat(qs), k_cache, v_cache, cu.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables,
        max(q_lens), max(seq_lens), scale, **kwargs,
    )  # fmt: skip
    assert out.dtype == dtype
    what = (f"q_lens={q_lens} seq_lens={seq_lens} H={num_heads}/{num_kv_heads} {dtype} "
            f"window={window}")
    assert_rel_close(out, naive_attention(qs, ks, vs, scale, window), TOL[dtype], what)


# (q_lens, seq_lens): full prompts of length 1 and 17, a chunk continuing a cached prefix, a
# decode token, and a prompt that ends exactly on a page boundary.
MIXED = ([1, 17, 5, 1, 16], [1, 17, 40, 33, 16])
DECODE = ([1, 1, 1, 1, 1], [1, 17, 33, 64, 100])
GQA = [(4, 4), (8, 2), (8, 1)]  # ratios 1, 4, 8


@pytest.mark.parametrize("lens", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"H{h[0]}-{h[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference(lens, heads, dtype):
    run_case(paged_attention_ref, *lens, *heads, head_dim=64, block_size=16, dtype=dtype)


@needs_triton
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"H{h[0]}-{h[1]}")
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])  # one page per key tile, or two tiles per page
def test_prefill_triton(heads, dtype, block_size):
    # 16 x 16 tiles: several query blocks and key tiles per sequence, on and off the diagonal
    def fn(*args):
        return paged_attention_prefill_triton(*args, config=(16, 16, 4, 1))

    run_case(fn, *MIXED, *heads, head_dim=64, block_size=block_size, dtype=dtype, seed=1)


@needs_triton
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"H{h[0]}-{h[1]}")
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
@pytest.mark.parametrize("tiles", [(16, 16), (32, 16)], ids=["16x16", "32x16"])
def test_prefill_triton_new_kv(heads, dtype, tiles):
    """The chunks' own keys from k_new / v_new (TMA descriptors), the cached context from the
    pages (whose copies of the new tokens are NaN): prompts, a chunk after a cached prefix, a
    decode row, a prompt ending on a page boundary, query blocks of two key tiles."""
    def fn(*args, **kwargs):
        return paged_attention_prefill_triton(*args, **kwargs, config=(*tiles, 4, 1))

    run_case(fn, *MIXED, *heads, head_dim=64, block_size=16, dtype=dtype, seed=5, new_kv=True)


@needs_triton
def test_prefill_triton_default_tiles():
    """The production tile sizes, with pages (8) smaller than a key tile."""
    fn = paged_attention_prefill_triton
    run_case(fn, [17, 3], [17, 70], 4, 2, head_dim=64, block_size=8, dtype=torch.float16, seed=2)


@needs_triton
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"H{h[0]}-{h[1]}")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_triton(heads, num_splits):
    def fn(*args):
        return paged_attention_decode_triton(*args, num_splits=num_splits, config=(16, 4, 1))

    run_case(fn, *DECODE, *heads, head_dim=64, block_size=16, dtype=torch.float16, seed=3)


@needs_triton
def test_decode_triton_fp32_default_tiles():
    fn = paged_attention_decode_triton
    run_case(fn, [1, 1], [1, 300], 8, 1, head_dim=64, block_size=16, dtype=torch.float32, seed=4)


def into_slice(fn):
    """fn writing through ``out=`` into rows 3.. of a larger buffer (a mixed step's prefill
    part): returns that view, after checking the rows around it kept their sentinel."""
    def run(q, *args, **kwargs):
        buffer = torch.full((q.shape[0] + 5, *q.shape[1:]), 7.0, dtype=q.dtype, device=q.device)
        out = fn(q, *args, **kwargs, out=buffer[3:-2])
        assert out.data_ptr() == buffer[3].data_ptr()
        assert (buffer[:3] == 7.0).all() and (buffer[-2:] == 7.0).all()
        return out
    return run


@pytest.mark.parametrize("kernel", [
    "reference",
    pytest.param("prefill", marks=needs_triton),
    pytest.param("decode", marks=needs_triton),
    pytest.param("decode-split", marks=needs_triton),
])
def test_out_writes_in_place(kernel):
    """``out=`` (the attention layer's slices of one output, instead of a copy per part)."""
    fn = {"reference": paged_attention_ref,
          "prefill": lambda *a, **k: paged_attention_prefill_triton(*a, **k, config=(16, 16, 4, 1)),
          "decode": lambda *a, **k: paged_attention_decode_triton(*a, **k, num_splits=1,
                                                                   config=(16, 4, 1)),
          "decode-split": lambda *a, **k: paged_attention_decode_triton(*a, **k, num_splits=3,
                                                                         config=(16, 4, 1))}[kernel]
    lens = DECODE if kernel.startswith("decode") else MIXED
    run_case(into_slice(fn), *lens, 8, 2, head_dim=64, block_size=16, dtype=torch.float16, seed=6)


def test_wrapper_on_cpu_is_reference():
    run_case(paged_attention, *MIXED, 4, 2, head_dim=32, block_size=8, dtype=torch.float32)


# --- sliding window -------------------------------------------------------------------------
# (q_lens, seq_lens): a 70-token prompt (five 16-row query blocks), a 37-token chunk after 63
# cached tokens, a decode row at 90, a prompt ending on a page boundary, a 5-token chunk after
# 35 cached, a 1-token prompt
WINDOWED = ([70, 37, 1, 16, 5, 1], [70, 100, 90, 16, 40, 1])
# 1: a query sees only itself; 5 and 33: window edges inside 16-key tiles; 16 and 32: on tile
# and page boundaries; 40 and 100: as long as a context; 128: longer than every context
WINDOWS = [1, 5, 16, 32, 33, 40, 100, 128]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"H{h[0]}-{h[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_window(window, heads, dtype):
    run_case(paged_attention_ref, *WINDOWED, *heads, head_dim=64, block_size=16, dtype=dtype,
             window=window)  # fmt: skip


@needs_triton
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"H{h[0]}-{h[1]}")
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
def test_prefill_triton_window(window, heads, dtype):
    """Every key from the pages (16-key tiles, pages of 32: two tiles a page); the tiles before
    the window are NaN."""
    def fn(*args, **kwargs):
        return paged_attention_prefill_triton(*args, **kwargs, config=(16, 16, 4, 1))

    run_case(fn, *WINDOWED, *heads, head_dim=64, block_size=32, dtype=dtype, seed=window,
             window=window, skip_tile=16)  # fmt: skip


@needs_triton
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
@pytest.mark.parametrize("tiles", [(16, 16), (32, 16)], ids=["16x16", "32x16"])
def test_prefill_triton_new_kv_window(window, dtype, tiles):
    """The chunks' own keys from k_new / v_new, windowed in query-local indices, the cached
    context from the pages; 32-row query blocks span two key tiles, so a narrow window leaves
    some rows of a block nothing in the block's first tiles."""
    def fn(*args, **kwargs):
        return paged_attention_prefill_triton(*args, **kwargs, config=(*tiles, 4, 1))

    run_case(fn, *WINDOWED, 8, 2, head_dim=64, block_size=16, dtype=dtype, seed=20 + window,
             new_kv=True, window=window, skip_tile=16)  # fmt: skip


@needs_triton
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"H{h[0]}-{h[1]}")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_triton_window(window, heads, num_splits):
    def fn(*args, **kwargs):
        return paged_attention_decode_triton(*args, **kwargs, num_splits=num_splits,
                                             config=(16, 4, 1))

    run_case(fn, *DECODE, *heads, head_dim=64, block_size=16, dtype=torch.float16,
             seed=40 + window, window=window, skip_tile=16)  # fmt: skip


def test_wrapper_on_cpu_windows():
    """paged_attention hands the window on (on CPU, to the reference)."""
    run_case(paged_attention, *WINDOWED, 4, 2, head_dim=32, block_size=8, dtype=torch.float32,
             window=33)  # fmt: skip


@gpu
@pytest.mark.parametrize("seq_len", [1, 17, 1000])
# "+new": the chunks' own K/V passed as k_new / v_new (decode always reads the cache)
@pytest.mark.parametrize("kind", ["prefill", "chunk", "decode", "prefill+new", "chunk+new"])
@pytest.mark.parametrize("heads", [(32, 8, 128), (8, 8, 64), (16, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu(seq_len, kind, heads, dtype):
    kind, new_kv = kind.removesuffix("+new"), kind.endswith("+new")
    num_heads, num_kv_heads, head_dim = heads
    seq_lens = [seq_len, max(seq_len // 2, 1), 1, 300]
    if kind == "prefill":
        q_lens = seq_lens
    elif kind == "chunk":  # chunked prefill next to decodes
        q_lens = [max(n // 3, 1) if i % 2 == 0 else 1 for i, n in enumerate(seq_lens)]
    else:
        q_lens = [1] * len(seq_lens)
    run_case(paged_attention, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, 16, dtype,
             device="cuda", seed=seq_len, new_kv=new_kv)  # fmt: skip


@gpu
@pytest.mark.parametrize("num_seqs", [64, 160])
def test_gpu_decode_big_batches(num_seqs):
    """Decode batches of at least one (sequence, kv head) pair per SM, the launches the small
    cases above never reach: 64 x 8 pairs (4 warps, no software pipeline on an H100) and 160 x 8
    (from 8 pairs an SM: 2 warps, 2 stages); ragged contexts of 1 to 900 tokens."""
    gen = torch.Generator().manual_seed(num_seqs)
    seq_lens = torch.randint(1, 900, (num_seqs,), generator=gen).tolist()
    run_case(paged_attention, [1] * num_seqs, seq_lens, 32, 8, 128, 16, torch.bfloat16,
             device="cuda", seed=num_seqs)  # fmt: skip


@gpu
@pytest.mark.parametrize("window", [4096, 1000])
# "+new": the chunks' own K/V passed as k_new / v_new (decode always reads the cache)
@pytest.mark.parametrize("kind", ["prefill", "chunk", "decode", "prefill+new", "chunk+new"])
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 2, 64)])
def test_gpu_sliding_window(window, kind, heads):
    """Mistral-7B's window (4096) and a shorter one over contexts up to 8k, bf16, with the tiles
    and split counts the engine picks: 8192-token prompts (past the window from row 4096 on), a
    prompt as long as the window, chunks after long cached prefixes beside decode rows. The
    cached keys of the 128-key tiles wholly before each window (128: a multiple of every tile
    the launch configs pick) are NaN: the kernels must skip them."""
    kind, new_kv = kind.removesuffix("+new"), kind.endswith("+new")
    num_heads, num_kv_heads, head_dim = heads
    seq_lens = [8192, 4096, 6000, 8192, 300]
    if kind == "prefill":
        q_lens = seq_lens
    elif kind == "chunk":  # chunked prefill over cached prefixes next to decodes
        q_lens = [2048, 1, 1500, 1, 300]
    else:
        q_lens = [1] * len(seq_lens)
    run_case(paged_attention, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, 16,
             torch.bfloat16, device="cuda", seed=window, new_kv=new_kv, window=window,
             skip_tile=128)  # fmt: skip


@gpu
@pytest.mark.parametrize("num_seqs", [1, 64, 160])
def test_gpu_decode_window_batches(num_seqs):
    """Split-KV decode under a 4096-key window: batch 1 (tiny tiles, many splits over the
    window), 64 x 8 and 160 x 8 (sequence, kv head) pairs; contexts of 1 to 9000 tokens."""
    gen = torch.Generator().manual_seed(num_seqs)
    seq_lens = torch.randint(1, 9000, (num_seqs,), generator=gen).tolist()
    if num_seqs == 1:
        seq_lens = [8192]
    run_case(paged_attention, [1] * num_seqs, seq_lens, 32, 8, 128, 16, torch.bfloat16,
             device="cuda", seed=num_seqs, window=4096, skip_tile=128)  # fmt: skip

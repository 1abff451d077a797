"""Paged attention: Triton prefill/decode (interpreted on CPU) and the reference vs dense float64.

Every case lays several sequences flat, with their pages shuffled through a noisy cache, so wrong
page indexing, reading past a context or a wrong causal offset all change the answer.
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
    block_size = k_cache.shape[1]
    for b, (q, n) in enumerate(zip(q_lens, seq_lens, strict=True) if max(q_lens) > 1 else ()):
        for pos in range(n - q, n):
            block = block_tables[b, pos // block_size]
            k_cache[block, pos % block_size] = float("nan")
            v_cache[block, pos % block_size] = float("nan")
    return {"k_new": k_new, "v_new": v_new}


def run_case(fn, q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
             device="cpu", seed=0, new_kv=False):  # fmt: skip
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
    out = fn(
        torch.cat(qs), k_cache, v_cache, cu.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables,
        max(q_lens), max(seq_lens), scale, **kwargs,
    )  # fmt: skip
    assert out.dtype == dtype
    what = f"q_lens={q_lens} seq_lens={seq_lens} H={num_heads}/{num_kv_heads} {dtype}"
    assert_rel_close(out, naive_attention(qs, ks, vs, scale), TOL[dtype], what)


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

"""The Triton attention kernels never load a KV block that the cache gave back (interpreted on
CPU): block-table entries that the engine's rule frees (kiln/cache/window.py, with the lookback
window_lookback gives the Triton backend) are pointed at a page of NaN, as the null block would be
if it held garbage, and every output must still match dense float64 attention.

The contexts include, for each window, one whose first query puts the 128-key tile's start (the
widest tile, MAX_KEY_TILE) exactly on the first block kept: there the margin is tight, and one
block more given back turns that sequence's output into NaN (checked too, so the poison works).
"""

import pytest
import torch
from kernel_testing import assert_rel_close, make_paged_kv, naive_attention, needs_triton

from kiln.cache import num_unreachable_blocks
from kiln.engine.sizing import window_lookback
from kiln.kernels.attention import MAX_KEY_TILE
from kiln.kernels.attention_decode import paged_attention_decode_triton
from kiln.kernels.attention_prefill import paged_attention_prefill_triton

TOL = 2e-3  # float16 inputs, fp32 accumulators: probabilities and output rounded to 2^-11
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
WINDOWS = [5, 40]  # edges inside a 16-key page and a 64-key tile; both far below MAX_KEY_TILE


def tight_start(window: int) -> int:
    """A first query position p0 whose window starts on the last key of a MAX_KEY_TILE tile, so
    that the kernels' widest tile begins exactly lookback keys before p0 (on a page boundary)."""
    lookback = window_lookback((window,), "triton")
    p0 = 2 * MAX_KEY_TILE + lookback
    assert (p0 - window + 1) % MAX_KEY_TILE == MAX_KEY_TILE - 1
    return p0


def run_freed(fn, q_lens: list[int], seq_lens: list[int], window: int, block_size: int,
              seed: int, new_kv: bool = False, extra_freed: int = 0) -> tuple[torch.Tensor, ...]:
    """fn's output and dense attention's, with each sequence's given-back table entries (plus
    ``extra_freed`` more for sequence 0) naming an appended page of NaN."""
    gen = torch.Generator().manual_seed(seed)
    ks, vs, k_cache, v_cache, block_tables = make_paged_kv(
        seq_lens, KV_HEADS, HEAD_DIM, block_size, torch.float16, "cpu", gen)
    null = k_cache.shape[0]
    nan_page = torch.full((1, *k_cache.shape[1:]), float("nan"), dtype=k_cache.dtype)
    k_cache, v_cache = torch.cat([k_cache, nan_page]), torch.cat([v_cache, nan_page])
    lookback = window_lookback((window,), "triton")
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        num_freed = num_unreachable_blocks(seq_len - q_len, lookback, block_size)
        block_tables[b, : num_freed + (extra_freed if b == 0 else 0)] = null
    qs = [torch.randn(n, HEADS, HEAD_DIM, generator=gen).half() for n in q_lens]
    kwargs = {}
    if new_kv:
        kwargs["k_new"] = torch.cat([k[n - q:] for k, q, n in zip(ks, q_lens, seq_lens,
                                                                    strict=True)])
        kwargs["v_new"] = torch.cat([v[n - q:] for v, q, n in zip(vs, q_lens, seq_lens,
                                                                    strict=True)])
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = fn(torch.cat(qs), k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32),
             block_tables, max(q_lens), max(seq_lens), HEAD_DIM**-0.5, window=window, **kwargs)
    return out, naive_attention(qs, ks, vs, HEAD_DIM**-0.5, window)


def prefill_lens(window: int) -> tuple[list[int], list[int]]:
    """(q_lens, seq_lens): a chunk at the tight start, a long chunk after 500 cached tokens, a
    one-token row, and a prompt too short to have freed anything."""
    p0 = tight_start(window)
    return [37, 150, 1, 20], [p0 + 37, 650, p0 + 201, 20]


def decode_lens(window: int) -> tuple[list[int], list[int]]:
    p0 = tight_start(window)
    return [1] * 4, [p0 + 1, 1, 200, 700]


def test_max_key_tile_covers_every_launch_config():
    """MAX_KEY_TILE is at least the key tile of every config the launchers pick (else the
    engine would free blocks a wider tile reads)."""
    from kiln.kernels.attention_decode import decode_launch_config
    from kiln.kernels.attention_prefill import prefill_config

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for head_dim in (64, 128):
            for max_q in (1, 1024, 1025, 8192):
                for new_kv in (False, True):
                    assert prefill_config(head_dim, max_q, dtype, new_kv)[1] <= MAX_KEY_TILE
    for num_seqs in (1, 2, 16, 64, 512, 4096):
        for sms in (1, 132):
            assert decode_launch_config(num_seqs, 8, 32768, sms).block_n <= MAX_KEY_TILE


@needs_triton
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [16, 64])  # pages smaller than most tiles, or as large
@pytest.mark.parametrize("tiles", [(16, 16), (64, 64), (128, 64), (128, 128)],
                         ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("new_kv", [False, True], ids=["paged", "new_kv"])
def test_prefill_reads_no_freed_block(window, block_size, tiles, new_kv):
    def fn(*args, **kwargs):
        return paged_attention_prefill_triton(*args, **kwargs, config=(*tiles, 4, 1))

    out, ref = run_freed(fn, *prefill_lens(window), window, block_size, seed=window,
                         new_kv=new_kv)
    assert_rel_close(out, ref, TOL, f"prefill {tiles} window {window} pages {block_size}")


@needs_triton
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("config", [(32, 4, 1), (64, 4, 1), (64, 2, 2)],
                         ids=lambda c: f"n{c[0]}")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_reads_no_freed_block(window, config, num_splits):
    def fn(*args, **kwargs):
        return paged_attention_decode_triton(*args, **kwargs, num_splits=num_splits,
                                             config=config)

    out, ref = run_freed(fn, *decode_lens(window), window, 16, seed=100 + window)
    assert_rel_close(out, ref, TOL, f"decode {config} x {num_splits} window {window}")


@needs_triton
@pytest.mark.parametrize("window", WINDOWS)
def test_one_block_more_would_be_read(window):
    """At the tight start the widest tile loads the first block kept: giving back one more
    block puts NaN into that sequence's output, so the margin is exactly what the tile needs."""
    def fn(*args, **kwargs):
        return paged_attention_prefill_triton(*args, **kwargs,
                                              config=(MAX_KEY_TILE, MAX_KEY_TILE, 4, 1))

    out, _ = run_freed(fn, *prefill_lens(window), window, 16, seed=window, extra_freed=1)
    assert out[:37].isnan().any() and not out[37:].isnan().any()

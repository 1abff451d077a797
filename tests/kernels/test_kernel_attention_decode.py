"""Split-KV decode: the launch policy (a pure function of host ints) and the kernel with partitions
sized from the real length, down to one tile, against paged_attention_ref.

The kernel cases pass max_seqlen_k = 4096 for contexts of 1 to 100 tokens, as a CUDA graph
captured at max_model_len does, with the block table padded to that width. Sliding-window cases
partition only the window (from the tile holding its first key); the cached keys of the tiles
before it are NaN, so reading them fails the case.
"""

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import (
    INTERPRET_DTYPES,
    assert_rel_close,
    make_paged_kv,
    needs_triton,
    poison_outside_window,
)

from kiln.kernels.attention import paged_attention_ref
from kiln.kernels.attention_decode import (
    DECODE_CONFIG,
    LARGE_BATCH_CONFIG,
    LARGE_BATCH_PROGRAMS_PER_SM,
    MIN_PARTITION_LEN,
    PROGRAMS_PER_SM,
    SMALL_BATCH_CONFIG,
    TINY_BATCH_CONFIG,
    TINY_BATCH_PROGRAMS,
    DecodeLaunch,
    decode_launch_config,
    paged_attention_decode_triton,
)

H100_SMS = 132


@pytest.mark.parametrize(
    ("num_seqs", "max_seqlen_k", "expected"),
    [
        (1, 4096, DecodeLaunch(*TINY_BATCH_CONFIG, 16)),  # batch-1 graph: tiny tiles, 16 splits
        (8, 4096, DecodeLaunch(*SMALL_BATCH_CONFIG, 5)),
        (8, 16384, DecodeLaunch(*SMALL_BATCH_CONFIG, 5)),  # full length: 5 x 3328 keys, as before
        (16, 4096, DecodeLaunch(*SMALL_BATCH_CONFIG, 3)),
        (17, 4096, DecodeLaunch(*DECODE_CONFIG, 2)),  # 136 pairs >= 132 SMs: the large tile
        (64, 1024, DecodeLaunch(*DECODE_CONFIG, 1)),  # big batch: one partition, no reduction
        (64, 4096, DecodeLaunch(*DECODE_CONFIG, 1)),
        (132, 4096, DecodeLaunch(*LARGE_BATCH_CONFIG, 1)),  # 8 pairs an SM: 2 warps, 2 stages
        (512, 4096, DecodeLaunch(*LARGE_BATCH_CONFIG, 1)),
        (1, 100, DecodeLaunch(*TINY_BATCH_CONFIG, 1)),  # shorter than MIN_PARTITION_LEN
    ],
)
def test_launch_config_h100_llama8b(num_seqs, max_seqlen_k, expected):
    assert decode_launch_config(num_seqs, 8, max_seqlen_k, H100_SMS) == expected


@pytest.mark.parametrize("sms", [8, 132])
@pytest.mark.parametrize("num_kv_heads", [1, 8])
def test_launch_config_bounds(sms, num_kv_heads):
    for num_seqs in [0, 1, 2, 3, 8, 33, 64, 256]:
        previous = None
        for max_seqlen_k in [0, 1, 17, 255, 256, 257, 4096, 131072]:
            launch = decode_launch_config(num_seqs, num_kv_heads, max_seqlen_k, sms)
            programs = max(num_seqs * num_kv_heads, 1)
            what = f"{num_seqs} seqs x {num_kv_heads} kv heads, max {max_seqlen_k}, {sms} SMs"
            tile = (LARGE_BATCH_CONFIG if programs >= LARGE_BATCH_PROGRAMS_PER_SM * sms
                    else DECODE_CONFIG if programs >= sms else TINY_BATCH_CONFIG
                    if programs <= TINY_BATCH_PROGRAMS else SMALL_BATCH_CONFIG)
            assert launch[:3] == tile, what
            assert 1 <= launch.num_splits <= max(1, -(-max_seqlen_k // MIN_PARTITION_LEN)), what
            # at full length, at most one program per SM beyond the PROGRAMS_PER_SM target
            assert programs * (launch.num_splits - 1) < PROGRAMS_PER_SM * sms, what
            if previous is not None:  # a longer maximum never takes fewer splits
                assert launch.num_splits >= previous, what
            previous = launch.num_splits


def run_decode(
    seq_lens: list[int], num_heads: int, num_kv_heads: int, dtype: torch.dtype, seed: int,
    block_size: int = 16, max_seqlen_k: int = 4096, no_query: tuple[int, ...] = (),
    window: int | None = None, **launch: object,
) -> None:  # fmt: skip
    """Decode one query per sequence (none for the indices in no_query) against the reference,
    with the layer's sliding ``window`` (the tiles before it NaN in the cache)."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = 64
    _, _, k_cache, v_cache, block_tables = make_paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, "cpu", gen
    )
    # as wide as a graph's table for max_seqlen_k; the padding is page 0, another sequence's
    block_tables = F.pad(block_tables, (0, -(-max_seqlen_k // block_size) - block_tables.shape[1]))
    queries = [int(i not in no_query) for i in range(len(seq_lens))]
    if window is not None:  # the launch's tile; the policy's is at most 64 keys
        tile = launch["config"][0] if "config" in launch else 64
        poison_outside_window(k_cache, v_cache, block_tables, [1] * len(seq_lens), seq_lens,
                              window, tile)
    cu_seqlens_q = torch.tensor([0, *queries], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(queries), num_heads, head_dim, generator=gen).to(dtype)
    args = (
        q, k_cache, v_cache, cu_seqlens_q,
        torch.tensor(seq_lens, dtype=torch.int32), block_tables, 1, max_seqlen_k, head_dim**-0.5,
    )  # fmt: skip
    out = paged_attention_decode_triton(*args, **launch, window=window)
    # both round their output to dtype once, from fp32 softmax and accumulators: fp32 agrees to
    # ~1e-6, fp16 to a few 2^-11 (the kernel also rounds the probabilities for P.V)
    tol = {torch.float32: 1e-4, torch.float16: 2e-3}[dtype]
    what = f"seq_lens={seq_lens} H={num_heads}/{num_kv_heads} {dtype} {launch} window={window}"
    assert_rel_close(out, paged_attention_ref(*args, window=window), tol, what)


# paged_attention_decode_triton overrides; what is left out is decode_launch_config's choice and
# a one-tile partition floor
LAUNCHES = {
    "policy": {},  # the interpreter's nominal 8 SMs: 6 pairs, SMALL_BATCH_CONFIG, 3 splits
    "one-tile": {"config": (16, 4, 1), "num_splits": 64},  # 100 keys: 7 partitions of 16
    "all-splits": {"config": (16, 4, 1), "num_splits": 3},  # 100 keys: 48 + 48 + 4
    "two-tiles": {"config": (16, 4, 1), "num_splits": 64, "min_partition_len": 32},
    "from-max": {"config": (16, 4, 1), "num_splits": 4, "min_partition_len": 1024},  # old policy
}
DECODE_LENS = [1, 17, 100]


@needs_triton
@pytest.mark.parametrize("name", LAUNCHES)
@pytest.mark.parametrize("heads", [(2, 2), (8, 2)], ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
def test_decode_partitions_from_real_length(name, heads, dtype):
    seed = 10 * list(LAUNCHES).index(name) + heads[0]  # fresh inputs per case
    run_decode(DECODE_LENS, *heads, dtype, seed=seed, **LAUNCHES[name])


@needs_triton
def test_decode_pages_smaller_than_tile():
    """Pages of 8 keys under one-tile partitions of 16: two pages per tile, 13 splits."""
    run_decode([5, 100, 64], 8, 2, torch.float16, seed=7, block_size=8, max_seqlen_k=200,
               config=(16, 4, 1), num_splits=13)  # fmt: skip


# 16-key tiles over 4 splits: partitions of max(16, cdiv(cdiv(len, 4), 16) * 16) keys, so these
# lengths run 1, 4, 1, 3, 4 and 2 partitions (4 is every split) in one launch, and the reduction
# combines a different count per sequence
MIXED_LENS = [5, 100, 16, 40, 64, 20]
FOUR_SPLITS = {"config": (16, 4, 1), "num_splits": 4}


@needs_triton
@pytest.mark.parametrize("heads", [(2, 2), (8, 2)], ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
def test_decode_mixed_partition_counts(heads, dtype):
    run_decode(MIXED_LENS, *heads, dtype, seed=30 + heads[0], **FOUR_SPLITS)


@needs_triton
def test_decode_sequences_without_a_query():
    """Sequences with no query token this step are skipped by both passes; the others are right."""
    run_decode(MIXED_LENS, 8, 2, torch.float16, seed=50, no_query=(1, 4), **FOUR_SPLITS)


# windows of 1 key, edges inside and on 16-key tiles, a window as long as the longest context
# and one longer than max_seqlen_k
DECODE_WINDOWS = [1, 7, 16, 48, 100, 5000]


@needs_triton
@pytest.mark.parametrize("name", LAUNCHES)
@pytest.mark.parametrize("window", DECODE_WINDOWS)
def test_decode_window_partitions(name, window):
    """Each launch partitions only the window's keys: MIXED_LENS and a 300-key context, whose
    48-key window under 16-key tiles and 4 splits runs 3 partitions from position 240."""
    run_decode([*MIXED_LENS, 300], 8, 2, torch.float16, seed=60 + window, window=window,
               **LAUNCHES[name])  # fmt: skip


@needs_triton
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
def test_decode_window_with_sequences_without_a_query(dtype):
    run_decode([*MIXED_LENS, 300], 2, 2, dtype, seed=70, no_query=(1, 6), window=33,
               **FOUR_SPLITS)  # fmt: skip

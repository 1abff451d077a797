"""Greedy argmax over rows of logits: Triton (interpreted on CPU) against torch.argmax, whose
rules it keeps: the first maximal index wins, and a NaN beats every number."""

import pytest
import torch
from kernel_testing import INTERPRET_DTYPES, gpu, needs_triton

from kiln.kernels.argmax import CHUNK, argmax_rows, argmax_rows_triton


def logits_with_edges(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows, plus rows that test the rules: a tie between two chunks (the earlier index
    must win), a NaN after a +inf, an all -inf row."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    if rows >= 4:
        late = vocab - 3
        x[1, 5] = x[1, late] = 50.0  # tie across chunks
        x[2, 3] = float("inf")
        x[2, late] = float("nan")  # NaN wins over the earlier +inf
        x[3] = float("-inf")  # nothing is larger: index 0
    return x


@needs_triton
@pytest.mark.parametrize("vocab", [7, CHUNK, CHUNK + 1, 2 * CHUNK + 333])
@pytest.mark.parametrize("dtype", INTERPRET_DTYPES)
def test_triton_matches_torch(vocab, dtype):
    x = logits_with_edges(5, vocab, dtype, seed=vocab)
    out = argmax_rows_triton(x)
    assert out.dtype == torch.int64
    assert torch.equal(out, x.argmax(dim=-1)), (out, x.argmax(dim=-1))


@needs_triton
def test_ties_within_a_chunk_take_the_first():
    x = torch.zeros(2, 100)
    x[0, [40, 12, 77]] = 1.0
    x[1, [99, 98]] = float("nan")
    assert argmax_rows_triton(x).tolist() == [12, 98]


def test_wrapper_on_cpu_is_torch():
    x = logits_with_edges(4, 50, torch.float32, seed=1)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@gpu
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_gpu(rows):
    x = logits_with_edges(rows, 128256, torch.float32, seed=rows).cuda()
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from kiln.eval import encode_documents, eval_app, greedy_agreement, perplexity, sliding_windows

VOCAB = 11


def bigram_fn(seed: int = 0):
    """A causal model whose next-token logits depend on the current token only."""
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed))
    return lambda ids: table[ids]  # [1, L] -> [1, L, V]


def prefix_fn(ids: torch.Tensor) -> torch.Tensor:
    """Logits depend on the whole prefix (through a running mean), so windows change them."""
    one_hot = torch.nn.functional.one_hot(ids, VOCAB).float()
    steps = torch.arange(1, ids.shape[1] + 1).view(1, -1, 1)
    return 3.0 * one_hot.cumsum(1) / steps


def exact_nll(logits_fn, ids: torch.Tensor) -> float:
    logits = logits_fn(ids.unsqueeze(0))[0, :-1]
    return torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum").item()


@pytest.mark.parametrize(
    "num_tokens,window,stride",
    [(2, 2, 1), (10, 4, 2), (17, 5, 3), (100, 16, 16), (100, 16, 40), (7, 1024, 512)],
)
def test_windows_score_every_target_once_with_enough_context(num_tokens, window, stride):
    scored = []
    for begin, end, first in sliding_windows(num_tokens, window, stride):
        assert 0 <= begin < first <= end <= num_tokens and end - begin <= window
        for target in range(first, end):
            # context is ids[begin:target]; past the first window it holds >= window - stride
            assert begin == 0 or target - begin >= window - min(stride, window - 1)
        scored += range(first, end)
    assert scored == list(range(1, num_tokens))


def test_bad_windows_are_rejected():
    with pytest.raises(ValueError, match="window >= 2"):
        sliding_windows(10, 1, 1)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        sliding_windows(1, 8, 4)


def test_uniform_logits_give_vocab_size():
    ids = torch.randint(0, VOCAB, (50,), generator=torch.Generator().manual_seed(1))
    result = perplexity(lambda x: torch.zeros(1, x.shape[1], VOCAB), ids, window=8)
    assert result.num_tokens == 49
    assert result.perplexity == pytest.approx(VOCAB)


@pytest.mark.parametrize("window,stride", [(4, 1), (8, 3), (16, 16), (64, 32)])
def test_context_free_model_matches_exact_cross_entropy(window, stride):
    ids = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(2))
    fn = bigram_fn()
    result = perplexity(fn, ids, window, stride)
    assert result.nll_sum == pytest.approx(exact_nll(fn, ids), rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(exact_nll(fn, ids) / 59), rel=1e-6)


def test_window_covering_the_stream_is_one_full_forward():
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3))
    assert perplexity(prefix_fn, ids, window=64).nll_sum == pytest.approx(
        exact_nll(prefix_fn, ids), rel=1e-6
    )
    # With short windows the prefix is cut, so the value changes: the windows are real.
    assert perplexity(prefix_fn, ids, window=4, stride=2).nll_sum != pytest.approx(
        exact_nll(prefix_fn, ids), rel=1e-3
    )


def test_greedy_agreement_counts_matching_argmax():
    ids = torch.randint(0, VOCAB, (33,), generator=torch.Generator().manual_seed(4))
    same = greedy_agreement(bigram_fn(0), bigram_fn(0), ids, window=8)
    assert (same.num_positions, same.fraction) == (32, 1.0)
    a, b = bigram_fn(0), bigram_fn(1)
    expected = (a(ids[None])[0, :-1].argmax(-1) == b(ids[None])[0, :-1].argmax(-1)).sum().item()
    assert greedy_agreement(a, b, ids, window=8, stride=3).num_agree == expected


def test_encode_documents_adds_bos_eos_and_truncates():
    class Tok:
        bos_token_id, eos_token_id = 1, 2

        def __call__(self, text, add_special_tokens=True, verbose=True):
            assert not add_special_tokens
            return {"input_ids": [ord(c) for c in text]}

    assert encode_documents(Tok(), ["ab", "c"]).tolist() == [1, 97, 98, 2, 1, 99, 2]
    assert encode_documents(Tok(), ["ab", "c", "never read"], max_tokens=5).tolist() == [
        1,
        97,
        98,
        2,
        1,
    ]


def test_ppl_command_on_a_zoo_model(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text("import os\n\n\ndef main():\n    print(os.getcwd())\n" * 20)
    args = ["ppl", "--model", "kiln-tiny-draft", "--device", "cpu", "--file", str(path)]
    result = CliRunner().invoke(eval_app, [*args, "--max-tokens", "200"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "tokens evaluated: 199" in result.output
    value = float(result.output.split("perplexity:")[1])
    assert 1.0 < value < 50.0  # repetitive code is easy for a code model

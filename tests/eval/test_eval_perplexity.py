from __future__ import annotations

import math

import click
import pytest
import torch
from typer.testing import CliRunner

from kiln.eval import encode_documents, eval_app, greedy_agreement, perplexity, sliding_windows
from kiln.eval.perplexity import _encode, dataset_texts

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


def test_zero_stride_is_rejected_not_taken_for_the_default():
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="stride >= 1"):
        perplexity(bigram_fn(), ids, window=8, stride=0)
    with pytest.raises(ValueError, match="stride >= 1"):
        greedy_agreement(bigram_fn(), bigram_fn(), ids, window=8, stride=0)


@pytest.mark.parametrize("window,stride", [(8, None), (4, 1), (64, 32)])
def test_on_window_reports_each_window_of_the_total(window, stride):
    ids = torch.randint(0, VOCAB, (50,), generator=torch.Generator().manual_seed(6))
    calls = []
    perplexity(bigram_fn(), ids, window, stride, on_window=lambda *c: calls.append(c))
    total = len(sliding_windows(50, window, stride or window // 2))
    assert calls == [(done, total) for done in range(1, total + 1)]
    calls.clear()
    greedy_agreement(bigram_fn(0), bigram_fn(1), ids, window, stride, lambda *c: calls.append(c))
    assert calls == [(done, total) for done in range(1, total + 1)]


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


class Tok:
    """Characters as token ids, with <bos> 1 and <eos> 2."""

    bos_token_id, eos_token_id = 1, 2

    def __call__(self, text, add_special_tokens=True, verbose=True):
        assert not add_special_tokens
        return {"input_ids": [ord(c) for c in text]}


def test_encode_documents_adds_bos_eos_and_truncates():
    assert encode_documents(Tok(), ["ab", "c"]).tolist() == [1, 97, 98, 2, 1, 99, 2]
    assert encode_documents(Tok(), ["ab", "c", "never read"], max_tokens=5).tolist() == [
        1,
        97,
        98,
        2,
        1,
    ]


def test_encode_documents_rejects_a_negative_max_tokens():
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        encode_documents(None, ["never read"], max_tokens=-5)


def test_dataset_texts_checks_its_arguments_at_the_call(tmp_path):
    # no iteration: the errors come before a caller would load a model
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="has no text to score"):
        dataset_texts(None, empty)
    with pytest.raises(ValueError, match="valid: zoo-heldout"):
        dataset_texts("bogus", None)
    with pytest.raises(ValueError, match="exactly one"):
        dataset_texts("zoo-heldout", empty)
    sample = tmp_path / "sample.txt"
    sample.write_text("x = 1\n")
    assert list(dataset_texts(None, sample)) == ["x = 1\n"]


def test_cli_refuses_a_stream_too_short_to_score():
    class BareTok(Tok):
        bos_token_id = eos_token_id = None

    with pytest.raises(click.ClickException, match="one.txt gives 1 token"):
        _encode(BareTok(), ["x"], None, "one.txt")
    assert _encode(Tok(), ["x"], None, "one.txt").tolist() == [1, 120, 2]


def test_ppl_command_on_a_zoo_model(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text("import os\n\n\ndef main():\n    print(os.getcwd())\n" * 20)
    args = ["ppl", "--model", "kiln-tiny-draft", "--device", "cpu", "--file", str(path)]
    result = CliRunner().invoke(eval_app, [*args, "--max-tokens", "200"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "tokens evaluated: 199" in result.output
    value = float(result.output.split("perplexity:")[1])
    assert 1.0 < value < 50.0  # repetitive code is easy for a code model

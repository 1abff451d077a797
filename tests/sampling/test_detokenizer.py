"""Incremental detokenization against a byte-level BPE tokenizer trained here, whose small
vocabulary splits "é", "中文" and emoji across several tokens."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kiln.sampling import IncrementalDetokenizer

CORPUS = [
    "Le café est très bon, n'est-ce pas ? Héhé.",
    "中文字符和标点。你好，世界！",
    "Emoji time: 🙂🎉🚀 and more 🙂 smiles.",
    "Plain ASCII text keeps the merges honest: the quick brown fox.",
] * 10
TEXTS = [
    "café 中文 🙂🎉 done",
    "🚀🚀🚀",
    "naïve — “quotes” 日本語も",
    "ascii only",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def stream(tokenizer, prompt_ids, output_ids, chunk=1, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    pieces = [detok.add(output_ids[i : i + chunk]) for i in range(0, len(output_ids), chunk)]
    return pieces, detok.flush(), detok


def test_multibyte_characters_span_tokens(tokenizer):
    # Precondition: the test is only meaningful if some token is a fragment of a character.
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1
    assert "\ufffd" in tokenizer.decode(ids[:1])


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_pieces_concatenate_to_full_decode(tokenizer, text, chunk):
    prompt = tokenizer.encode("Prompt: 中")
    out = tokenizer.encode(text)
    pieces, tail, detok = stream(tokenizer, prompt, out, chunk)
    assert all("\ufffd" not in p for p in pieces)
    assert tail == ""  # every character was complete, nothing left behind
    assert "".join(pieces) == tokenizer.decode(out) == detok.output_text == text
    assert detok.output_token_ids == out


def test_broken_character_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("a🚀")
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    assert detok.add(ids[:1]) == "a"
    for fragment in ids[1:-1]:
        assert detok.add([fragment]) == ""
    assert detok.add(ids[-1:]) == "🚀"


def test_unfinished_character_released_by_flush(tokenizer):
    ids = tokenizer.encode("ok🎉")[:-1]  # the emoji's last byte never arrives
    pieces, tail, _ = stream(tokenizer, [], ids)
    assert "".join(pieces) == "ok"
    assert "".join(pieces) + tail == tokenizer.decode(ids)
    assert tail.endswith("\ufffd")


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_flag(tokenizer, skip):
    eos = tokenizer.eos_token_id
    out = tokenizer.encode("中文") + [eos] + tokenizer.encode(" é") + [eos]
    pieces, tail, _ = stream(tokenizer, tokenizer.encode("hi"), out, skip_special_tokens=skip)
    text = "".join(pieces) + tail
    assert text == tokenizer.decode(out, skip_special_tokens=skip)
    assert ("<eos>" in text) is not skip


def test_prompt_ending_inside_a_character(tokenizer):
    ids = tokenizer.encode("中文🙂")
    prompt, out = ids[:1], ids[1:]  # the prompt stops mid-character
    assert tokenizer.decode(prompt).endswith("\ufffd")
    pieces, tail, _ = stream(tokenizer, prompt, out)
    assert "".join(pieces) + tail == tokenizer.decode(out)


@settings(max_examples=60, deadline=None, database=None)
@given(data=st.data())
def test_any_token_sequence_round_trips(tokenizer, data):
    # Arbitrary ids include stray continuation bytes and special tokens: whatever the full
    # decode makes of them, the stream must say the same, split at any chunk size.
    vocab = len(tokenizer)
    ids = st.lists(st.integers(0, vocab - 1), max_size=25)
    prompt, out = data.draw(ids), data.draw(ids)
    chunk = data.draw(st.integers(1, 4))
    skip = data.draw(st.booleans())
    pieces, tail, _ = stream(tokenizer, prompt, out, chunk, skip)
    assert "".join(pieces) + tail == tokenizer.decode(out, skip_special_tokens=skip)

import math
import re

import pytest

from kiln.sampling import MAX_LOGPROBS, SamplingParams


def test_logit_bias_normalized_to_a_dict_of_floats():
    assert SamplingParams().logit_bias == {}
    assert SamplingParams(logit_bias={3: 1}).logit_bias == {3: 1.0}


def test_allowed_token_ids_and_bad_words_normalized_to_lists_without_duplicates():
    p = SamplingParams()
    assert p.allowed_token_ids is None and p.bad_words == [] and p.bad_words_token_ids == []
    p = SamplingParams(allowed_token_ids=(4, 2, 4), bad_words=("a", " b", "a"),
                       bad_words_token_ids=((3, 4),))
    assert p.allowed_token_ids == [4, 2]
    assert p.bad_words == ["a", " b"] and p.bad_words_token_ids == [[3, 4]]


class WordTokenizer:
    """Each space-separated piece a token; a piece after a space differs from one that starts
    the text (as byte-level BPE tokenizes 'fox' and ' fox'); unknown pieces are dropped (as a
    normalizer may drop characters)."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens  # a bad word is matched inside the text, without BOS
        return [self.vocab[piece] for piece in re.findall(r" ?[^ ]+", text)
                if piece in self.vocab]


def test_bad_words_tokenized_as_vllm_each_word_plain_and_after_a_space():
    tokenizer = WordTokenizer({"fox": 1, " fox": 2, "red": 3, " red": 4, " dog": 5, "dog": 5,
                               "big": 6, " big": 7})
    # vLLM's update_from_tokenizer: the word without its leading whitespace, then the same
    # after a space where that is as many tokens with another first one
    p = SamplingParams(bad_words=[" fox", "red big", "dog"], bad_words_token_ids=[[9]])
    tokenized = p.with_bad_words_tokenized(tokenizer)
    assert tokenized.bad_words_token_ids == [[9], [1], [2], [3, 7], [4, 7], [5]]
    assert tokenized.bad_words == p.bad_words and p.bad_words_token_ids == [[9]]  # a copy
    plain = SamplingParams()
    assert plain.with_bad_words_tokenized(None) is plain


def test_bad_words_without_a_tokenizer_or_tokens_are_clear_errors():
    with pytest.raises(ValueError, match="SamplingParams.bad_words needs the model's tokenizer"):
        SamplingParams(bad_words=["fox"]).with_bad_words_tokenized(None)
    with pytest.raises(ValueError, match=r"SamplingParams.bad_words entry '\\u200b' tokenizes"):
        SamplingParams(bad_words=["\u200b"]).with_bad_words_tokenized(WordTokenizer({}))


def test_defaults_are_valid_and_normalized():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_k) == (1, 16, 1.0, 0)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.greedy and not p.top_k_enabled and not p.has_penalties


def test_stop_normalized_to_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


@pytest.mark.parametrize(
    ("temperature", "greedy"), [(0.0, True), (1e-6, True), (1e-4, False), (0.7, False)]
)
def test_greedy_threshold(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"top_p": 1.0},
        {"top_p": 1e-3},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"max_tokens": None, "min_tokens": 100},
        {"max_tokens": 3, "min_tokens": 3},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 0.5},
        {"logprobs": 0, "prompt_logprobs": MAX_LOGPROBS},
        {"seed": -5},
        {"seed": 2**70},
        {"logit_bias": {0: -100, 5: 100.0}},
        {"allowed_token_ids": [0]},
        {"bad_words": [], "bad_words_token_ids": [[0]]},
    ],
)
def test_boundary_values_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("field", "value", "extra"),
    [
        ("n", 0, {}),
        ("n", 2.0, {}),
        ("n", True, {}),
        ("max_tokens", 0, {}),
        ("min_tokens", -1, {}),
        ("min_tokens", 5, {"max_tokens": 4}),
        ("temperature", -0.1, {}),
        ("temperature", math.nan, {}),
        ("temperature", math.inf, {}),
        ("top_p", 0.0, {}),
        ("top_p", 1.01, {}),
        ("top_k", -2, {}),
        ("top_k", 2.5, {}),
        ("min_p", -0.01, {}),
        ("min_p", 1.5, {}),
        ("seed", "7", {}),
        ("presence_penalty", 2.5, {}),
        ("frequency_penalty", -2.01, {}),
        ("repetition_penalty", 0.0, {}),
        ("repetition_penalty", -1.0, {}),
        ("logprobs", -1, {}),
        ("logprobs", MAX_LOGPROBS + 1, {}),
        ("prompt_logprobs", MAX_LOGPROBS + 1, {}),
        ("stop", "", {}),
        ("stop", ["ok", ""], {}),
        ("stop_token_ids", [3, -1], {}),
        ("logit_bias", {3: 100.5}, {}),
        ("logit_bias", {-1: 1.0}, {}),
        ("logit_bias", {"3": 1.0}, {}),
        ("logit_bias", {3: math.nan}, {}),
        ("logit_bias", {True: 1.0}, {}),
        ("logit_bias", [3], {}),
        ("allowed_token_ids", [], {}),  # vLLM refuses an empty list too: nothing to sample
        ("allowed_token_ids", [3, -1], {}),
        ("allowed_token_ids", [True], {}),
        ("allowed_token_ids", 3, {}),
        ("bad_words", "fox", {}),  # a string would ban each of its characters
        ("bad_words", ["fox", ""], {}),
        ("bad_words", [" \n"], {}),
        ("bad_words", [3], {}),
        ("bad_words_token_ids", [[]], {}),
        ("bad_words_token_ids", [[1, -2]], {}),
        ("bad_words_token_ids", [1, 2], {}),
    ],
)
def test_bad_field_raises_naming_field_and_value(field, value, extra):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value}, **extra)
    message = str(info.value)
    assert f"SamplingParams.{field} " in message
    assert repr(value) in message or repr(list(value)) in message
    assert "must be" in message  # the valid range follows

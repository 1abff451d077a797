import math

import pytest

from kiln.sampling import MAX_LOGPROBS, SamplingParams


def test_logit_bias_normalized_to_a_dict_of_floats():
    assert SamplingParams().logit_bias == {}
    assert SamplingParams(logit_bias={3: 1}).logit_bias == {3: 1.0}


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
    ],
)
def test_bad_field_raises_naming_field_and_value(field, value, extra):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value}, **extra)
    message = str(info.value)
    assert f"SamplingParams.{field} " in message
    assert repr(value) in message or repr(list(value)) in message
    assert "must be" in message  # the valid range follows

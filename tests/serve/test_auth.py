"""API keys: flag plus environment, Bearer only, nothing printable."""

from __future__ import annotations

from kiln.serve.auth import API_KEY_ENV, KeyChecker, load_api_keys


def test_keys_come_from_flags_and_the_environment():
    environ = {API_KEY_ENV: " env-one, env-two\nenv-three ,"}
    assert load_api_keys(["flag", ""], environ) == ["flag", "env-one", "env-two", "env-three"]
    assert load_api_keys([], {}) == []


def test_checker_accepts_only_a_bearer_with_a_known_key():
    checker = KeyChecker(["alpha", "beta"])
    assert checker.check("Bearer alpha") and checker.check("bearer beta")
    assert checker.check("  Bearer   beta ")
    for header in (None, "", "Bearer", "Bearer alph", "Bearer alphaX", "Basic alpha", "alpha",
                   "Bearer gamma"):
        assert not checker.check(header), header


def test_no_keys_means_open_and_nothing_leaks_through_repr():
    assert KeyChecker([]).check(None)
    checker = KeyChecker(["very-secret"])
    assert "very-secret" not in repr(checker) and "very-secret" not in str(vars(checker))

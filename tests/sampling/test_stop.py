import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.sampling import StopChecker


def run(stop, pieces, include=False):
    checker = StopChecker(stop, include)
    emitted, result = [], (False, None)
    for piece in pieces:
        text, stopped, matched = checker.feed(piece)
        emitted.append(text)
        result = (stopped, matched)
        if stopped:
            break
    if not result[0]:
        emitted.append(checker.flush())
    return emitted, result


def test_stop_string_across_piece_boundaries():
    emitted, result = run(["STOP"], ["Hello wo", "rld ST", "O", "P and more"])
    assert emitted == ["Hello wo", "rld ", "", ""]  # "ST", "STO" held back, then cut
    assert result == (True, "STOP")


def test_before_min_tokens_a_stop_string_may_begin_but_not_end():
    """As vLLM: text before min_tokens is searched for the start of a stop string that ends
    after it, and a stop string wholly before it is plain text."""
    checker = StopChecker(["STOP", "ab"])
    assert checker.feed("ab ST", may_stop=False) == ("ab ", False, None)  # "ST" held back
    assert checker.feed("OP and more") == ("", True, "STOP")  # cut where it began
    checker = StopChecker(["STOP"], include_stop_str_in_output=True)
    assert checker.feed("x ST", may_stop=False) == ("x ", False, None)
    assert checker.feed("OP!") == ("STOP", True, "STOP")
    # fuzzer case: "é" ended inside the held "afé" while stops were off; "afé " ends after
    checker = StopChecker(["é", "afé "])
    assert checker.feed("café", may_stop=False) == ("c", False, None)
    assert checker.feed(" x") == ("", True, "afé ")


def test_include_stop_str_in_output():
    emitted, result = run(["STOP"], ["Hello ST", "OP after"], include=True)
    assert "".join(emitted) == "Hello STOP"
    assert result == (True, "STOP")


def test_earliest_stop_string_wins():
    emitted, result = run(["xyz", "abc"], ["123abc456xyz"])
    assert "".join(emitted) == "123" and result == (True, "abc")
    # Overlapping: "lo" is complete before "world" and before "Hello w..." could finish.
    emitted, result = run(["world", "lo"], ["Hello world"])
    assert "".join(emitted) == "Hel" and result == (True, "lo")


def test_hold_back_released_by_flush_and_by_next_feed():
    checker = StopChecker(["STOP"], False)
    assert checker.feed("abc ST") == ("abc ", False, None)
    assert checker.feed("ART") == ("START", False, None)  # not a stop string after all
    assert checker.feed(" S") == (" ", False, None)
    assert checker.flush() == "S"  # generation ended: the held "S" is real output
    assert checker.flush() == ""


def test_after_stop_nothing_more_is_emitted():
    checker = StopChecker(["\n\n"], False)
    assert checker.feed("line\n") == ("line", False, None)
    assert checker.feed("\nmore") == ("", True, "\n\n")
    assert checker.feed("even more") == ("", True, "\n\n")


def test_no_stop_strings_pass_text_through():
    assert StopChecker([], False).feed("anything") == ("anything", False, None)


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        StopChecker(["ok", ""], False)


def reference(text, stop, include):
    """Token-by-token semantics: the first position where some stop string ends; among stop
    strings ending there, the longest (earliest start)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stop if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return text[: end if include else end - len(s)], (True, s)
    return text, (False, None)


@settings(max_examples=200, deadline=None, database=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    include=st.booleans(),
)
def test_result_does_not_depend_on_how_text_is_split(text, stop, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    emitted, result = run(stop, pieces, include)
    assert ("".join(emitted), result) == reference(text, stop, include)

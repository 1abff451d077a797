"""Stop strings over streamed text: detect them across piece boundaries, hold back what might
still become one, and cut the output where one ends."""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Feed it the detokenizer's pieces in order; it returns what may be shown to the user.

    The stop string completed first wins (earliest end; among those ending together, the one
    starting earliest). That is what token-by-token streaming would see, so the result does not
    depend on how the text was split into pieces.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped = False
        self.matched: str | None = None
        self._held = ""  # tail that is a proper prefix of some stop string

    def feed(self, new_text: str, may_stop: bool = True) -> tuple[str, bool, str | None]:
        """Returns (text safe to emit now, stopped, the stop string that matched or None).

        ``may_stop=False`` (before the request's min_tokens): no stop string may end here, but
        the text is still held back where it may begin one that ends in a later piece."""
        if self.stopped:
            return "", True, self.matched
        if not self.stop:
            return new_text, False, None
        # Any stop string that began in already-emitted text would have left its start in
        # `_held`, so searching held + new finds every match without rescanning the output. A
        # match must end in the new text: one wholly inside `_held` came while stops were off.
        text = self._held + new_text
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self.stop if may_stop else ():
            start = text.find(s, max(len(self._held) - len(s) + 1, 0))
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is not None:
            end, start, s = best
            self.stopped, self.matched, self._held = True, s, ""
            return text[: end if self.include_stop_str_in_output else start], True, s
        hold = self._partial_match_len(text)
        self._held = text[len(text) - hold :]
        return text[: len(text) - hold], False, None

    def flush(self) -> str:
        """At finish (EOS, length): release the held-back tail; it never became a stop string."""
        held, self._held = self._held, ""
        return held

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

"""API keys: one or more, from ``--api-key`` or ``KILN_API_KEY``, checked in constant time.

Keys are kept only as SHA-256 digests, so no log line or repr can print one, and comparing
equal-length digests with ``hmac.compare_digest`` against every key leaks neither which key
matched nor how much of a wrong key was right.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterable, Mapping

API_KEY_ENV = "KILN_API_KEY"  # one key, or several separated by commas or whitespace


def load_api_keys(flag_keys: Iterable[str] = (),
                  environ: Mapping[str, str] | None = None) -> list[str]:
    """The keys given on the command line plus those in ``KILN_API_KEY``, without blanks."""
    environ = os.environ if environ is None else environ
    keys = [k for k in flag_keys if k]
    keys += [k for k in re.split(r"[,\s]+", environ.get(API_KEY_ENV, "")) if k]
    return keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class KeyChecker:
    """Checks ``Authorization: Bearer KEY`` headers; with no keys configured everything passes."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests = [_digest(k) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __repr__(self) -> str:
        return f"KeyChecker({len(self._digests)} keys)"

    def check(self, authorization: str | None) -> bool:
        if not self._digests:
            return True
        scheme, _, token = (authorization or "").strip().partition(" ")
        candidate = _digest(token.strip())
        matched = False
        for digest in self._digests:  # no early exit: the time taken says nothing
            matched |= hmac.compare_digest(candidate, digest)
        return matched and scheme.lower() == "bearer"

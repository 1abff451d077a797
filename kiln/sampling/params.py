"""Per-request sampling parameters, named as in vLLM so users can switch engines freely."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

# Below this temperature a request is greedy: dividing logits by ~0 would overflow, and the
# distribution is a point mass on the argmax anyway (vLLM's sampler uses the same threshold).
# Deliberately unlike vLLM, a temperature in (0, 0.01) is kept: vLLM's SamplingParams raises
# it to 0.01 (with a warning) against NaNs, which float32 logits with the max subtracted in
# softmax do not produce here, so 1e-6 is greedy and 1e-3 samples at 1e-3.
SAMPLING_EPS = 1e-5
# vLLM's cap on logprobs; larger values make the top-k gather and host transfer costly.
MAX_LOGPROBS = 20


def _fail(field: str, value: object, valid: str, owner: str = "SamplingParams") -> None:
    raise ValueError(f"{owner}.{field} must be {valid}, got {value!r}")


def _check_int(field: str, value: object, valid: str, ok) -> None:
    # bool is an int subclass; `n=True` is a bug at the caller, not a count.
    if not isinstance(value, int) or isinstance(value, bool) or not ok(value):
        _fail(field, value, valid)


def _check_float(field: str, value: object, valid: str, ok) -> None:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or math.isnan(value)
        or not ok(value)
    ):
        _fail(field, value, valid)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_token_id_list(value: object) -> bool:
    return isinstance(value, list | tuple) and len(value) > 0 and all(map(_is_token_id, value))


# the constraints of StructuredOutputsParams, one of which a request sets
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_STRUCTURED = "StructuredOutputsParams"


def _is_text(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def _json_schema(value: object) -> dict[str, Any]:
    """A schema given as a dict or as its JSON text, as a dict."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        _fail("json", value, "a JSON schema: an object, or its JSON text", _STRUCTURED)
    try:
        json.dumps(value, allow_nan=False)  # compiled from its JSON text
    except (TypeError, ValueError) as exc:
        raise ValueError(f"StructuredOutputsParams.json is not JSON data: {exc}") from None
    return value


@dataclass
class StructuredOutputsParams:
    """vLLM v1's structured outputs: the output follows exactly one of a JSON schema (`json`, a
    dict or its JSON text), a regular expression, one of `choice`'s strings, an EBNF grammar
    (xgrammar's dialect, whose start rule is `root`), or any JSON object (`json_object=True`).
    `disable_any_whitespace` leaves no whitespace between JSON tokens (vLLM's option): a
    schema otherwise allows any, which a weak model may fill its tokens with.

    A schema given as text is parsed once here (`json` then holds the dict); whether the
    schema, regex or grammar compiles is checked when the engine takes the request."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) is not None]
        if len(kinds) != 1:
            raise ValueError(f"StructuredOutputsParams takes exactly one of "
                             f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; got "
                             f"{', '.join(kinds) if kinds else 'none'}")
        if self.json is not None:
            self.json = _json_schema(self.json)
        # (xgrammar's native regex parser reads a NUL as the pattern's end, as vLLM notes)
        if self.regex is not None and (not _is_text(self.regex) or "\x00" in self.regex):
            _fail("regex", self.regex, "a non-empty string without NUL characters", _STRUCTURED)
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice or not all(
                    map(_is_text, self.choice)):
                _fail("choice", self.choice, "a non-empty list of non-empty strings", _STRUCTURED)
            self.choice = list(self.choice)
        if self.grammar is not None and not _is_text(self.grammar):
            _fail("grammar", self.grammar, "a non-empty string (EBNF)", _STRUCTURED)
        if self.json_object is not None and self.json_object is not True:
            _fail("json_object", self.json_object, "True (or None: not this kind)", _STRUCTURED)
        if not isinstance(self.disable_any_whitespace, bool):
            _fail("disable_any_whitespace", self.disable_any_whitespace, "a boolean", _STRUCTURED)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of STRUCTURED_OUTPUT_KINDS."""
        return next(kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) is not None)


@dataclass
class SamplingParams:
    """How to pick tokens for one request, and when to stop.

    `top_k` of 0 or -1 turns top-k off. `stop` is normalized to a list and `stop_token_ids` to a
    list once validated; `logprobs`/`prompt_logprobs` count the top alternatives returned per
    token (0 returns only the chosen token's logprob).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's: added to the raw logits of these token ids before penalties and sampling
    # (vLLM's order); normalized to a dict, {} when none
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids may be sampled (every other logit is -inf); None: any
    allowed_token_ids: list[int] | None = None
    # vLLM's: a word's last token is banned wherever the output so far ends with the tokens
    # before it (a one-token word: always); normalized to a list, [] when none
    bad_words: list[str] | None = None
    # the bad words as token ids: given directly, and the engine appends `bad_words` tokenized
    # with the model's tokenizer (with_bad_words_tokenized)
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM v1's: the output follows a JSON schema, regex, choice or grammar (xgrammar)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, "an integer >= 1", lambda v: v >= 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, "None or an integer >= 1", lambda v: v >= 1)
        _check_int("min_tokens", self.min_tokens, "an integer >= 0", lambda v: v >= 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        _check_float(
            "temperature",
            self.temperature,
            "a finite number >= 0",
            lambda v: 0 <= v < math.inf,
        )
        _check_float("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        _check_int("top_k", self.top_k, "-1 or 0 (off) or an integer >= 1", lambda v: v >= -1)
        _check_float("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        if self.seed is not None:
            _check_int("seed", self.seed, "None or an integer", lambda v: True)
        for field in ("presence_penalty", "frequency_penalty"):
            _check_float(field, getattr(self, field), "in [-2, 2]", lambda v: -2 <= v <= 2)
        _check_float(
            "repetition_penalty",
            self.repetition_penalty,
            "a finite number > 0",
            lambda v: 0 < v < math.inf,
        )
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None:
                _check_int(
                    field,
                    value,
                    f"None or an integer in [0, {MAX_LOGPROBS}]",
                    lambda v: 0 <= v <= MAX_LOGPROBS,
                )

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        for s in self.stop:
            # An empty stop string would match before the first token.
            if not isinstance(s, str) or not s:
                _fail("stop", self.stop, "a non-empty string or a list of non-empty strings")

        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        for t in self.stop_token_ids:
            if not _is_token_id(t):
                _fail("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        bias = {} if self.logit_bias is None else self.logit_bias
        if not isinstance(bias, dict) or not all(
                _is_token_id(t) and isinstance(b, int | float) and not isinstance(b, bool)
                and -100 <= b <= 100 for t, b in bias.items()):
            _fail("logit_bias", self.logit_bias,
                  "a dict of token id >= 0 -> bias in [-100, 100] (OpenAI's range)")
        self.logit_bias = {t: float(b) for t, b in bias.items()}
        if self.allowed_token_ids is not None:
            if not _is_token_id_list(self.allowed_token_ids):
                _fail("allowed_token_ids", self.allowed_token_ids,
                      "None (any token) or a non-empty list of token ids >= 0")
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        words = [] if self.bad_words is None else self.bad_words
        # (a bare string would otherwise ban each of its characters)
        if not isinstance(words, list | tuple) or not all(
                isinstance(w, str) and w.strip() for w in words):
            _fail("bad_words", self.bad_words,
                  "a list of words, each with a character other than whitespace")
        self.bad_words = list(dict.fromkeys(words))  # duplicates dropped, as vLLM does
        ids = [] if self.bad_words_token_ids is None else self.bad_words_token_ids
        if not isinstance(ids, list | tuple) or not all(map(_is_token_id_list, ids)):
            _fail("bad_words_token_ids", self.bad_words_token_ids,
                  "a list of non-empty lists of token ids >= 0")
        self.bad_words_token_ids = [list(word) for word in ids]
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            _fail("structured_outputs", self.structured_outputs,
                  "None or a kiln.StructuredOutputsParams")

    def with_bad_words_tokenized(self, tokenizer: Any) -> SamplingParams:
        """A copy whose bad_words_token_ids also hold `bad_words` tokenized (self if it has
        none), as vLLM's update_from_tokenizer does: each word with its leading whitespace
        stripped, and once more after a space (a word inside the text is tokenized apart from
        one that starts it), the latter only where it is as many tokens with another first
        token. Once per request: the sampler matches token ids at every step."""
        if not self.bad_words:
            return self
        if tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs the model's tokenizer and this "
                             "model has none; give the words as bad_words_token_ids instead")
        ids = list(self.bad_words_token_ids)
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError(f"SamplingParams.bad_words entry {word!r} tokenizes to no "
                                 f"tokens; drop it")
            ids.append(plain)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if len(spaced) == len(plain) and spaced[0] != plain[0]:
                ids.append(spaced)
        return replace(self, bad_words_token_ids=ids)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature below SAMPLING_EPS)."""
        return self.temperature < SAMPLING_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

"""One generated sequence: its tokens, its text, and the rules that decide when it stops.

Shared by the reference generator and the paged engine so that both stop, detokenize and
report logprobs the same way.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kiln.outputs import CompletionOutput, TokenLogprobs
from kiln.sampling.detokenizer import IncrementalDetokenizer
from kiln.sampling.grammar import GrammarState
from kiln.sampling.params import SamplingParams
from kiln.sampling.stop import StopChecker

log = logging.getLogger("kiln.engine")


class Sequence:
    def __init__(self, seq_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, eos_token_ids: tuple[int, ...], max_model_len: int,
                 tokenizer: Any = None, generator: torch.Generator | None = None,
                 grammar: GrammarState | None = None) -> None:
        self.seq_id = seq_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.generator = generator
        self.grammar = grammar  # structured outputs: where the output is in its grammar
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache (paged engine only)
        self.text = ""
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detokenizer = (IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                   params.skip_special_tokens)
                            if tokenizer is not None else None)
        self.stop_checker = (StopChecker(params.stop, params.include_stop_str_in_output)
                             if params.stop and tokenizer is not None else None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (decode reads one token)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    def append_token(self, token_id: int, logprob: float | None = None,
                     top_logprobs: TokenLogprobs | None = None) -> str:
        """Record a sampled token; returns the text it adds (may be empty while held back)."""
        if self.grammar is not None and not self.grammar.accept(token_id):
            return self._leave_grammar(token_id)
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.cumulative_logprob += logprob
        if self.logprobs is not None:
            entry = dict(top_logprobs or {})
            if logprob is not None:
                entry[token_id] = logprob
            self.logprobs.append(entry)
        params = self.params
        may_end = len(self.output_token_ids) >= params.min_tokens
        # a grammar ends on an EOS it allowed, and the output with it (as vLLM), ignore_eos or not
        eos = ((self.grammar is not None and self.grammar.terminated)
               or (may_end and not params.ignore_eos and token_id in self.eos_token_ids))
        if eos or (may_end and token_id in params.stop_token_ids):
            stop_reason = None if eos else token_id  # as vLLM: EOS first, else the id
            delta = ""
            # as vLLM, the token's own text is dropped unless include_stop_str_in_output; what
            # the tokens before it still hold back (an unfinished character) is flushed either way
            if params.include_stop_str_in_output and self.detokenizer is not None:
                delta, stopped = self._feed_stop_strings(self.detokenizer.add([token_id]))
                if stopped:
                    return delta
            return self._finish_flushed("stop", stop_reason, delta)
        delta = self.detokenizer.add([token_id]) if self.detokenizer is not None else ""
        return self._check_stop(delta)

    def _leave_grammar(self, token_id: int) -> str:
        """End the output before a token its grammar refuses. The sampler masks the logits with
        the grammar, so it picks such a token only when its other bans leave no token the
        grammar allows (min_tokens banning the EOS that ends a complete grammar,
        allowed_token_ids or bad words excluding all it allows): every logit is then -inf."""
        log.warning("sequence %s: sampled token %d is outside its structured-output grammar "
                    "(min_tokens, allowed_token_ids or bad_words left it no token); its output "
                    "ends here", self.seq_id, token_id)
        return self._finish_flushed("abort", None)

    def _feed_stop_strings(self, delta: str) -> tuple[str, bool]:
        """Pass new text through the stop strings: what may be shown now, and whether one of
        them ended the output (then finished, its text in)."""
        if self.stop_checker is None:
            return delta, False
        # as vLLM: a stop string may begin within the first min_tokens tokens' text but end only
        # in a later token's, as EOS comes at the earliest after min_tokens tokens
        delta, stopped, matched = self.stop_checker.feed(
            delta, len(self.output_token_ids) > self.params.min_tokens)
        if stopped:
            self.text += delta
            self.finish_reason, self.stop_reason = "stop", matched
        return delta, stopped

    def _check_stop(self, delta: str) -> str:
        delta, stopped = self._feed_stop_strings(delta)
        if stopped:
            return delta
        params = self.params
        if (params.max_tokens is not None and len(self.output_token_ids) >= params.max_tokens) \
                or self.num_tokens >= self.max_model_len:
            return self._finish_flushed("length", None, delta)
        self.text += delta
        return delta

    def _finish_flushed(self, reason: str, stop_reason: int | str | None, delta: str = "") -> str:
        """Finish after ``delta`` (text already past the stop strings). Bytes of an unfinished
        character are released as decode() shows them (U+FFFD), and may still complete a stop
        string (not before min_tokens: max_model_len can cut earlier)."""
        self.text += delta
        tail = self.detokenizer.flush() if self.detokenizer is not None else ""
        tail, stopped = self._feed_stop_strings(tail) if tail else ("", False)
        if stopped:
            return delta + tail
        return delta + self._finish(reason, stop_reason, tail)

    def _finish(self, reason: str, stop_reason: int | str | None, delta: str) -> str:
        if self.stop_checker is not None:
            delta += self.stop_checker.flush()  # text held back for a stop string that never came
        self.text += delta
        self.finish_reason, self.stop_reason = reason, stop_reason
        return delta

    def abort(self, reason: str = "abort") -> None:
        if self.finish_reason is None:
            self.finish_reason = reason

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index, text=self.text, token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
        )


def apply_sampler_output(seqs: list[Sequence], token_ids: torch.Tensor,
                         logprobs: Any | None) -> list[str]:
    """Append row i's sampled token to ``seqs[i]``; one host transfer for the whole batch.

    ``logprobs`` is the sampler's ``LogprobsTensors`` (or None); each sequence keeps its own
    top-k. Returns each sequence's new text.
    """
    tokens = token_ids.tolist()
    chosen = top_ids = top_vals = None
    if logprobs is not None:
        chosen = logprobs.token_logprobs.tolist()
        top_ids = logprobs.topk_token_ids.tolist()
        top_vals = logprobs.topk_logprobs.tolist()
    deltas = []
    for row, seq in enumerate(seqs):
        k = seq.params.logprobs
        if k is None or chosen is None:
            deltas.append(seq.append_token(tokens[row]))
            continue
        top = dict(zip(top_ids[row][:k], top_vals[row][:k], strict=True))
        deltas.append(seq.append_token(tokens[row], chosen[row], top))
    return deltas


def prompt_logprobs_to_dicts(logprobs: Any, prompt_token_ids: list[int],
                             k: int) -> list[TokenLogprobs | None]:
    """Sampler prompt logprobs -> per prompt token dicts (the first token has none)."""
    chosen = logprobs.token_logprobs.tolist()
    top_ids = logprobs.topk_token_ids.tolist()
    top_vals = logprobs.topk_logprobs.tolist()
    result: list[TokenLogprobs | None] = [None]
    for i, token in enumerate(prompt_token_ids[1:]):
        entry = dict(zip(top_ids[i][:k], top_vals[i][:k], strict=True))
        entry[token] = chosen[i]
        result.append(entry)
    return result

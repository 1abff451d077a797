"""A request in the engine: its prompt, its n sample sequences and its lifecycle."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from kiln.engine.sequence import Sequence
from kiln.outputs import RequestMetrics, RequestOutput, TokenLogprobs
from kiln.sampling.grammar import GrammarState
from kiln.sampling.params import SamplingParams
from kiln.sampling.sampler import generator_for

if TYPE_CHECKING:
    import xgrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not started, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV moved to CPU memory
    FINISHED = "finished"


class Request:
    """One prompt and its ``params.n`` samples.

    Until the prompt is prefilled only ``seqs[0]`` runs; its last prompt position is then sampled
    once per sample and the other sequences fork its KV blocks (shared, copy-on-write). After
    the fork every unfinished sequence runs on its own. ``grammar`` (xgrammar's compiled
    grammar of ``params.structured_outputs``) gives each sample a matcher of its own.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...], max_model_len: int, tokenizer: Any,
                 device: Any, prompt: str | None = None, arrival_time: float | None = None,
                 stream: bool = True,
                 grammar: xgrammar.CompiledGrammar | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.stream = stream  # emit an output every step, or only the final one
        self.status = RequestStatus.WAITING
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        self.seqs = [
            Sequence(f"{request_id}#{i}", i, prompt_token_ids, params, eos_token_ids,
                     max_model_len, tokenizer,
                     generator_for(params.seed, i, device) if params.seed is not None else None,
                     GrammarState(grammar) if grammar is not None else None)
            for i in range(params.n)
        ]
        self.forked = params.n == 1
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.prompt_logprob_ranks: list[int | None] | None = (
            [None] if params.prompt_logprobs is not None else None)

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def active_seqs(self) -> list[Sequence]:
        """Sequences that need compute: the first alone until the fork, then every unfinished."""
        if not self.forked:
            return [] if self.seqs[0].finished else [self.seqs[0]]
        return [s for s in self.seqs if not s.finished]

    def abort(self, reason: str = "abort") -> None:
        for seq in self.seqs:
            seq.abort(reason)
        self.status = RequestStatus.FINISHED

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.to_output() for s in self.seqs], finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            prompt_logprob_ranks=self.prompt_logprob_ranks, metrics=self.metrics)

"""What generation returns: a ``RequestOutput`` per prompt, a ``CompletionOutput`` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

# per generated token: token id -> logprob for the top-k, always including the chosen token
TokenLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic seconds) the server and benchmarks read."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # each prompt token's rank among the vocabulary (1 = most likely; None for the first),
    # set with prompt_logprobs: a token outside their top-k has a rank they do not tell
    prompt_logprob_ranks: list[int | None] | None = None
    metrics: RequestMetrics | None = None

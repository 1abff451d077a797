"""From a validated API request to engine requests and back: the part both endpoints share.

An API request holds one or more prompts, each sampled ``n`` times; each prompt is one engine
request. ``merged_outputs`` runs them side by side and yields ``(prompt_index, output)`` as
tokens arrive. Closing it (the client left, the stream was cancelled) aborts whatever is still
running, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from fastapi import Request

from kiln.engine.async_engine import AsyncEngine
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.sampling.params import SamplingParams
from kiln.serve.errors import APIError, bad_request
from kiln.serve.metrics import ServerMetrics
from kiln.serve.protocol import Logprob, PromptLogprobs, Usage
from kiln.serve.state import ServerState, finite_logprob
from kiln.serve.structured import StructuredRequest

T = TypeVar("T")


def check_text(value: str, param: str) -> str:
    """Reject lone surrogates (legal in JSON escapes): tokenizers and JSON output refuse them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param} is not valid Unicode (it holds a lone surrogate)",
                       param=param) from None
    return value


# Options that would change what is generated and that Kiln does not implement (vLLM's
# extensions). Unknown fields are otherwise ignored, so a request setting one of these would get
# an answer as if it had not: it is refused instead, naming the field.
UNSUPPORTED = ("guided_whitespace_pattern", "logits_processors")


def refuse_unsupported(body: Any, names: Sequence[str] = ()) -> None:
    """400 for the first of ``UNSUPPORTED`` and ``names`` the request sets (null, [] and {}
    set nothing), for stream_options set on a request that does not stream, or for
    prompt_logprobs asked of one that does."""
    sent = body.model_extra or {}
    for name in (*UNSUPPORTED, *names):
        if sent.get(name) not in (None, [], {}):
            raise APIError(400, f"{name} is not supported", param=name)
    # As vLLM: options for a stream that will not be sent (include_usage would give no usage
    # chunk) are a client's mistake, not something to drop silently.
    if body.stream_options is not None and body.stream_options.model_fields_set \
            and not body.stream:
        raise APIError(400, "stream_options can only be set when stream is true",
                       param="stream_options")
    # As vLLM: a stream's chunks have no place for them (0 asks for none and passes)
    if body.stream and body.prompt_logprobs:
        raise APIError(400, "prompt_logprobs are not available when stream is true; ask for "
                            "them without streaming", param="prompt_logprobs")


def resolve_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                       param: str = "max_tokens") -> int:
    """The request's output budget; 400 (with both numbers) when it cannot fit the context.

    ``param`` is the request field that gave ``max_tokens`` (chat's max_completion_tokens).
    """
    if num_prompt_tokens >= max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, "
                            f"but the prompt has {num_prompt_tokens} tokens; shorten it to at "
                            f"most {max_model_len - 1}", param="prompt",
                       code="context_length_exceeded")
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, "
                            f"but {num_prompt_tokens + max_tokens} were requested "
                            f"({num_prompt_tokens} in the prompt, {max_tokens} to generate); "
                            f"lower {param} to at most {room} or shorten the prompt",
                       param=param, code="context_length_exceeded")
    return max_tokens


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, keyed by token ids written as strings (JSON keys are strings)."""
    if not bias:
        return None
    for key in bias:
        if not (key.isascii() and key.isdigit()):
            raise APIError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias")
    return {int(k): v for k, v in bias.items()}


def sampling_params(body: Any, max_tokens: int, logprobs: int | None,
                    request_fields: Mapping[str, str] | None = None,
                    prompt_logprobs: int | None = None,
                    structured: StructuredRequest | None = None) -> SamplingParams:
    """SamplingParams from the fields both endpoints share; bad values -> 400 naming the field.

    ``request_fields`` maps SamplingParams fields to the request fields that gave them where
    the names differ (chat's top_logprobs gives logprobs). ``prompt_logprobs`` is what the
    request's own prompt_logprobs defaults to (completions' echo returns the prompt's logprobs
    too, as many alternatives as the completion's, unless prompt_logprobs says, as in vLLM).
    ``structured`` is the request's structured outputs (``structured_outputs_of``).
    """
    stop = body.stop
    for s in [stop] if isinstance(stop, str) else stop or []:
        check_text(s, "stop")
    for word in body.bad_words or []:
        check_text(word, "bad_words")

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    try:
        return SamplingParams(
            n=body.n, max_tokens=max_tokens, min_tokens=body.min_tokens,
            temperature=given(body.temperature, 1.0), top_p=given(body.top_p, 1.0),
            top_k=given(body.top_k, 0), min_p=given(body.min_p, 0.0), seed=body.seed,
            stop=stop, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
            presence_penalty=given(body.presence_penalty, 0.0),
            frequency_penalty=given(body.frequency_penalty, 0.0),
            repetition_penalty=given(body.repetition_penalty, 1.0), logprobs=logprobs,
            prompt_logprobs=given(body.prompt_logprobs, prompt_logprobs),
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logit_bias=_logit_bias(body.logit_bias), allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words,
            structured_outputs=structured.params if structured is not None else None)
    except (ValueError, TypeError) as exc:
        raise bad_request(exc, request_fields) from None


def prompt_logprobs_of(state: ServerState, tokenizer: Any,
                       output: RequestOutput) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs of an output that has them: per prompt token (the first has none:
    null), the token first, then its top alternatives, each with its logprob, its rank (tied
    logprobs share the best rank, as in the sampler's logprobs) and its text."""
    if output.prompt_logprobs is None:
        return None
    result: PromptLogprobs = []
    for token_id, entry, rank in zip(output.prompt_token_ids, output.prompt_logprobs,
                                     output.prompt_logprob_ranks, strict=True):
        if entry is None:
            result.append(None)
            continue
        top = sorted(entry.items(), key=lambda kv: -kv[1])
        ranks: dict[int, int] = {}
        for i, (t, lp) in enumerate(top):  # 1 + the entries strictly above: as in the vocab
            ranks[t] = ranks[top[i - 1][0]] if i and lp == top[i - 1][1] else i + 1
        ranks[token_id] = rank  # the engine's: the prompt token may be outside the top-k
        result.append({t: Logprob(logprob=finite_logprob(entry[t]), rank=ranks[t],
                                  decoded_token=state.token_text(tokenizer, t))
                       for t in [token_id, *(t for t, _ in top if t != token_id)]})
    return result


def running_usage(body: Any, num_prompt_tokens: int, num_completion_tokens: int
                  ) -> dict[str, Any]:
    """A stream chunk's ``usage`` entry under vLLM's ``continuous_usage_stats`` (which counts
    only with ``include_usage``): its prompt's tokens and its choice's tokens so far; ``{}``
    otherwise, so that the chunk is as without it."""
    options = body.stream_options
    if not (options and options.include_usage and options.continuous_usage_stats):
        return {}
    return {"usage": Usage.of(num_prompt_tokens, num_completion_tokens).model_dump()}


def usage_of(prompts: list[list[int]], finals: dict[int, RequestOutput]) -> Usage:
    return Usage.of(sum(len(p) for p in prompts),
                    sum(len(c.token_ids) for o in finals.values() for c in o.outputs))


async def merged_outputs(engine: AsyncEngine, prompts: list[list[int]],
                         params: list[SamplingParams], request_id: str, metrics: ServerMetrics,
                         admit: Callable[[], None] | None = None
                         ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(prompt_index, cumulative output)`` for every prompt until all finish.

    ``params[i]`` samples ``prompts[i]`` (their max_tokens may differ: each prompt's own room).
    ``admit`` (the 429 check) runs in the same event-loop step that hands every prompt to the
    engine, so a burst of requests cannot all pass it before any of them is counted.
    """
    if admit is not None:
        admit()
    ids = [f"{request_id}-{i}" for i in range(len(prompts))]
    streams: list[AsyncIterator[RequestOutput]] = []
    try:  # a prompt the engine rejects (ValueError) raises here, before any output
        for prompt, p, engine_id in zip(prompts, params, ids, strict=True):
            streams.append(engine.submit(prompt, p, engine_id))
    except BaseException:
        for engine_id in ids[:len(streams)]:
            engine.abort(engine_id)
        raise
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for output in streams[index]:
                queue.put_nowait((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, exc))

    pumps = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
    running = set(range(len(prompts)))
    latest: dict[int, RequestOutput] = {}  # for the metrics of a prompt that never finishes
    try:
        while running:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            latest[index] = item
            if item.finished:
                running.discard(index)
                metrics.observe_finished(item, params[index])
            yield index, item
    finally:
        for index in running:  # (a pump cancelled before it started cannot abort by itself)
            engine.abort(ids[index])
        for task in pumps:
            task.cancel()
        if running:  # aborted here, or failed in the engine (which aborted them)
            metrics.observe_aborted(sum(params[i].n for i in running),
                                    [latest[i] for i in running if i in latest])
        # Only waits for the pumps to stop: when this consumer is itself being cancelled
        # (anyio cancels again at every await) they still finish on their own.
        await asyncio.gather(*pumps, return_exceptions=True)


async def collect_finals(outputs: AsyncIterator[tuple[int, RequestOutput]]
                         ) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for index, output in outputs:
        if output.finished:
            finals[index] = output
    return finals


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first (then 499, as nginx logs).

    The body is already read, so the next ASGI message is ``http.disconnect``; watching for it
    is how a non-streaming request notices that nobody waits for its answer any more.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise APIError(499, "client closed the request")
    return task.result()


class DeltaTracker:
    """What each streamed choice has sent so far, so that every chunk carries only news."""

    def __init__(self) -> None:
        self._sent: dict[tuple[int, int], tuple[int, int]] = {}  # -> (chars, tokens) sent
        self._done: set[tuple[int, int]] = set()

    def advance(self, prompt_index: int, choice: CompletionOutput) -> tuple[int, int] | None:
        """(chars, tokens) sent before this output, or None when it holds nothing new."""
        key = (prompt_index, choice.index)
        if key in self._done:
            return None
        before = self._sent.get(key, (0, 0))
        if not choice.finished and before == (len(choice.text), len(choice.token_ids)):
            return None
        if choice.finished:
            self._done.add(key)
        self._sent[key] = (len(choice.text), len(choice.token_ids))
        return before

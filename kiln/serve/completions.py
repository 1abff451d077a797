"""``POST /v1/completions``: prompts as a string, strings, token ids or lists of token ids."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kiln.engine.inputs import tokenize_prompt
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.serve.errors import APIError, bad_request
from kiln.serve.generation import (
    DeltaTracker,
    check_text,
    collect_finals,
    merged_outputs,
    refuse_unsupported,
    resolve_max_tokens,
    sampling_params,
    unless_disconnected,
    usage_of,
)
from kiln.serve.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kiln.serve.state import ServerState, finite_logprob
from kiln.serve.streaming import SSEResponse, event_stream


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty; give a string, strings, or token ids",
                       param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def tokenize_prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    engine = state.ready_engine()
    vocab_size = engine.engine.loaded.arch.vocab_size
    ids = []
    for item in _prompt_list(prompt):
        if isinstance(item, str):
            check_text(item, "prompt")
        try:
            ids.append(tokenize_prompt(item, engine.tokenizer, vocab_size).token_ids)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param="prompt") from None
    return ids


def completion_logprobs(state: ServerState, tokenizer: Any, choice: CompletionOutput,
                        start: int, text_offset: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs for tokens[start:], offsets counted from ``text_offset``."""
    result = CompletionLogprobs()
    for token_id, entry in zip(choice.token_ids[start:], (choice.logprobs or [])[start:],
                               strict=False):
        token = state.token_text(tokenizer, token_id)
        result.tokens.append(token)
        result.token_logprobs.append(finite_logprob(entry.get(token_id, float("nan"))))
        result.top_logprobs.append({state.token_text(tokenizer, t): finite_logprob(lp)
                                    for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


async def create_completion(state: ServerState, body: CompletionRequest,
                            request: Request) -> Response | CompletionResponse:
    engine = state.ready_engine()
    state.check_model(body.model)
    refuse_unsupported(body)
    for field, off in (("echo", not body.echo), ("suffix", body.suffix is None),
                       ("best_of", body.best_of in (None, body.n))):
        if not off:
            raise APIError(400, f"{field} is not supported", param=field)
    prompts = tokenize_prompts(state, body.prompt)
    # per prompt, as in vLLM: max_tokens null gives each the rest of the context after it
    params = [sampling_params(body, resolve_max_tokens(len(p), body.max_tokens,
                                                       engine.max_model_len), body.logprobs)
              for p in prompts]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created, tokenizer, n = int(time.time()), engine.tokenizer, body.n
    outputs = merged_outputs(engine, prompts, params, request_id, state.metrics,
                             admit=lambda: state.check_queue(engine))

    if not body.stream:
        try:
            finals = await unless_disconnected(request, collect_finals(outputs))
        except (ValueError, TypeError) as exc:
            raise bad_request(exc) from None
        choices = [
            CompletionChoice(
                index=i * n + c.index, text=c.text, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                logprobs=(completion_logprobs(state, tokenizer, c, 0, 0)
                          if body.logprobs is not None else None))
            for i in sorted(finals) for c in finals[i].outputs]
        return CompletionResponse(id=request_id, created=created, model=state.model_name,
                                  choices=choices, usage=usage_of(prompts, finals))

    try:
        first = await unless_disconnected(request, outputs.__anext__())
    except (ValueError, TypeError) as exc:
        raise bad_request(exc) from None
    tracker = DeltaTracker()
    finals: dict[int, RequestOutput] = {}
    # Where each choice's next token starts in its token texts, as the non-streaming answer
    # counts text_offset: the text sent so far lags the tokens while a stop string may follow.
    offsets: dict[tuple[int, int], int] = {}

    def logprobs_of(index: int, c: CompletionOutput, num_tokens: int) -> CompletionLogprobs:
        start = offsets.get((index, c.index), 0)
        logprobs = completion_logprobs(state, tokenizer, c, num_tokens, start)
        offsets[(index, c.index)] = start + sum(len(token) for token in logprobs.tokens)
        return logprobs

    def to_chunks(index: int, output: RequestOutput) -> Iterator[dict[str, Any]]:
        if output.finished:
            finals[index] = output
        for c in output.outputs:
            already = tracker.advance(index, c)
            if already is None:
                continue
            num_chars, num_tokens = already
            logprobs = (logprobs_of(index, c, num_tokens) if body.logprobs is not None
                        else None)
            yield {"id": request_id, "object": "text_completion", "created": created,
                   "model": state.model_name,
                   "choices": [{"index": index * n + c.index, "text": c.text[num_chars:],
                                "logprobs": logprobs.model_dump() if logprobs else None,
                                "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason}]}

    def final() -> Iterator[dict[str, Any]]:
        if body.stream_options and body.stream_options.include_usage:
            yield {"id": request_id, "object": "text_completion", "created": created,
                   "model": state.model_name, "choices": [],
                   "usage": usage_of(prompts, finals).model_dump()}

    return SSEResponse(event_stream(first, outputs, to_chunks, final=final))

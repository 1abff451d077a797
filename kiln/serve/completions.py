"""``POST /v1/completions``: prompts as a string, strings, token ids or lists of token ids."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kiln.engine.inputs import Prompt, tokenize_prompt
from kiln.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from kiln.serve.errors import APIError, bad_request
from kiln.serve.generation import (
    DeltaTracker,
    check_text,
    collect_finals,
    merged_outputs,
    prompt_logprobs_of,
    refuse_unsupported,
    resolve_max_tokens,
    running_usage,
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
from kiln.serve.structured import compile_grammar, structured_outputs_of


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty; give a string, strings, or token ids",
                       param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def tokenize_prompts(state: ServerState, prompt: Any) -> list[Prompt]:
    engine = state.ready_engine()
    vocab_size = engine.engine.loaded.arch.vocab_size
    prompts = []
    for item in _prompt_list(prompt):
        if isinstance(item, str):
            check_text(item, "prompt")
        try:
            prompts.append(tokenize_prompt(item, engine.tokenizer, vocab_size))
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param="prompt") from None
    return prompts


def echo_text(prompt: Prompt, tokenizer: Any) -> str:
    """What echo puts before a prompt's completions: a text prompt as sent, token ids decoded
    as vLLM decodes them (special tokens kept; "" without a tokenizer, as generated text is)."""
    if prompt.text is not None:
        return prompt.text
    return tokenizer.decode(prompt.token_ids) if tokenizer is not None else ""


def engine_max_tokens(num_prompt_tokens: int, body: CompletionRequest,
                      max_model_len: int) -> int:
    """The request's max_tokens as the engine runs it.

    vLLM takes max_tokens 0 with echo only (without it, SamplingParams refuses 0, as vLLM's
    does): the answer is the prompt alone. The engine samples at least one token per request,
    so such a request runs with 1, whose prefill computes the prompt logprobs, and
    ``prompt_only`` takes the sampled token out of the answer.
    """
    max_tokens = resolve_max_tokens(num_prompt_tokens, body.max_tokens, max_model_len)
    return 1 if max_tokens == 0 and body.echo else max_tokens


def prompt_only(output: RequestOutput) -> RequestOutput:
    """``output`` without the token sampled for echo with max_tokens 0: neither its text nor
    usage shows it, and a choice that ended on its own ends for "length" (a budget of 0)."""
    return replace(output, outputs=[
        replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                cumulative_logprob=None, stop_reason=None,
                finish_reason="length" if c.finish_reason in ("stop", "length")
                else c.finish_reason)
        for c in output.outputs])


def news(choice: CompletionOutput, sent: tuple[int, int], echo: str | None,
         output: RequestOutput) -> tuple[str, list[int], list[TokenLogprobs | None]]:
    """The text, token ids and logprob entries of ``choice`` after ``sent`` (chars, tokens).

    With ``echo`` (the prompt's text), a choice's first news, (0, 0) sent, opens with the
    prompt's text, token ids and logprobs, as in vLLM. (A stream sends a choice nothing before
    a token or its end, so its first chunk is the one that finds nothing sent.)
    """
    num_chars, num_tokens = sent
    text, token_ids = choice.text[num_chars:], choice.token_ids[num_tokens:]
    entries: list[TokenLogprobs | None] = [*(choice.logprobs or [])[num_tokens:]]
    if echo is not None and sent == (0, 0):
        text, token_ids = echo + text, [*output.prompt_token_ids, *token_ids]
        entries = [*(output.prompt_logprobs or []), *entries]
    return text, token_ids, entries


def completion_logprobs(state: ServerState, tokenizer: Any, token_ids: Sequence[int],
                        entries: Sequence[TokenLogprobs | None], text_offset: int,
                        num_top: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs for these tokens, offsets counted from ``text_offset``: each
    token's top ``num_top`` alternatives and itself (an echoed prompt's entries hold as many
    as prompt_logprobs asked for, which may be more).

    A token without an entry (a prompt's first: nothing before it predicts it) gets null
    token_logprobs and top_logprobs, as OpenAI and vLLM send it.
    """
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries, strict=False):
        token = state.token_text(tokenizer, token_id)
        result.tokens.append(token)
        result.token_logprobs.append(
            None if entry is None else finite_logprob(entry.get(token_id, float("nan"))))
        ranked = [] if entry is None else sorted(entry.items(), key=lambda kv: -kv[1])
        result.top_logprobs.append(
            None if entry is None else
            {state.token_text(tokenizer, t): finite_logprob(lp)
             for i, (t, lp) in enumerate(ranked) if i < num_top or t == token_id})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


async def create_completion(state: ServerState, body: CompletionRequest,
                            request: Request) -> Response | CompletionResponse:
    engine = state.ready_engine()
    state.check_model(body.model)
    refuse_unsupported(body)
    for field, off in (("suffix", body.suffix is None),
                       ("best_of", body.best_of in (None, body.n))):
        if not off:
            raise APIError(400, f"{field} is not supported", param=field)
    prompts = tokenize_prompts(state, body.prompt)
    prompt_ids = [p.token_ids for p in prompts]
    tokenizer, n = engine.tokenizer, body.n
    echoes = [echo_text(p, tokenizer) if body.echo else None for p in prompts]
    # per prompt, as in vLLM: max_tokens null gives each the rest of the context after it;
    # echo asks for the prompt's logprobs as well, as many alternatives as the completion's
    structured = structured_outputs_of(body)
    params = [sampling_params(body, engine_max_tokens(len(p), body, engine.max_model_len),
                              body.logprobs, prompt_logprobs=body.logprobs if body.echo else None,
                              structured=structured)
              for p in prompt_ids]
    await compile_grammar(engine, structured)
    # what the client is answered: echo with max_tokens 0 ran one token it did not ask for
    answer_of = prompt_only if body.echo and body.max_tokens == 0 else lambda output: output
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    outputs = merged_outputs(engine, prompt_ids, params, request_id, state.metrics,
                             admit=lambda: state.check_queue(engine))

    def logprobs_of(token_ids: list[int], entries: list[TokenLogprobs | None],
                    text_offset: int) -> CompletionLogprobs | None:
        return (completion_logprobs(state, tokenizer, token_ids, entries, text_offset,
                                    body.logprobs)
                if body.logprobs is not None else None)

    if not body.stream:
        try:
            finals = await unless_disconnected(request, collect_finals(outputs))
        except (ValueError, TypeError) as exc:
            raise bad_request(exc) from None
        finals = {i: answer_of(output) for i, output in finals.items()}
        # as vLLM, on each choice whenever the engine scored the prompt (echo with logprobs too)
        prompt_logprobs = {i: prompt_logprobs_of(state, tokenizer, output)
                           for i, output in finals.items()}

        def choice_of(index: int, c: CompletionOutput) -> CompletionChoice:
            text, token_ids, entries = news(c, (0, 0), echoes[index], finals[index])
            return CompletionChoice(index=index * n + c.index, text=text,
                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                    logprobs=logprobs_of(token_ids, entries, 0),
                                    prompt_logprobs=prompt_logprobs[index])

        choices = [choice_of(i, c) for i in sorted(finals) for c in finals[i].outputs]
        return CompletionResponse(id=request_id, created=created, model=state.model_name,
                                  choices=choices, usage=usage_of(prompt_ids, finals))

    try:
        first = await unless_disconnected(request, outputs.__anext__())
    except (ValueError, TypeError) as exc:
        raise bad_request(exc) from None
    tracker = DeltaTracker()
    finals: dict[int, RequestOutput] = {}
    # Where each choice's next token starts in its token texts, as the non-streaming answer
    # counts text_offset: the text sent so far lags the tokens while a stop string may follow.
    offsets: dict[tuple[int, int], int] = {}

    def to_chunks(index: int, output: RequestOutput) -> Iterator[dict[str, Any]]:
        output = answer_of(output)
        if output.finished:
            finals[index] = output
        for c in output.outputs:
            already = tracker.advance(index, c)
            if already is None:
                continue
            text, token_ids, entries = news(c, already, echoes[index], output)
            start = offsets.get((index, c.index), 0)
            logprobs = logprobs_of(token_ids, entries, start)
            if logprobs is not None:
                offsets[(index, c.index)] = start + sum(len(t) for t in logprobs.tokens)
            yield {"id": request_id, "object": "text_completion", "created": created,
                   "model": state.model_name,
                   "choices": [{"index": index * n + c.index, "text": text,
                                "logprobs": logprobs.model_dump() if logprobs else None,
                                "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason}],
                   **running_usage(body, len(prompt_ids[index]), len(c.token_ids))}

    def final() -> Iterator[dict[str, Any]]:
        if body.stream_options and body.stream_options.include_usage:
            yield {"id": request_id, "object": "text_completion", "created": created,
                   "model": state.model_name, "choices": [],
                   "usage": usage_of(prompt_ids, finals).model_dump()}

    return SSEResponse(event_stream(first, outputs, to_chunks, final=final))

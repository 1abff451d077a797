"""``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kiln.engine.inputs import render_chat
from kiln.outputs import CompletionOutput, RequestOutput
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
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChoiceLogprobs,
    TokenLogprob,
    TopLogprob,
)
from kiln.serve.state import ServerState, finite_logprob
from kiln.serve.streaming import SSEResponse, event_stream
from kiln.serve.structured import StructuredRequest, compile_grammar, structured_outputs_of
from kiln.serve.tool_parsers import ToolParser
from kiln.serve.tools import (
    ToolCallDeltas,
    ToolRequest,
    answer_calls,
    history_fields,
    tool_request_of,
)


def _content_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        if message.role != "assistant":  # (only an assistant turn may come without text)
            raise APIError(400, f"messages.{index}.content is required for a {message.role} "
                                f"message", param=f"messages.{index}.content")
        return ""
    if isinstance(content, str):
        return check_text(content, f"messages.{index}.content")
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(400, f"messages.{index}.content: only text parts are supported, got "
                                f"a part of type {part.type!r}", param=f"messages.{index}.content")
        texts.append(check_text(part.text, f"messages.{index}.content"))
    return "\n".join(texts)


def chat_prompt_ids(state: ServerState, messages: list[ChatMessage],
                    add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Render the messages with the chat template and tokenize (400s say what went wrong).

    ``template_kwargs`` are the template's own variables (vLLM's chat_template_kwargs, such as
    Qwen3's enable_thinking); they cannot override how the template is applied. ``tools`` (the
    request's, as OpenAI shapes them) are the template's ``tools``.
    """
    tokenizer = state.ready_engine().tokenizer
    if not messages:
        raise APIError(400, "messages is empty; give at least one message", param="messages")
    template = state.chat_template or getattr(tokenizer, "chat_template", None)
    if tokenizer is None or not template:
        raise APIError(400, "this model has no chat template, so /v1/chat/completions cannot "
                            "format messages; use /v1/completions with a prompt, or restart "
                            "the server with --chat-template", param="messages")
    conversation = [{"role": check_text(m.role, f"messages.{i}.role"),
                     "content": _content_text(m, i), **history_fields(m, i)}
                    for i, m in enumerate(messages)]
    try:
        return render_chat(tokenizer, conversation, template, add_generation_prompt,
                           template_kwargs, tools)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None


def _logprobs(state: ServerState, tokenizer: Any, choice: CompletionOutput, start: int,
              num_top: int) -> ChoiceLogprobs:
    content = []
    for token_id, entry in zip(choice.token_ids[start:], (choice.logprobs or [])[start:],
                               strict=False):
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
        token = state.token_text(tokenizer, token_id)
        content.append(TokenLogprob(
            token=token, logprob=finite_logprob(entry.get(token_id, float("nan"))),
            bytes=list(token.encode()),
            top_logprobs=[TopLogprob(token=(t := state.token_text(tokenizer, i)),
                                     logprob=finite_logprob(lp), bytes=list(t.encode()))
                          for i, lp in top]))
    return ChoiceLogprobs(content=content)


def _constraint(tools: ToolRequest, structured: StructuredRequest | None
                ) -> StructuredRequest | None:
    """The one constraint on the answer: a forced tool call's, or the structured outputs the
    request asks; 400 when it asks both (vLLM lets the call's win silently)."""
    if tools.forced and structured is not None:
        raise APIError(400, f"tool_choice forces a tool call, whose arguments follow the tool's "
                            f"schema, and {structured.param} asks for structured outputs as "
                            f"well; send one of them", param=structured.param)
    return tools.structured or structured


def _message(tools: ToolRequest, text: str) -> AssistantMessage:
    """The answer as content, as the calls it forces (with content "", as in vLLM), or under
    "auto" as the calls the parser finds and the content around them."""
    if tools.parser is not None:
        found = tools.parser.parse(text)
        return AssistantMessage(content=found.content, tool_calls=found.calls)
    if not tools.forced:
        return AssistantMessage(content=text)
    return AssistantMessage(content="", tool_calls=answer_calls(tools, text))


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest,
                                 request: Request, tool_parser: ToolParser | None = None
                                 ) -> Response | ChatCompletionResponse:
    """``tool_parser`` reads the calls of tool_choice "auto" (None: "auto" is refused)."""
    engine = state.ready_engine()
    state.check_model(body.model)
    refuse_unsupported(body)
    tool_request = tool_request_of(body, tool_parser)
    # Rejected as OpenAI does, since it would be ignored silently; 0 asks for nothing, so it
    # passes without logprobs, as in vLLM.
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, f"top_logprobs requires logprobs=true, got top_logprobs="
                            f"{body.top_logprobs} without it; set logprobs to true or drop "
                            f"top_logprobs", param="top_logprobs")
    prompt = chat_prompt_ids(state, body.messages, body.add_generation_prompt,
                             body.chat_template_kwargs, tool_request.tools)
    # max_completion_tokens replaces the deprecated max_tokens; errors name the one sent
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(len(prompt), getattr(body, max_field), engine.max_model_len,
                                    param=max_field)
    num_top = body.top_logprobs or 0
    structured = _constraint(tool_request, structured_outputs_of(body))
    params = sampling_params(body, max_tokens, num_top if body.logprobs else None,
                             {"logprobs": "top_logprobs", "max_tokens": max_field},
                             structured=structured)
    if tool_request.parser is not None and tool_request.parser.keeps_special_tokens:
        params.skip_special_tokens = False  # its call marker is a special token to keep
    await compile_grammar(engine, structured)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created, tokenizer = int(time.time()), engine.tokenizer
    outputs = merged_outputs(engine, [prompt], [params], request_id, state.metrics,
                             admit=lambda: state.check_queue(engine))

    def logprobs_of(choice: CompletionOutput, start: int) -> ChoiceLogprobs | None:
        return _logprobs(state, tokenizer, choice, start, num_top) if body.logprobs else None

    if not body.stream:
        try:
            finals = await unless_disconnected(request, collect_finals(outputs))
        except (ValueError, TypeError) as exc:
            raise bad_request(exc) from None
        choices = []
        for c in finals[0].outputs:
            message = _message(tool_request, c.text)
            # A forced call's finish_reason stays the engine's ("stop"), as in vLLM, which
            # gives "tool_calls" only to calls its parser found, and to streamed calls.
            found = tool_request.parser is not None and bool(message.tool_calls)
            choices.append(ChatChoice(index=c.index, message=message,
                                      logprobs=logprobs_of(c, 0),
                                      finish_reason="tool_calls" if found else c.finish_reason,
                                      stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=request_id, created=created, model=state.model_name,
                                      choices=choices, usage=usage_of([prompt], finals),
                                      prompt_logprobs=prompt_logprobs_of(state, tokenizer,
                                                                         finals[0]))

    try:
        first = await unless_disconnected(request, outputs.__anext__())
    except (ValueError, TypeError) as exc:
        raise bad_request(exc) from None
    tracker = DeltaTracker()
    tool_deltas = ToolCallDeltas(tool_request) if tool_request.may_call else None
    finals: dict[int, RequestOutput] = {}

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": state.model_name, "choices": choices, **extra}

    def to_chunks(index: int, output: RequestOutput) -> Iterator[dict[str, Any]]:
        if output.finished:
            finals[index] = output
        for c in output.outputs:
            already = tracker.advance(index, c)
            if already is None:
                continue
            num_chars, num_tokens = already
            finish_reason = c.finish_reason
            if tool_deltas is not None:
                delta = tool_deltas.delta(c.index, c.text, num_chars, c.finished)
                if finish_reason is not None and tool_deltas.called(c.index):
                    finish_reason = "tool_calls"  # as vLLM ends a stream that sent calls
            else:
                delta = {"content": c.text[num_chars:]} if len(c.text) > num_chars else {}
            logprobs = logprobs_of(c, num_tokens)
            if tool_deltas is not None and not delta and logprobs is None \
                    and finish_reason is None:
                continue  # a call (or a marker) still being written: nothing to say, as vLLM
            yield chunk([{"index": c.index, "delta": delta,
                          "logprobs": logprobs.model_dump() if logprobs else None,
                          "finish_reason": finish_reason, "stop_reason": c.stop_reason}],
                        **running_usage(body, len(prompt), len(c.token_ids)))

    # OpenAI opens every choice with the role, before any content
    preamble = [chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}],
                      **running_usage(body, len(prompt), 0)) for i in range(params.n)]

    def final() -> Iterator[dict[str, Any]]:
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], usage=usage_of([prompt], finals).model_dump())

    return SSEResponse(event_stream(first, outputs, to_chunks, preamble=preamble, final=final))


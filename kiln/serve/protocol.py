"""Request and response bodies of the OpenAI-compatible API (pydantic, so /openapi.json is real).

Types only: pydantic checks shapes and keeps integers inside int64 (wider values would overflow
the engine's tensors); what a value means (top_p in (0, 1], n <= max_num_seqs ...) is checked
once, by ``SamplingParams`` and the engine, and reported as a 400 naming the field.
Unknown fields are ignored, as OpenAI clients send options this server does not use; the
sampling requests keep them, so that those which would change the output can be refused.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _not_bool(value: Any) -> Any:
    # pydantic reads JSON true as 1 where an int is due: "max_tokens": true is a client bug
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    return value


def _takes_default_for_null(model: type[BaseModel], name: str) -> bool:
    field = model.model_fields.get(name)
    return (field is not None and not field.is_required()
            and type(None) not in get_args(field.annotation))


Int = Annotated[int, BeforeValidator(_not_bool), Field(ge=INT64_MIN, le=INT64_MAX)]
TokenIds = list[Int]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI's spec marks n, stream, echo, chat's logprobs ... nullable, and many clients
        # send null for "not set": such a field takes its default (as in vLLM). Fields whose
        # type holds None keep it (completions' max_tokens: null asks for the whole context).
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items()
                if value is not None or not _takes_default_for_null(cls, key)}


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    """OpenAI's response_format.json_schema: the schema the answer follows, under ``schema``
    (``strict`` is accepted: the schema is always enforced)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's)."""

    # kept in model_extra: generation.refuse_unsupported reads options Kiln does not implement
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    n: Int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key: a string) -> bias
    # OpenAI's in chat, vLLM's in completions too
    response_format: ResponseFormat | None = None
    # extensions sent by vLLM's benchmark and other clients
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: Int | None = None  # the response's prompt_logprobs (not with stream)
    # vLLM's structured outputs, one way at most (with response_format): v1's structured_outputs
    # (StructuredOutputsParams' fields), or the older guided_* fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: bool = False
    best_of: Int | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    """A call an assistant made: in a response, and in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's answer to that call


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None takes no arguments
    strict: bool | None = None  # accepted: a forced call always follows the schema


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    tools: list[Tool] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, checked
    # by kiln.serve.tools, whose errors say what to send (a union here would not)
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: enable_thinking ...


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # rendered with messages, as in chat
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds


# ---- responses ---------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class Logprob(BaseModel):
    """vLLM's Logprob, as an entry of its prompt_logprobs: rank 1 is the most likely token."""

    logprob: float
    rank: int
    decoded_token: str


# per prompt token, token id -> Logprob for the token and its top alternatives; null first
PromptLogprobs = list[dict[int, Logprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, on each choice of the prompt


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: calls the tool-call parser found, and no text beside them
    tool_calls: list[ToolCall] = Field(default_factory=list)  # always a list, as in vLLM


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, on the response in chat


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kiln"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

"""Prompt normalization and validation at the engine's edge (shared by LLM, engine, server)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# a dict is vLLM's TextPrompt {"prompt": str} or TokensPrompt {"prompt_token_ids": [int]}
PromptLike = str | list[int] | dict[str, Any]
PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None


def normalize_prompts(prompts: PromptLike | list[PromptLike]) -> list[PromptLike]:
    """Accept one prompt or a list: a string, a token-id list, a prompt dict, or a list of
    those."""
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list | tuple) and prompts and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, list | tuple):
        if not prompts:
            raise ValueError("prompts is empty; pass at least one prompt")
        return list(prompts)
    raise TypeError(f"prompts must be a string, a list of token ids, a prompt dict, or a list "
                    f"of those; got {type(prompts).__name__}")


def _unwrap(prompt: PromptLike) -> str | list[int]:
    """A prompt dict's text or token ids; other keys of vLLM's prompt dicts (multi-modal data,
    cache salt ...) are refused by name rather than ignored."""
    if not isinstance(prompt, dict):
        return prompt
    keys = sorted(prompt)
    if len(keys) != 1 or keys[0] not in PROMPT_DICT_KEYS:
        raise ValueError(f"a prompt dict holds one of {list(PROMPT_DICT_KEYS)} (vLLM's "
                         f"TextPrompt / TokensPrompt), got keys {keys}")
    return prompt[keys[0]]


def tokenize_prompt(prompt: PromptLike, tokenizer: Any, vocab_size: int) -> Prompt:
    """Turn one prompt into validated token ids (strings need the model's tokenizer)."""
    prompt = _unwrap(prompt)
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty; give at least one character or token id")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer files; pass prompts as token-id lists")
        # (verbose=False: a prompt past the tokenizer's model_max_length is checked against the
        # engine's max_model_len with a clear error, not transformers' indexing warning)
        return Prompt(token_ids=list(tokenizer.encode(prompt, verbose=False)), text=prompt)
    if not isinstance(prompt, list | tuple):
        raise TypeError(f"a prompt must be a string or a list of token ids, got "
                        f"{type(prompt).__name__}")
    ids = list(prompt)
    if not ids:
        raise ValueError("prompt is empty; give at least one token id")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab_size})")
    return Prompt(token_ids=ids)


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens >= max_model_len:
        raise ValueError(f"prompt has {num_prompt_tokens} tokens but max_model_len is "
                         f"{max_model_len}: at most {max_model_len - 1} prompt tokens leave room "
                         f"for one generated token")


def render_chat(tokenizer: Any, conversation: list[dict[str, Any]], template: str,
                add_generation_prompt: bool = True,
                template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """A conversation ([{"role": ..., "content": ...}, ...]) rendered with ``template`` and
    tokenized; ValueError says what is wrong (shared by ``kiln.LLM.chat`` and the server).

    ``template_kwargs`` are the template's own variables (vLLM's chat_template_kwargs, such as
    Qwen3's enable_thinking); they cannot override how the template is applied. ``tools`` are
    the template's ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` entries, as
    transformers and vLLM pass them), which templates of tool-calling models describe.
    """
    if not conversation:
        raise ValueError("messages is empty; give at least one message")
    try:
        text = tokenizer.apply_chat_template(
            conversation, **{**(template_kwargs or {}), "chat_template": template, "tools": tools,
                             "tokenize": False, "add_generation_prompt": add_generation_prompt})
        # The template writes any BOS itself; encoding must not add a second one. (verbose=False:
        # the length is checked against max_model_len with a clear error, not transformers'
        # warning.)
        ids = list(tokenizer.encode(text, add_special_tokens=False, verbose=False))
    except Exception as exc:  # noqa: BLE001 - templates are model code that may raise anything
        raise ValueError(f"the chat template rejected these messages: {exc}") from None
    if not ids:
        raise ValueError("the messages render to an empty prompt")
    return ids

"""What ``kiln generate`` reads and writes for a batch: prompts files and JSONL result lines.

A prompts file holds one prompt a line (blank lines skipped) or, when its first line starts
with "{", JSONL: each line ``{"prompt": TEXT}`` or a chat ``{"messages": [...]}``, whose other
keys (an id, a reference answer) are copied into its result line. Errors are ValueErrors that
name the file and line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.engine.inputs import render_chat
from kiln.outputs import CompletionOutput, RequestOutput

# what a result line writes beside the prompt's own keys, which therefore may not use them
RESULT_KEYS = ("sample_index", "text", "token_ids", "finish_reason", "stop_reason",
               "num_prompt_tokens", "first_token_s", "finished_s")


@dataclass
class PromptInput:
    where: str  # FILE:LINE (or the flag that gave it), as errors name it
    fields: dict[str, Any]  # "prompt" or "messages", and any other keys of a JSONL line

    @property
    def messages(self) -> list[dict[str, Any]] | None:
        return self.fields.get("messages")

    def engine_prompt(self, tokenizer: Any, chat: bool, template: str | None) -> str | list[int]:
        """The text to continue, or a chat's token ids through ``template``; ``chat`` makes a
        text prompt the user's message."""
        messages = self.messages or ([{"role": "user", "content": self.fields["prompt"]}]
                                     if chat else None)
        if messages is None:
            return self.fields["prompt"]
        return render_chat(tokenizer, messages, template)

    def echo_text(self, chat: bool) -> str:
        """What precedes the generated text on screen: nothing for a chat, whose templated
        prompt is markup."""
        return "" if chat or self.messages else self.fields["prompt"]


def read_prompts(lines: Iterable[str], name: str) -> list[PromptInput]:
    """The prompts of a file's ``lines`` (newlines kept, as a text file iterates)."""
    numbered = [(n, line.removesuffix("\n")) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise ValueError(f"{name} holds no prompts")
    if not numbered[0][1].lstrip().startswith("{"):
        return [PromptInput(f"{name}:{n}", {"prompt": line}) for n, line in numbered]
    return [_parse_jsonl_line(line, f"{name}:{n}") for n, line in numbered]


def _parse_jsonl_line(line: str, where: str) -> PromptInput:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc}); a prompts file whose first line "
                         "starts with '{' is read as JSONL") from None
    if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
        raise ValueError(f'{where}: a JSONL line is an object holding "prompt" (text) or '
                         '"messages" (a chat), one of them')
    if "prompt" in obj and not (isinstance(obj["prompt"], str) and obj["prompt"]):
        raise ValueError(f'{where}: "prompt" must be non-empty text')
    messages = obj.get("messages", [{}])
    if not (isinstance(messages, list) and messages
            and all(isinstance(m, dict) for m in messages)):
        raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role": ..., '
                         f'"content": ...}} objects')
    clash = sorted(set(obj) & set(RESULT_KEYS))
    if clash:
        raise ValueError(f"{where}: keys {clash} are written by the result line; rename them")
    return PromptInput(where, obj)


def result_line(item: PromptInput, out: RequestOutput, done: CompletionOutput,
                start: float) -> dict[str, Any]:
    """One sample (``done``, of ``out``'s) of a finished request, its times in seconds from
    ``start`` (time.monotonic): the request's, shared by its samples."""
    metrics = out.metrics
    return {**item.fields, "sample_index": done.index, "text": done.text,
            "token_ids": done.token_ids,
            "finish_reason": done.finish_reason, "stop_reason": done.stop_reason,
            "num_prompt_tokens": len(out.prompt_token_ids),
            "first_token_s": round(metrics.first_token_time - start, 6),
            "finished_s": round(metrics.finished_time - start, 6)}


def to_jsonl(lines: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` beside ``path``, then rename it over ``path``: a failed or interrupted
    write leaves any earlier file whole."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)

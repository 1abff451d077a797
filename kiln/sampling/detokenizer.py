"""Incremental detokenization: turn a growing list of token ids into text pieces for streaming.

Decoding one token at a time is wrong for byte-level BPE: a character such as "中" or an emoji
can span several tokens, and decoding a lone fragment yields U+FFFD. Like vLLM and TGI we keep
two offsets into the token list: text is decoded from `prefix_offset`, the part up to
`read_offset` has already been emitted, and new text is released only when the decoded window
no longer ends in U+FFFD. Decoding a window that starts a few tokens back (not just the new
token) keeps tokenizer decoders that treat the first token specially (SentencePiece strips its
leading space) from altering text in the middle of a sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Stop strings live in stop.py; re-exported because the brief placed them beside the detokenizer.
from kiln.sampling.stop import StopChecker

__all__ = ["IncrementalDetokenizer", "StopChecker"]

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded ahead of the first output token, as in vLLM: enough to carry a
# multi-token character and the leading-space context of the first generated word.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Streams the text of one sequence's output tokens.

    For byte-level BPE tokenizers (GPT-2, Llama 3, Qwen), the concatenation of everything `add`
    and `flush` return equals `tokenizer.decode(output_ids, skip_special_tokens=...)`. For
    tokenizers whose decoder strips the leading space of the first token (SentencePiece Llama 2,
    Mistral), the first piece keeps the space that separates it from the prompt, as vLLM does
    and as an OpenAI completion expects. Decoding never applies clean_up_tokenization_spaces,
    which rewrites text across piece boundaries and so cannot be applied incrementally.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        # A context that decodes to a trailing U+FFFD cannot serve: drop its oldest tokens until
        # it decodes cleanly. The window may start inside a character, and byte-fallback
        # decoders (SentencePiece) then turn the whole run of byte tokens into U+FFFD; a prompt
        # that itself ends inside a character leaves no context at all.
        while context and self._decode(context).endswith(_REPLACEMENT):
            del context[0]
        self._num_context = len(context)
        self._ids: list[int] = context  # context tokens, then output tokens
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.output_text = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new output tokens; return the text they complete (possibly "")."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # Nothing new yet (e.g. a skipped special token) or an unfinished character.
            return ""
        piece = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        self.output_text += piece
        return piece

    def flush(self) -> str:
        """At finish: release held-back text, including a character the output never completed
        (it decodes to U+FFFD, as it does in a full decode)."""
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset :])
        piece = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self._ids)
        self.output_text += piece
        return piece

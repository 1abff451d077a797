"""Structured outputs on xgrammar: each constraint compiled once, one matcher a sequence, and the
bitmask of the tokens each structured row may sample next.

The engine compiles a request's StructuredOutputsParams when it takes the request
(``GrammarCache.compile``: errors reach the caller before anything is queued), each of the
request's sequences follows its own ``GrammarState``, and each step the sampler sets the logits of
every token a structured row's grammar does not allow to -inf before anything else changes them
(vLLM v1's order): ``grammar_bitmask`` fills the rows' bitmasks on the host, one bit a token,
``apply_grammar_bitmask`` applies them with xgrammar's kernel on the logits' device.

xgrammar is imported on first use: its import takes ~0.6 s, which every command and every engine
without a structured request would pay otherwise.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kiln.sampling.params import StructuredOutputsParams
from kiln.upload import upload

if TYPE_CHECKING:
    import xgrammar

# bytes of compiled grammars kept for reuse (vLLM's default xgrammar cache, 512 MiB)
GRAMMAR_CACHE_BYTES = 512 * 2**20
_WHAT = {"json": "the JSON schema", "json_object": "the JSON-object grammar",
         "regex": "the regex", "choice": "the choices", "grammar": "the grammar"}
# xgrammar's messages open with the time and its C++ source line, then a failed check's condition
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose only sentences are ``choices``: each a string literal, written with
    JSON's escapes (xgrammar's EBNF reads the same)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _source(structured: StructuredOutputsParams) -> str:
    """What xgrammar compiles: a schema's JSON text, the regex, or an EBNF grammar."""
    kind = structured.kind
    if kind == "json":
        return json.dumps(structured.json)  # keys in order: they are generated in that order
    if kind == "json_object":
        return '{"type": "object"}'  # any object, as vLLM's xgrammar backend compiles it
    if kind == "choice":
        return choice_grammar(structured.choice)
    return getattr(structured, kind)


def _native_message(exc: Exception) -> str:
    return _NATIVE_PREFIX.sub("", str(exc).strip())


class GrammarCache:
    """Compiles constraints for one tokenizer: one xgrammar compiler (built on the first
    structured request: reading a large vocabulary takes a while), and the compiled grammars by
    (kind, source, whitespace), the least recently used dropped past ``max_bytes``.

    ``vocab_size`` is the LM head's, which may exceed the tokenizer's: the ids past the
    tokenizer's are never allowed. ``stop_token_ids`` (the model's EOS ids) end a grammar.
    ``device`` is where the engine samples: the mask's kernels run there once with the
    compiler's start-up, so that on CUDA the first structured step does not load (and Triton
    compile) them while the batch waits, and an engine without structured requests never does.
    Thread-safe: the server compiles on worker threads while the engine admits requests.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 device: torch.device, max_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.device = device
        self.max_bytes = max_bytes
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._grammars: OrderedDict[tuple[str, str, bool], xgrammar.CompiledGrammar] = \
            OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()

    def compile(self, structured: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``structured``; ValueError saying why it does not compile."""
        kind, source = structured.kind, _source(structured)
        key = (kind, source, structured.disable_any_whitespace)
        with self._lock:
            compiled = self._grammars.get(key)
            if compiled is not None:
                self._grammars.move_to_end(key)
                return compiled
            compiler = self._get_compiler()
        # outside the lock: a large schema takes a while, and xgrammar's compiler is thread-safe
        try:
            compiled = _compile(compiler, kind, source, not structured.disable_any_whitespace)
        except (RuntimeError, ValueError) as exc:  # xgrammar's errors are RuntimeErrors
            raise ValueError(f"{_WHAT[kind]} does not compile: {_native_message(exc)}") from None
        with self._lock:
            self._keep(key, compiled)
        return compiled

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer and this model "
                                 "has none")
            import xgrammar
            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            # (its own cache off: this one keys the choices and options as well)
            self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
            _warm_up(self._compiler, self.device)
        return self._compiler

    def _keep(self, key: tuple[str, str, bool], compiled: xgrammar.CompiledGrammar) -> None:
        if key in self._grammars:  # another thread compiled it meanwhile
            return
        self._grammars[key] = compiled
        self._num_bytes += compiled.memory_size_bytes
        while self._num_bytes > self.max_bytes and len(self._grammars) > 1:
            _, dropped = self._grammars.popitem(last=False)
            self._num_bytes -= dropped.memory_size_bytes


def _compile(compiler: xgrammar.GrammarCompiler, kind: str, source: str,
             any_whitespace: bool) -> xgrammar.CompiledGrammar:
    if kind in ("json", "json_object"):
        return compiler.compile_json_schema(source, any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(source)
    return compiler.compile_grammar(source)  # a grammar, or the choices as one


class GrammarState:
    """One sequence's place in its grammar: the tokens that may come next, and whether a stop
    token ended it."""

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        import xgrammar
        self._matcher = xgrammar.GrammarMatcher(compiled)
        self.vocab_size = compiled.tokenizer_info.vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False, and no change, for one the grammar refuses."""
        return self._matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        """Whether the last accepted token was a stop token the grammar allowed at its end."""
        return self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the next token's allowed ids into ``bitmask[row]`` (int32, on the host)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


def grammar_bitmask(states: Sequence[GrammarState | None], device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the rows that follow a grammar [num_structured] int64, their allowed next tokens as
    bits [num_structured, ceil(vocab / 32)] int32), both on ``device``; None when no row does.
    Filled on the host from each row's matcher: the step's tokens must be applied first."""
    rows = [row for row, state in enumerate(states) if state is not None]
    if not rows:
        return None
    import xgrammar
    bitmask = xgrammar.allocate_token_bitmask(len(rows), states[rows[0]].vocab_size)
    for i, row in enumerate(rows):
        states[row].fill_bitmask(bitmask, i)
    return upload(torch.tensor(rows, dtype=torch.int64), device), upload(bitmask, device)


def apply_grammar_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
                          ) -> None:
    """Set to -inf, in place, each of ``rows``' logits [num_seqs, vocab] whose token bit in its
    ``bitmask`` row is 0 (``grammar_bitmask``'s pair); other rows are left alone. xgrammar's
    kernel (C++ on CPU, Triton on CUDA) reads row r's bits from bitmask row r, so the rows'
    masks are first laid out at their own rows."""
    import xgrammar
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32,
                      device=logits.device)
    full.index_copy_(0, rows, bitmask)
    xgrammar.apply_token_bitmask_inplace(logits, full, vocab_size=logits.shape[1], indices=rows)


@torch.inference_mode()  # as the engine samples: the same ops
def _warm_up(compiler: xgrammar.GrammarCompiler, device: torch.device) -> None:
    """Run the mask's path once on ``device``: a matcher's bitmask filled on the host and
    uploaded, then applied to one of two rows."""
    state = GrammarState(compiler.compile_regex("a"))
    rows, bitmask = grammar_bitmask([None, state], device)
    apply_grammar_bitmask(torch.zeros(2, state.vocab_size, device=device), rows, bitmask)

"""Sliding-window perplexity (and greedy agreement of two models) over a token stream.

Works with any model through `logits_fn(input_ids [1, L]) -> logits [1, L, V]`. Windows of
`window` tokens advance by `stride`; every token after the first is scored exactly once, from
the first window that reaches it, so each scored token (past the first window) sees at least
`window - stride` tokens of context. ppl = exp(sum of -log p(token | context) / tokens scored).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import click
import torch
import typer

from kiln.cli_options import typer_app
from kiln.progress import make_progress
from kiln.zoo import DEFAULT_MODEL

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
# on_window(windows_done, windows_total), called after each window's forward pass
WindowCallback = Callable[[int, int], None]
DATASETS = ("zoo-heldout",)


@dataclass(frozen=True)
class PerplexityResult:
    num_tokens: int  # tokens scored (the stream's length minus its first token)
    nll_sum: float  # nats

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.num_tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


@dataclass(frozen=True)
class AgreementResult:
    num_positions: int
    num_agree: int

    @property
    def fraction(self) -> float:
        return self.num_agree / self.num_positions


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_target) per window: the window is ids[begin:end] and it scores the
    targets ids[first_target:end], each predicted from the logits one position earlier.

    The first window scores everything it can (targets 1..window-1); each later one scores the
    next `stride` targets and reaches back `window` tokens from its last. `stride` is capped at
    window - 1 so that a window's first target still has its predecessor inside the window.
    """
    if window < 2 or stride < 1:
        raise ValueError(f"need window >= 2 and stride >= 1; got window={window}, stride={stride}")
    if num_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score; got {num_tokens}")
    stride = min(stride, window - 1)
    spans, first = [], 1
    while first < num_tokens:
        end = min(first + stride if spans else window, num_tokens)
        begin = max(0, end - window)
        spans.append((begin, end, first))
        first = end
    return spans


def effective_stride(window: int, stride: int | None) -> int:
    """The tokens each window advances: `stride` (default window / 2), capped at window - 1 as
    sliding_windows caps it. An explicit 0 stays 0, for sliding_windows to refuse."""
    return min(max(1, window // 2) if stride is None else stride, window - 1)


def _scored_logits(
    logits_fn: LogitsFn,
    ids: torch.Tensor,
    window: int,
    stride: int | None,
    on_window: WindowCallback | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (logits [k, V] float32, targets [k]) for each window's newly scored targets."""
    spans = sliding_windows(ids.numel(), window, effective_stride(window, stride))
    for done, (begin, end, first) in enumerate(spans, 1):
        logits = logits_fn(ids[begin:end].unsqueeze(0))[0]  # [end - begin, V]
        if on_window is not None:
            on_window(done, len(spans))
        yield logits[first - 1 - begin : end - 1 - begin].float(), ids[first:end]


@torch.inference_mode()
def perplexity(
    logits_fn: LogitsFn,
    ids: torch.Tensor,
    window: int,
    stride: int | None = None,
    on_window: WindowCallback | None = None,
) -> PerplexityResult:
    """Perplexity of the 1-D token stream `ids` under `logits_fn` (stride default window/2)."""
    nll, count = 0.0, 0
    for logits, targets in _scored_logits(logits_fn, ids, window, stride, on_window):
        targets = targets.to(logits.device)
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count += targets.numel()
    return PerplexityResult(num_tokens=count, nll_sum=nll)


@torch.inference_mode()
def greedy_agreement(
    logits_fn_a: LogitsFn,
    logits_fn_b: LogitsFn,
    ids: torch.Tensor,
    window: int,
    stride: int | None = None,
    on_window: WindowCallback | None = None,
) -> AgreementResult:
    """How often two models' argmax next tokens match, on the same contexts (a draft model's
    acceptance rate under greedy speculative decoding is bounded by this)."""
    # both streams advance in step, so one of them reports progress for the pair
    spans_a = _scored_logits(logits_fn_a, ids, window, stride, on_window)
    spans_b = _scored_logits(logits_fn_b, ids, window, stride)
    agree, total = 0, 0
    for (logits_a, _), (logits_b, _) in zip(spans_a, spans_b, strict=True):
        agree += (logits_a.argmax(-1).cpu() == logits_b.argmax(-1).cpu()).sum().item()
        total += logits_a.shape[0]
    return AgreementResult(num_positions=total, num_agree=agree)


def encode_documents(
    tokenizer: Any, texts: Iterable[str], max_tokens: int | None = None
) -> torch.Tensor:
    """`<bos> text <eos>` per document (the zoo's training layout), with a transformers
    tokenizer; stops reading once `max_tokens` are there. Returns int64 [num_tokens]."""
    if max_tokens is not None and max_tokens < 0:
        # a negative slice bound below would silently drop tokens from the end instead
        raise ValueError(f"max_tokens must be >= 0 or None (all); got {max_tokens}")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    stream: list[int] = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        stream += ([bos] if bos is not None else []) + ids + ([eos] if eos is not None else [])
        if max_tokens is not None and len(stream) >= max_tokens:
            break
    return torch.tensor(stream[:max_tokens], dtype=torch.long)


def dataset_texts(dataset: str | None, file: Path | None) -> Iterator[str]:
    """The documents of `dataset` or the one text of `file`. Not a generator, so that a bad
    name or an empty file fails at the call, before a caller spends time loading a model."""
    if (dataset is None) == (file is None):
        raise ValueError("give exactly one of --dataset and --file")
    if file is not None:
        text = Path(file).read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            raise ValueError(f"file {file} has no text to score")
        return iter([text])
    if dataset not in DATASETS:
        raise ValueError(f"dataset={dataset!r}; valid: {', '.join(DATASETS)}")
    from kiln.zoo import corpus

    return (f.text for f in corpus.read_files("heldout"))


def kiln_logits_fn(loaded: Any) -> LogitsFn:
    """Wrap a `kiln.models.load_model` result as a LogitsFn."""
    return lambda ids: loaded.model.full_logits(ids.to(loaded.device))


eval_app = typer_app("Accuracy: perplexity and model agreement.")

# scoring needs a token and its predecessor: in the stream, and inside every window
MaxTokens = Annotated[int | None, typer.Option(min=2, help="score only the first N tokens")]
WindowOption = Annotated[
    int | None, typer.Option(min=2, help="tokens per window (default and limit: model context)")
]


def _load(model: str, dtype: str, device: str, quantization: str | None = None) -> Any:
    """load_model with bad options or files reported as a one-line CLI error."""
    from kiln.models import load_model

    try:
        return load_model(model, dtype=dtype, device=device, quantization=quantization)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None


def _texts(dataset: str | None, file: Path | None) -> Iterator[str]:
    """dataset_texts with a bad name, a --dataset/--file clash or an empty file reported as a
    one-line CLI error; called before any model loads, so these fail at once."""
    try:
        return dataset_texts(dataset, file)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def _window(window: int | None, models: dict[str, Any]) -> int:
    """`window`, or by default the shortest context of `models` (name -> loaded model). A window
    past a model's context would index beyond its rotary table deep in the forward pass."""
    name, context = min(
        ((name, loaded.arch.max_position_embeddings) for name, loaded in models.items()),
        key=lambda name_context: name_context[1],
    )
    if window is None:
        return context
    if window > context:
        raise click.ClickException(
            f"--window {window} exceeds {name}'s context of {context} tokens; "
            f"pass --window {context} or less"
        )
    return window


def _tokenizer(model: str, loaded: Any) -> Any:
    """The loaded model's tokenizer; a checkpoint without one (it loads, as prompts of token
    ids need none) as a one-line CLI error."""
    if loaded.tokenizer is None:
        raise click.ClickException(
            f"{model} has no tokenizer files (tokenizer.json, tokenizer_config.json): scoring "
            "text needs them; copy them from the model this checkpoint came from"
        )
    return loaded.tokenizer


def _encode(
    tokenizer: Any, texts: Iterable[str], max_tokens: int | None, source: str
) -> torch.Tensor:
    """encode_documents, refusing a stream too short to score (a one-token file, with a
    tokenizer that adds no <bos>/<eos>) as a one-line CLI error."""
    ids = encode_documents(tokenizer, texts, max_tokens)
    if ids.numel() < 2:
        raise click.ClickException(
            f"{source} gives {ids.numel()} token(s); need at least 2 to score"
        )
    return ids


@contextmanager
def _progress() -> Iterator[WindowCallback]:
    """An on_window callback drawing kiln bench's progress bar: on stderr, so that stdout keeps
    only the results, and silent when stderr is not a terminal."""
    with make_progress() as progress:
        task = progress.add_task("windows", total=None)
        yield lambda done, total: progress.update(task, completed=done, total=total)


@eval_app.command("ppl")
def ppl_cmd(
    model: Annotated[str, typer.Option(help="model directory, hub id or zoo name")] = DEFAULT_MODEL,
    dataset: Annotated[
        str | None, typer.Option(help=f"{' / '.join(DATASETS)} (the default without --file)")
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, readable=True, help="a text file to score"),
    ] = None,
    max_tokens: MaxTokens = None,
    window: WindowOption = None,
    stride: Annotated[
        int | None, typer.Option(min=1, help="tokens a window advances (default: window / 2)")
    ] = None,
    dtype: Annotated[str, typer.Option()] = "auto",
    device: Annotated[str, typer.Option()] = "auto",
    quantization: Annotated[str | None, typer.Option(
        help="quantize the weights at load (fp8, fp8-tensor, int8, int4, w8a8-int8)")] = None,
) -> None:
    """Sliding-window perplexity of MODEL on a dataset or a file."""
    if dataset is None and file is None:
        dataset = DATASETS[0]
    texts = _texts(dataset, file)
    loaded = _load(model, dtype, device, quantization)
    window = _window(window, {model: loaded})
    ids = _encode(_tokenizer(model, loaded), texts, max_tokens, str(file or dataset))
    with _progress() as on_window:
        result = perplexity(kiln_logits_fn(loaded), ids, window, stride, on_window)
    quant = f"  quantization: {quantization}" if quantization else ""
    # the stride as run (a --stride past the window is capped): it shapes the perplexity too
    typer.echo(f"model: {model}{quant}  data: {file or dataset}  window: {window}  "
               f"stride: {effective_stride(window, stride)}")
    typer.echo(f"tokens evaluated: {result.num_tokens}")
    typer.echo(f"perplexity: {result.perplexity:.4f}")


@eval_app.command("agree")
def agree_cmd(
    draft: Annotated[str, typer.Option(help="draft model (same tokenizer)")],
    model: Annotated[str, typer.Option(help="target model")] = DEFAULT_MODEL,
    max_tokens: MaxTokens = None,
    window: WindowOption = None,
    dtype: Annotated[str, typer.Option()] = "auto",
    device: Annotated[str, typer.Option()] = "auto",
) -> None:
    """Fraction of zoo held-out positions where DRAFT's greedy next token equals MODEL's."""
    texts = _texts(DATASETS[0], None)
    target = _load(model, dtype, device)
    small = _load(draft, dtype, device)
    window = _window(window, {model: target, draft: small})
    ids = _encode(_tokenizer(model, target), texts, max_tokens, DATASETS[0])
    with _progress() as on_window:
        result = greedy_agreement(
            kiln_logits_fn(target), kiln_logits_fn(small), ids, window, on_window=on_window
        )
    typer.echo(f"positions: {result.num_positions}")
    typer.echo(f"greedy agreement: {result.fraction:.4f}")


if __name__ == "__main__":
    eval_app()

"""Sliding-window perplexity (and greedy agreement of two models) over a token stream.

Works with any model through `logits_fn(input_ids [1, L]) -> logits [1, L, V]`. Windows of
`window` tokens advance by `stride`; every token after the first is scored exactly once, from
the first window that reaches it, so each scored token (past the first window) sees at least
`window - stride` tokens of context. ppl = exp(sum of -log p(token | context) / tokens scored).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import click
import torch
import typer

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
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


def _scored_logits(
    logits_fn: LogitsFn, ids: torch.Tensor, window: int, stride: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (logits [k, V] float32, targets [k]) for each window's newly scored targets."""
    for begin, end, first in sliding_windows(ids.numel(), window, stride):
        logits = logits_fn(ids[begin:end].unsqueeze(0))[0]  # [end - begin, V]
        yield logits[first - 1 - begin : end - 1 - begin].float(), ids[first:end]


@torch.inference_mode()
def perplexity(
    logits_fn: LogitsFn, ids: torch.Tensor, window: int, stride: int | None = None
) -> PerplexityResult:
    """Perplexity of the 1-D token stream `ids` under `logits_fn` (stride default window/2)."""
    stride = stride or max(1, window // 2)
    nll, count = 0.0, 0
    for logits, targets in _scored_logits(logits_fn, ids, window, stride):
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
) -> AgreementResult:
    """How often two models' argmax next tokens match, on the same contexts (a draft model's
    acceptance rate under greedy speculative decoding is bounded by this)."""
    stride = stride or max(1, window // 2)
    spans_a = _scored_logits(logits_fn_a, ids, window, stride)
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
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    stream: list[int] = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        stream += ([bos] if bos is not None else []) + ids + ([eos] if eos is not None else [])
        if max_tokens is not None and len(stream) >= max_tokens:
            break
    return torch.tensor(stream[:max_tokens], dtype=torch.long)


def dataset_texts(dataset: str | None, file: Path | None) -> Iterator[str]:
    if (dataset is None) == (file is None):
        raise ValueError("give exactly one of --dataset and --file")
    if file is not None:
        yield Path(file).read_text(encoding="utf-8", errors="replace")
        return
    if dataset != "zoo-heldout":
        raise ValueError(f"dataset={dataset!r}; valid: {', '.join(DATASETS)}")
    from kiln.zoo import corpus

    for f in corpus.read_files("heldout"):
        yield f.text


def kiln_logits_fn(loaded: Any) -> LogitsFn:
    """Wrap a `kiln.models.load_model` result as a LogitsFn."""
    return lambda ids: loaded.model.full_logits(ids.to(loaded.device))


eval_app = typer.Typer(help="Accuracy: perplexity and model agreement.")


def _load(model: str, dtype: str, device: str, quantization: str | None = None) -> Any:
    """load_model with bad options or files reported as a one-line CLI error."""
    from kiln.models import load_model

    try:
        return load_model(model, dtype=dtype, device=device, quantization=quantization)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None


@eval_app.command("ppl")
def ppl_cmd(
    model: Annotated[str, typer.Option(help="model directory, hub id or zoo name")],
    dataset: Annotated[str | None, typer.Option(help="zoo-heldout")] = None,
    file: Annotated[Path | None, typer.Option(help="a text file to score instead")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="score only the first N tokens")] = None,
    window: Annotated[int | None, typer.Option(help="default: the model's context")] = None,
    stride: Annotated[int | None, typer.Option(help="default: window / 2")] = None,
    dtype: Annotated[str, typer.Option()] = "auto",
    device: Annotated[str, typer.Option()] = "auto",
    quantization: Annotated[str | None, typer.Option(
        help="quantize the weights at load (fp8, fp8-tensor, int8, int4, w8a8-int8)")] = None,
) -> None:
    """Sliding-window perplexity of MODEL on a dataset or a file."""
    if dataset is None and file is None:
        dataset = "zoo-heldout"
    loaded = _load(model, dtype, device, quantization)
    ids = encode_documents(loaded.tokenizer, dataset_texts(dataset, file), max_tokens)
    window = window or loaded.arch.max_position_embeddings
    result = perplexity(kiln_logits_fn(loaded), ids, window, stride)
    quant = f"  quantization: {quantization}" if quantization else ""
    typer.echo(f"model: {model}{quant}  data: {file or dataset}  window: {window}")
    typer.echo(f"tokens evaluated: {result.num_tokens}")
    typer.echo(f"perplexity: {result.perplexity:.4f}")


@eval_app.command("agree")
def agree_cmd(
    model: Annotated[str, typer.Option(help="target model")],
    draft: Annotated[str, typer.Option(help="draft model (same tokenizer)")],
    max_tokens: Annotated[int | None, typer.Option(help="first N held-out tokens")] = None,
    window: Annotated[int | None, typer.Option(help="default: the target's context")] = None,
    dtype: Annotated[str, typer.Option()] = "auto",
    device: Annotated[str, typer.Option()] = "auto",
) -> None:
    """Fraction of zoo held-out positions where DRAFT's greedy next token equals MODEL's."""
    target = _load(model, dtype, device)
    small = _load(draft, dtype, device)
    ids = encode_documents(target.tokenizer, dataset_texts("zoo-heldout", None), max_tokens)
    window = window or target.arch.max_position_embeddings
    result = greedy_agreement(kiln_logits_fn(target), kiln_logits_fn(small), ids, window)
    typer.echo(f"positions: {result.num_positions}")
    typer.echo(f"greedy agreement: {result.fraction:.4f}")


if __name__ == "__main__":
    eval_app()

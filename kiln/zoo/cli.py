"""`kiln zoo ...`: train the zoo's tokenizer and models, list the installed models."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated

import click
import typer

from kiln.cli_options import typer_app
from kiln.zoo import ZOO_MODELS
from kiln.zoo.tokenizer import DEFAULT_VOCAB_SIZE, MIN_VOCAB_SIZE, check_vocab_size

zoo_app = typer_app("Kiln's own small models, trained on the Python standard library.")

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


# Option callbacks: each refuses a value that would otherwise fail only after the corpus has
# been read and tokenized, deep inside torch or the tokenizers library.


def _directory(path: Path) -> Path:
    """--out must be a directory, or a path where one can be made."""
    existing = next(p for p in (path, *path.parents) if p.exists())  # '.' or '/' at worst
    if not existing.is_dir():
        raise typer.BadParameter(f"{existing} is a file; pass a directory")
    return path


def _positive(value: float | None) -> float | None:
    # nan passes a `<= 0` test and inf is > 0: a nan budget fails after the timing steps, an
    # inf learning rate trains a nan model and writes it out
    if value is not None and not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"{value:g} must be > 0 and finite")
    return value


def _device(device: str) -> str:
    from kiln.models.loader import resolve_device

    if not DEVICE_PATTERN.fullmatch(device):
        raise typer.BadParameter(f"{device!r} is not a device; choose auto, cpu, cuda or cuda:N")
    kind, _, index = device.partition(":")
    try:
        resolve_device(kind)  # the engine's check: cuda asked for, no CUDA GPU visible
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if index:
        import torch

        count = torch.cuda.device_count()
        if int(index) >= count:
            raise typer.BadParameter(
                f"{device}: {count} CUDA GPU(s) visible; use cuda:0 to cuda:{count - 1}"
            )
    return device


def _corpus_root(root: Path | None) -> Path | None:
    from kiln.zoo import corpus

    if root is not None and not corpus.list_files(root):
        raise typer.BadParameter(
            f"no *.py files under {root} (site-packages and __pycache__ are skipped); "
            "pass a directory of Python sources"
        )
    return root


def _vocab_size(vocab_size: int) -> int:
    try:
        check_vocab_size(vocab_size)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return vocab_size


@zoo_app.command("train")
def train_cmd(
    size: Annotated[str, typer.Option(help="preset: tiny, draft or micro (CPU smoke test)")],
    out: Annotated[
        Path,
        typer.Option(callback=_directory, help="output directory; a checkpoint there is resumed"),
    ],
    steps: Annotated[
        int | None, typer.Option(min=1, help="optimizer steps (default: preset's)")
    ] = None,
    budget_s: Annotated[
        float | None,
        typer.Option(
            callback=_positive,
            help="instead of --steps: as many steps as fit this many seconds here (> 0)",
        ),
    ] = None,
    batch_size: Annotated[int | None, typer.Option(min=1, help="sequences per step")] = None,
    lr: Annotated[
        float | None, typer.Option(callback=_positive, help="peak learning rate (> 0)")
    ] = None,
    seed: Annotated[int, typer.Option()] = 0,
    log_every: Annotated[int, typer.Option(min=1)] = 10,
    eval_every: Annotated[int, typer.Option(min=1)] = 200,
    checkpoint_every: Annotated[int, typer.Option(min=1)] = 500,
    stop_at: Annotated[
        int | None,
        typer.Option(min=1, help="stop after this step, leaving a checkpoint to resume"),
    ] = None,
    max_files: Annotated[
        int | None, typer.Option(min=1, help="use only the first N files of each split")
    ] = None,
    corpus_root: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            file_okay=False,
            callback=_corpus_root,
            help="directory of *.py files (default: this stdlib)",
        ),
    ] = None,
    tokenizer: Annotated[
        Path | None, typer.Option(help="directory with tokenizer.json (default: the zoo's)")
    ] = None,
    device: Annotated[
        str, typer.Option(callback=_device, help="auto, cpu, cuda or cuda:N")
    ] = "auto",
) -> None:
    """Train a zoo model (Llama architecture) and write it in Hugging Face format to OUT."""
    from kiln.zoo.launch import run_training
    from kiln.zoo.train import DEFAULT_TOKENIZER_DIR, TrainConfig

    if steps is not None and budget_s is not None:
        raise typer.BadParameter("give --steps or --budget-s, not both")
    try:
        cfg = TrainConfig(
            size=size,
            out_dir=out,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            log_every=log_every,
            eval_every=eval_every,
            checkpoint_every=checkpoint_every,
            stop_at=stop_at,
            max_files=max_files,
            corpus_root=corpus_root,
            tokenizer_dir=tokenizer or DEFAULT_TOKENIZER_DIR,
            device=device,
        )
    except ValueError as exc:  # settings errors name the field and the valid range
        raise typer.BadParameter(str(exc)) from None
    try:
        run_training(cfg, budget_s=budget_s, log=typer.echo)
    except (ValueError, FileNotFoundError) as exc:
        # What setup finds wrong (a checkpoint made with other settings, too few chunks for a
        # batch, a --tokenizer without tokenizer.json) names the fix: one line, no traceback.
        raise click.ClickException(str(exc)) from None


@zoo_app.command("tokenizer")
def tokenizer_cmd(
    out: Annotated[
        Path,
        typer.Option(callback=_directory, help="directory for tokenizer.json and its config"),
    ],
    vocab_size: Annotated[
        int, typer.Option(callback=_vocab_size, help=f"at least {MIN_VOCAB_SIZE}")
    ] = DEFAULT_VOCAB_SIZE,
) -> None:
    """Train the shared byte-level BPE tokenizer on the training split of this stdlib."""
    from kiln.zoo import corpus
    from kiln.zoo.tokenizer import save_tokenizer, train_tokenizer

    files = corpus.read_files("train")
    tokenizer = train_tokenizer(corpus.iter_texts(files), vocab_size=vocab_size)
    save_tokenizer(tokenizer, out)
    stats = corpus.corpus_stats(files)
    typer.echo(
        f"trained on {stats['num_files']} files ({stats['num_bytes']:,} bytes): "
        f"vocab {tokenizer.get_vocab_size()} -> {out}"
    )


@zoo_app.command("list")
def list_cmd() -> None:
    """The zoo's models and where they are installed."""
    from kiln.zoo import model_path

    for name, m in ZOO_MODELS.items():
        try:
            where = str(model_path(name))
        except FileNotFoundError:
            where = "(not installed)"
        typer.echo(f"{name:18} {m.description}\n{'':18} {where}")


if __name__ == "__main__":
    zoo_app()

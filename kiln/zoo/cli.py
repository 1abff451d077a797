"""`kiln zoo ...`: train the zoo's tokenizer and models, list the installed models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kiln.zoo import ZOO_MODELS

zoo_app = typer.Typer(help="Kiln's own small models, trained on the Python standard library.")


@zoo_app.command("train")
def train_cmd(
    size: Annotated[str, typer.Option(help="preset: tiny, draft or micro (CPU smoke test)")],
    out: Annotated[Path, typer.Option(help="output directory; a checkpoint there is resumed")],
    steps: Annotated[int | None, typer.Option(help="optimizer steps (default: preset's)")] = None,
    budget_s: Annotated[
        float | None,
        typer.Option(help="instead of --steps: as many steps as fit this many seconds here"),
    ] = None,
    batch_size: Annotated[int | None, typer.Option(help="sequences per step")] = None,
    lr: Annotated[float | None, typer.Option(help="peak learning rate")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    log_every: Annotated[int, typer.Option()] = 10,
    eval_every: Annotated[int, typer.Option()] = 200,
    checkpoint_every: Annotated[int, typer.Option()] = 500,
    stop_at: Annotated[
        int | None, typer.Option(help="stop after this step, leaving a checkpoint to resume")
    ] = None,
    max_files: Annotated[
        int | None, typer.Option(help="use only the first N files of each split")
    ] = None,
    corpus_root: Annotated[
        Path | None, typer.Option(help="directory of *.py files (default: this stdlib)")
    ] = None,
    tokenizer: Annotated[
        Path | None, typer.Option(help="directory with tokenizer.json (default: the zoo's)")
    ] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N")] = "auto",
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
    run_training(cfg, budget_s=budget_s, log=typer.echo)


@zoo_app.command("tokenizer")
def tokenizer_cmd(
    out: Annotated[Path, typer.Option(help="directory for tokenizer.json and its config")],
    vocab_size: Annotated[int, typer.Option()] = 8192,
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

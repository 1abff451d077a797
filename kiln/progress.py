"""The progress bar of Kiln's long-running commands (bench, eval): rich, on stderr, so that
stdout keeps only the results."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def make_progress() -> Progress:
    """A rich progress bar on stderr, silent when stderr is not a terminal (CI, pipes)."""
    console = Console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, disable=not console.is_terminal)

"""The zoo's training text: the Python standard library of the running interpreter.

Every Python installation carries it, so Kiln can train and evaluate its own models with no
download. The files are read at run time and never copied into the repository. The split is
by file (a stable hash of the path relative to the stdlib root), so the same file lands on the
same side on every machine and every Python version that ships it.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch

Split = Literal["train", "heldout", "all"]
SPLITS: tuple[str, ...] = ("train", "heldout", "all")

# Files whose hash falls below this fraction of the hash range are held out (~5% of files).
HELDOUT_FRACTION = 0.05
# Third-party packages live under the stdlib directory too; they are not the standard library.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class TextEncoder(Protocol):
    """What the corpus needs from a tokenizer (a `tokenizers.Tokenizer` fits)."""

    def encode_batch(self, inputs: list[str], add_special_tokens: bool = ...) -> list: ...


@dataclass(frozen=True)
class SourceFile:
    rel_path: str  # posix path relative to the stdlib root, e.g. "json/decoder.py"
    text: str


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """Stable split decision: sha256 of the relative path, not Python's salted hash()."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def list_files(root: Path | None = None, split: Split = "all") -> list[str]:
    """Sorted relative paths of the `*.py` files of `root` (default: the stdlib) in `split`."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; valid: {', '.join(SPLITS)}")
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    paths = []
    # os.walk with pruning: site-packages under the stdlib can hold far more files than the
    # stdlib itself, and walking it only to discard it would dominate the listing time.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if not name.endswith(".py"):
                continue
            rel_path = (rel_dir / name).as_posix()
            if split == "all" or is_heldout(rel_path) == (split == "heldout"):
                paths.append(rel_path)
    return sorted(paths)


def read_files(
    split: Split = "train", root: Path | None = None, max_files: int | None = None
) -> list[SourceFile]:
    """Read the files of `split` in sorted order; `max_files` keeps the first N (for tests)."""
    root = stdlib_root() if root is None else Path(root)
    rel_paths = list_files(root, split)
    if max_files is not None:
        rel_paths = rel_paths[:max_files]
    # A few stdlib test files are deliberately mis-encoded; replacing bad bytes keeps them
    # (as the rare U+FFFD) rather than letting the file set depend on decode errors.
    return [
        SourceFile(p, (root / p).read_text(encoding="utf-8", errors="replace")) for p in rel_paths
    ]


def iter_texts(files: Sequence[SourceFile]) -> Iterator[str]:
    for f in files:
        yield f.text


def encode_files(
    tokenizer: TextEncoder, files: Sequence[SourceFile], bos_id: int, eos_id: int
) -> torch.Tensor:
    """One token stream: `<bos> file <eos>` for each file in order. Returns int64 [num_tokens]."""
    encodings = tokenizer.encode_batch([f.text for f in files], add_special_tokens=False)
    stream: list[int] = []
    for enc in encodings:
        stream.append(bos_id)
        stream.extend(enc.ids)
        stream.append(eos_id)
    return torch.tensor(stream, dtype=torch.long)


def corpus_stats(files: Sequence[SourceFile]) -> dict[str, int]:
    return {"num_files": len(files), "num_bytes": sum(len(f.text.encode()) for f in files)}

"""What produced a result (a benchmark's result.json, a trained model's training.json): the
checked-out commit and the command line as typed."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def git_commit(root: Path = REPO_ROOT) -> str | None:
    """The checked-out commit, read from ``.git`` (no git process); ``KILN_GIT_COMMIT`` wins.

    The GPU machine receives a copy of the tree whose ``.git`` may be missing or stale: set
    KILN_GIT_COMMIT there.
    """
    if os.environ.get("KILN_GIT_COMMIT"):
        return os.environ["KILN_GIT_COMMIT"]
    git = root / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if (git / ref).is_file():
            return (git / ref).read_text().strip()
        packed = git / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
    except OSError:
        return None
    return None


def command_line() -> str:
    """The command as typed, its entry point shown as ``kiln`` (cli.py, __main__.py, a path)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("cli.py", "__main__.py", "kiln")):
        argv[0] = "kiln"
    return shlex.join(argv)

"""Running the real ``kiln`` command line in-process, and what a clean failure looks like."""

from __future__ import annotations

from click.testing import CliRunner, Result

from kiln.cli import main


def kiln(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def assert_fails_cleanly(result: Result, message: str) -> None:
    """A handled error exits non-zero through SystemExit, not an escaped exception."""
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert message in result.output, result.output

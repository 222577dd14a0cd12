"""The errors zlm raises for users: one line that names the problem and the fix.

The CLI catches `ZlmError`, prints its message on one line and exits with its
`exit_code` (2 for usage errors, 1 for runtime failures). Everything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path


class ZlmError(Exception):
    """A runtime failure the user can act on (exit code 1)."""

    exit_code = 1


class UsageError(ZlmError):
    """Bad command-line input: a wrong option, a missing file (exit code 2)."""

    exit_code = 2


class DataError(ZlmError):
    """A corpus or prepared dataset that cannot be used as it is (exit code 1)."""


class CheckpointError(ZlmError):
    """A checkpoint that is missing, incomplete, corrupt or foreign (exit code 1)."""


class NonFiniteError(ZlmError):
    """Training stopped after too many non-finite losses in a row (exit code 3)."""

    exit_code = 3


def require_file(path: Path, what: str, want: str) -> None:
    """A UsageError unless `path` is a file: it does not exist, or is a directory.
    what: how the user named it ("--file", "FILE"); want: what to pass instead."""
    if path.is_dir():
        raise UsageError(f"{what} {path} is a directory; pass {want}")
    if not path.is_file():
        raise UsageError(f"{what} {path} does not exist; pass {want}")

"""How the CLI turns library errors into one line on stderr and an exit code."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import typer

from zlm.errors import ZlmError

F = TypeVar("F", bound=Callable)


def handle_errors(fn: F) -> F:
    """Wrap a command: `ZlmError` -> `error: <message>` and its exit code, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ZlmError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]

"""How the CLI speaks: library errors as one line on stderr and an exit code (`handle_errors`),
rich on a terminal or plain lines (`use_rich`), and two-column key/value tables."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
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


def use_rich() -> bool:
    """Rich on a terminal; plain lines when piped or when NO_COLOR is set."""
    from zlm.core.rich_display import use_rich as on_terminal

    return on_terminal()


def print_pairs(rows: Iterable[tuple[str, str]], rich: bool,
                plain: Callable[[str, str], str] = lambda k, v: f"{k}: {v}") -> None:
    """Key/value rows as a borderless rich table, or as plain `key: value` lines."""
    rows = list(rows)
    if not rich:
        for key, value in rows:
            typer.echo(plain(key, value))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)

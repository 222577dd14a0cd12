"""Shared CLI output: whether to render with rich, and a two-column key/value table."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import typer


def use_rich() -> bool:
    """Rich on a terminal; plain lines when piped or when NO_COLOR is set."""
    from zlm.core.progress import use_rich as on_terminal

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

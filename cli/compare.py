"""`zlm compare RUN [RUN ...]`: one table of what differs between runs and how they did.

Calls `zlm.compare.compare_runs` and renders a rich table (plain tab-separated lines in
a pipe or under NO_COLOR); `--json` prints the comparison as one JSON object.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from zlm.cli.render import handle_errors, use_rich
from zlm.core.reporter import fmt_duration

if TYPE_CHECKING:
    from zlm.tools.compare import Comparison

RESULT_HEADERS = (("best_valid_bpc", "best valid BPC"), ("test_bpc", "test BPC"), ("gap", "gap"),
                  ("parameters", "params"), ("chars_per_s", "chars/s"),
                  ("train_time_s", "train time"))
# Short headers for the usual settings (the JSON keeps the config names).
ALIASES = {"zoneout_cell": "z_c", "zoneout_hidden": "z_h", "batch_size": "batch",
           "max_steps": "max steps", "eval_every": "eval every", "time_budget": "time budget",
           "weight_decay": "wd", "schedule.kind": "schedule"}


@handle_errors
def command(
    runs: Annotated[list[Path], typer.Argument(
        help="Run directories (the --out of zlm train or of a recipe's runs).", metavar="RUN",
        show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Settings that differ across runs, best valid BPC, test BPC, the generalisation gap, size, speed and time."""
    from zlm.tools.compare import compare_runs

    comparison = compare_runs(runs)
    if as_json:
        typer.echo(json.dumps(comparison.to_dict()))
        return
    if not use_rich():
        header, rows = table(comparison)
        for row in [header] + rows:
            typer.echo("\t".join(row))
        return
    from rich.console import Console

    Console().print(rich_table(comparison))


def rich_table(comparison: Comparison):
    """The comparison as a rich Table: one row per run, the best valid BPC in bold."""
    from rich import box
    from rich.table import Table

    header, rows = table(comparison)
    t = Table(header_style="bold", box=box.SIMPLE_HEAD)
    for i, name in enumerate(header):
        t.add_column(name, justify="left" if i == 0 else "right", no_wrap=i == 0,
                     style="bold" if name == "best valid BPC" else None)
    for row in rows:
        t.add_row(*row)
    return t


def _cell(key: str, value) -> str:
    if value is None:
        return "-"
    if key in ("best_valid_bpc", "test_bpc"):
        return f"{value:.4f}"
    if key == "gap":
        return f"{value:+.4f}"
    if key == "parameters":
        return f"{value:,}"
    if key == "chars_per_s":
        return f"{value:,.0f}"
    if key == "train_time_s":
        return fmt_duration(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def table(c: Comparison) -> tuple[list[str], list[list[str]]]:
    """Header and rows as strings: run, the differing settings, then the results."""
    header = ["run"] + [ALIASES.get(s, s) for s in c.settings] + [h for _, h in RESULT_HEADERS]
    rows = [[r["run"]] + [_cell(s, r.get(s)) for s in c.settings]
            + [_cell(k, r.get(k)) for k, _ in RESULT_HEADERS] for r in c.rows]
    return header, rows

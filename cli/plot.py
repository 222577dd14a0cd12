"""`zlm plot RUN [RUN ...]`: learning curves as a PNG, or a compact terminal view.

With `--out FILE` it calls `zlm.plot.plot_runs` (matplotlib). Without, it prints each
run's train and valid BPC as sparklines on one shared x axis (characters seen or time)
and one shared BPC scale, so runs can be compared by eye in 80 columns; in colour on a
terminal, plain lines in a pipe or under NO_COLOR.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from zlm.cli.render import handle_errors, use_rich
from zlm.core.reporter import fmt_duration
from zlm.errors import UsageError

if TYPE_CHECKING:
    from zlm.tools.curves import RunCurves

BARS = "▁▂▃▄▅▆▇█"
WIDTH = 48  # sparkline columns: fits 80 with the 7-column name and two values


@handle_errors
def command(
    runs: Annotated[list[Path], typer.Argument(
        help="Run directories (the --out of zlm train).", metavar="RUN",
        show_default=False)],
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Write the figure here (PNG; needs matplotlib: "
                            "pip install 'zlm\\[plot]'). Without it: a terminal view.",
        show_default=False)] = None,
    x: Annotated[str, typer.Option(
        "--x", help="x axis: chars (characters seen) | time (wall-clock training time).")]
        = "chars",
) -> None:
    """Train (dashed) and valid (solid) BPC of one or more runs, one colour per run."""
    if x not in ("chars", "time"):
        raise UsageError(f"--x {x} is not an axis; use chars or time")
    from zlm.tools.curves import read_runs

    curves = read_runs(runs)
    if out is not None:
        from zlm.tools.plot import plot_runs

        path = plot_runs(curves, out, x=x)
        typer.echo(f"wrote {path} ({len(curves)} run{'s' * (len(curves) != 1)})")
        return
    rich = use_rich()
    render_terminal(curves, x, console=None if rich else False)


def spark(values: list[float | None], lo: float, hi: float) -> str:
    """One glyph per value on the scale [lo, hi] (low BPC = low bar); None = blank."""
    out = []
    for v in values:
        if v is None or v != v:
            out.append(" ")
            continue
        f = 0.0 if hi <= lo else (min(max(v, lo), hi) - lo) / (hi - lo)
        out.append(BARS[round(f * (len(BARS) - 1))])
    return "".join(out)


def _fmt_x(value: float, x: str) -> str:
    if x == "time":
        return fmt_duration(value)
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= div:
            return f"{value / div:.3g}{unit}"
    return f"{value:.0f}"


def terminal_lines(curves: list[RunCurves], x: str = "chars", width: int = WIDTH) -> list[tuple[str, str]]:
    """(style, text) lines: per run a header and its train and valid sparklines."""
    from zlm.tools.curves import sample_at

    xmax = max((max(c.train.x(x)[-1:] + c.valid.x(x)[-1:], default=0.0) for c in curves),
               default=0.0)
    values = [b for c in curves for b in c.train.bpc[len(c.train.bpc) // 10:] + c.valid.bpc
              if b == b and abs(b) != float("inf")]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    xs = [xmax * (i + 1) / width for i in range(width)]
    axis = "characters seen" if x == "chars" else "training time"
    lines = [("bold", f"BPC {lo:.2f} (▁) to {hi:.2f} (█), x: {axis} 0 to {_fmt_x(xmax, x)}, "
                      f"{width} columns")]
    for i, c in enumerate(curves):
        best = c.best_valid_bpc
        head = f"{c.name}  {c.settings}  step {c.steps:,}"
        if c.elapsed_s is not None:
            head += f"  {fmt_duration(c.elapsed_s)}"
        lines.append((f"bold color({i % 6 + 1})", head))
        for label, curve, last in (("train", c.train, c.final_train_bpc), ("valid", c.valid, best)):
            what = "best" if label == "valid" else "last"
            tail = f"{what} {last:.3f}" if last is not None else "-"
            line = spark(sample_at(curve, x, xs), lo, hi) if len(curve) else " " * width
            lines.append(("", f"  {label} {line} {tail}"))
    return lines


def render_terminal(curves: list[RunCurves], x: str = "chars", console=None) -> None:
    """Print the sparkline view: on `console` (a rich Console; None = a new one), or as
    plain lines through typer.echo when console is False."""
    lines = terminal_lines(curves, x)
    if console is False:
        for _, text in lines:
            typer.echo(text)
        return
    from rich.console import Console
    from rich.text import Text

    console = console or Console()
    for style, text in lines:
        console.print(Text(text, style=style or ""), soft_wrap=True)

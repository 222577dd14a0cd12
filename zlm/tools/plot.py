"""Learning curves as a PNG: train and valid BPC of several runs on one figure.

Owns `plot_runs(runs, out, x=...)`. One colour per run; its valid BPC is a solid line
with markers at each validation, its train BPC a thin dashed line of the same colour.
The x axis is characters seen (log scale, so early learning and the long tail both
show) or wall-clock training time. matplotlib is optional (`pip install 'zlm[plot]'`),
imported only here and only when a figure is drawn, through the Agg canvas directly so
that no global backend is switched and no display is needed.
"""

from __future__ import annotations

from pathlib import Path

from zlm.errors import UsageError, ZlmError
from zlm.tools.curves import RunCurves

AXES = ("chars", "time")
MISSING = "matplotlib is not installed; pip install 'zlm[plot]'"


def _matplotlib():
    """(Figure, FigureCanvasAgg), or the one-line ZlmError saying how to install them."""
    try:
        import matplotlib  # noqa: F401  (fails first, before any cached submodule is used)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ZlmError(MISSING) from None
    return Figure, FigureCanvasAgg


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 2 * 3600:
        return 3600.0, "hours"
    if seconds >= 2 * 60:
        return 60.0, "minutes"
    return 1.0, "seconds"


def plot_runs(runs: list[RunCurves], out, x: str = "chars", title: str | None = None,
              dpi: int = 120) -> Path:
    """Draw train and valid BPC of `runs` against `x` ("chars" | "time") into `out` (PNG,
    or any format matplotlib knows by the suffix). Returns the path written."""
    if x not in AXES:
        raise UsageError(f"--x {x} is not an axis; use chars or time")
    if not runs:
        raise UsageError("no runs to plot; pass one or more run directories")
    Figure, Canvas = _matplotlib()
    out = Path(out)
    if out.suffix == "":
        out = out.with_suffix(".png")
    fig = Figure(figsize=(9, 5.5), dpi=dpi, layout="constrained")
    Canvas(fig)
    ax = fig.add_subplot()
    longest = max((max(r.train.seconds[-1:] + r.valid.seconds[-1:], default=0.0) for r in runs),
                  default=0.0)
    scale, unit = _time_unit(longest)
    colours = [f"C{i % 10}" for i in range(len(runs))]
    drew = False
    for run, colour in zip(runs, colours, strict=True):
        if len(run.train):
            ax.plot([v / scale for v in run.train.seconds] if x == "time" else run.train.chars,
                    run.train.bpc, color=colour, linestyle="--", linewidth=0.9, alpha=0.8,
                    marker="." if len(run.train) == 1 else None)
            drew = True
        if len(run.valid):
            ax.plot([v / scale for v in run.valid.seconds] if x == "time" else run.valid.chars,
                    run.valid.bpc, color=colour, linestyle="-", linewidth=2.0, marker="o",
                    markersize=3, label=_legend(run))
            drew = True
        elif len(run.train):  # no validation yet: the legend still names the run
            ax.plot([], [], color=colour, linestyle="-", linewidth=2.0, label=_legend(run))
    if not drew:
        raise ZlmError("the runs have logged no BPC yet (no train or eval events in "
                       "metrics.jsonl); plot them after their first --log-every steps")
    if x == "chars":
        ax.set_xscale("log")
        ax.set_xlabel("characters seen (step x batch x bptt x processes)")
    else:
        ax.set_xlabel(f"training time ({unit})")
    ax.set_ylabel("bits per character (BPC)")
    ax.set_title(title or "train (dashed) and valid (solid) BPC")
    ax.grid(True, which="both", alpha=0.3)
    _clip_y(ax, runs)
    ax.legend(fontsize=8, loc="upper right")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out)
    except OSError as e:
        raise ZlmError(f"cannot write {out} ({e.strerror or e}); pass another --out") from None
    return out


def _legend(run: RunCurves) -> str:
    best = run.best_valid_bpc
    tail = f", best {best:.3f}" if best is not None else ""
    return f"{run.name}: {run.settings}{tail}"


def _clip_y(ax, runs: list[RunCurves]) -> None:
    """Keep the interesting range: the first steps' ~log2(vocab) BPC would squash the rest."""
    values = [b for r in runs for b in r.train.bpc[len(r.train.bpc) // 10:] + r.valid.bpc
              if b == b and abs(b) != float("inf")]
    if not values:
        return
    lo, hi = min(values), max(values)
    pad = max(0.05 * (hi - lo), 0.02)
    ax.set_ylim(lo - pad, hi + pad)

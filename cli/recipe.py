"""`zlm recipe NAME`: run a whole experiment (`zlm.recipes`) and print its results table.

    zlm recipe zoneout-ablation   the same LSTM x 4: no zoneout, z_h only, z_c only, both
    zlm recipe equal-budget       cpu-small for 10 minutes next to published CPU baselines
    zlm recipe corpora-benchmark  zlm's defaults vs a plain LSTM on every benchmark corpus
    zlm recipe defaults-loco      the rule's zoneout, window and lr chosen leave-one-corpus-out, scored held out

All write OUT/results.json, OUT/results.md and curves, and continue where they stopped
when the same command is run again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from zlm.cli.render import handle_errors, use_rich
from zlm.errors import UsageError

if TYPE_CHECKING:
    from zlm.tools.recipes import RecipeResult

H_MODEL, H_BUDGET = "Model and training (default: the recipe's)", "Budget"
H_BENCH = "corpora-benchmark and defaults-loco"


@handle_errors
def command(
    name: Annotated[str, typer.Argument(
        help="zoneout-ablation | equal-budget | corpora-benchmark | defaults-loco.", metavar="NAME",
        show_default=False)],
    corpus: Annotated[str | None, typer.Option(
        help="A text file or corpus name, prepared once into OUT/data (char, 90/5/5), e.g. "
             "corpus.txt (default: tinyshakespeare).",
        show_default=False)] = None,
    corpora: Annotated[Path | None, typer.Option(
        help="OUT_DIR of scripts/fetch-corpora (default: $ZLM_BENCH_CORPORA, else "
             "runs/corpora).", rich_help_panel=H_BENCH, show_default=False)] = None,
    only: Annotated[str | None, typer.Option(
        help="Comma-separated benchmark corpora to run (default: all of corpora/benchmark.json).",
        rich_help_panel=H_BENCH, show_default=False)] = None,
    seeds: Annotated[str | None, typer.Option(
        help="Seeds, one run per setting each (default: 1,2).", rich_help_panel=H_BENCH,
        show_default=False)] = None,
    record: Annotated[Path | None, typer.Option(
        help="Also keep each finished run's spec, log and scores (no weights) in DIR, and restore the runs "
             "found there instead of training them: continue on another machine. A run planned otherwise "
             "than now (the defaults rule changed) is trained again and its record replaced.", rich_help_panel=H_BENCH, metavar="DIR", show_default=False)] = None,
    report: Annotated[bool, typer.Option(
        "--report", help="Train nothing: write the tables from the runs finished so far (here or "
        "in --record) and list the runs left.", rich_help_panel=H_BENCH)] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Output directory (default: runs/NAME).", show_default=False)] = None,
    mirror: Annotated[Path | None, typer.Option(
        help="Local copy of named corpora (else $ZLM_CORPORA, the cache, or a download).",
        show_default=False)] = None,
    minutes: Annotated[float | None, typer.Option(
        help="Training time per run (default: 11 for zoneout-ablation: its first run, the "
             "others then train for as many steps; 10 for the others).",
        rich_help_panel=H_BUDGET, show_default=False)] = None,
    max_steps: Annotated[int | None, typer.Option(
        help="A fixed number of steps per run instead of --minutes.",
        rich_help_panel=H_BUDGET, show_default=False)] = None,
    hidden: Annotated[int | None, typer.Option(
        help="Units per layer (default: 512).",
        rich_help_panel=H_MODEL, show_default=False)] = None,
    layers: Annotated[int | None, typer.Option(
        help="LSTM layers (default: 1).", rich_help_panel=H_MODEL, show_default=False)] = None,
    embed: Annotated[int | None, typer.Option(
        help="Embedding width (default: ablation 128, cpu-small 64).", rich_help_panel=H_MODEL,
        show_default=False)] = None,
    batch_size: Annotated[int | None, typer.Option(
        help="Streams (default: 32).", rich_help_panel=H_MODEL, show_default=False)] = None,
    bptt: Annotated[int | None, typer.Option(
        help="Truncated backprop window (default: 100).", rich_help_panel=H_MODEL,
        show_default=False)] = None,
    lr: Annotated[float | None, typer.Option(
        help="Adam learning rate (default: ablation 3e-3, equal-budget 4e-3, decayed by cosine over the budget).", rich_help_panel=H_MODEL,
        show_default=False)] = None,
    eval_every: Annotated[int | None, typer.Option(
        help="Validate and checkpoint every N steps (default: 200).",
        rich_help_panel=H_MODEL, show_default=False)] = None,
    log_every: Annotated[int | None, typer.Option(
        help="Steps between logged train BPC values (default: 10).", rich_help_panel=H_MODEL,
        show_default=False)] = None,
    seed: Annotated[int | None, typer.Option(
        help="Random seed (default: 1234).", rich_help_panel=H_MODEL, show_default=False)] = None,
    device: Annotated[str | None, typer.Option(
        help="cpu (default: the budgets are CPU budgets) | cuda | auto.",
        rich_help_panel=H_MODEL, show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Run an experiment end to end: prepare, train, score the best checkpoints, plot."""
    from zlm.core.reporter import PlainReporter
    from zlm.core.rich_display import make_reporter

    sizes = dict(hidden=hidden, layers=layers, embed=embed, batch_size=batch_size, bptt=bptt,
                 eval_every=eval_every, log_every=log_every, device=device)
    # With --json, stdout carries only the JSON: training progress goes to stderr.
    reporter = (lambda: PlainReporter(sys.stderr)) if as_json else make_reporter
    result = _run(name, reporter, sizes, corpus=corpus, corpora=corpora, only=only, seeds=seeds,
                  record=record, report=report or None, out=out, mirror=mirror, minutes=minutes,
                  max_steps=max_steps, lr=lr, seed=seed)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        render(result, use_rich())


def _run(name: str, reporter, sizes: dict, *, corpus, corpora, only, seeds, out, mirror,
         minutes, max_steps, lr, seed, record=None, report=None) -> RecipeResult:
    """Build the recipe's config from the options that apply to it, and run it."""
    from zlm.tools import benchmark as cb
    from zlm.tools import loco
    from zlm.tools.recipes import RecipeConfig, run_recipe

    if name in (cb.NAME, loco.NAME):
        _refuse(name, corpus=corpus, lr=lr, seed=seed)
        config = cb.BenchmarkConfig(
            corpora=corpora, only=only, out=out, mirror=mirror, max_steps=max_steps, record=record,
            report=bool(report),
            minutes=cb.DEFAULT_MINUTES if minutes is None else minutes,
            seeds=cb.DEFAULT_SEEDS if seeds is None else cb.parse_seeds(seeds),
            sizes={k: v for k, v in sizes.items() if v is not None})
        return (cb.corpora_benchmark if name == cb.NAME else loco.defaults_loco)(config, reporter)
    _refuse(name, corpora=corpora, only=only, seeds=seeds, record=record, report=report)
    config = RecipeConfig(corpus=corpus or "tinyshakespeare", out=out, mirror=mirror,
                          minutes=minutes, max_steps=max_steps, lr=lr, seed=seed, **sizes)
    return run_recipe(name, config, reporter)


def _refuse(name: str, **given) -> None:
    for option, value in given.items():
        if value is not None:
            raise UsageError(f"--{option.replace('_', '-')} does not apply to zlm recipe {name}")


def render(result: RecipeResult, rich: bool) -> None:
    files = ", ".join(str(p) for p in result.files)
    if not rich:
        typer.echo(result.markdown)
        typer.echo(f"wrote {files}")
        return
    from rich.console import Console
    from rich.markdown import Markdown

    console = Console()
    console.print(Markdown(result.markdown))
    console.print(f"[bold]wrote[/] {files}", highlight=False)

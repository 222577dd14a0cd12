"""The `zlm` command-line app (installed as `zlm.cli`).

One small module per subcommand; each parses options, builds a config, calls one
library function and renders the result.

    zlm prepare SOURCE --out DATA_DIR    corpus -> tokenizer + train/valid/test.bin
    zlm train SOURCE [--out RUN_DIR]     train a zoneout LSTM, live BPC, checkpoints
    zlm eval RUN                         bits per character on a split or a file
    zlm compress RUN FILE                code a file with the model (.zlmz); decompress
    zlm sample RUN                       generate text
    zlm score RUN [FILE|-]               bits per character of a text: a heat map of surprise
    zlm info RUN                         what a run or checkpoint holds, without tensors
    zlm serve RUN                        an HTTP server: streamed sampling, scoring, a playground
    zlm export RUN -o OUT                the model as one step for ONNX / torch.export
    zlm bench                            cell throughput against torch.nn.LSTM
    zlm plot RUN [RUN ...]               learning curves: a PNG (--out) or a terminal view
    zlm compare RUN [RUN ...]            what differs between runs, and their BPC
    zlm recipe NAME                      whole experiments: zoneout-ablation, equal-budget
    zlm --version                        versions, device, and the cell and precision it gets
    zlm --install-completion             shell completion (bash, zsh, fish, PowerShell)
"""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from zlm.core.allocator import keep_freed_memory

app = typer.Typer(
    name="zlm",
    help="Character-level language models with zoneout LSTMs.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, pwsh
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

from zlm.cli import (  # noqa: E402
    bench,
    compare,
    compress,
    evaluate,
    export,
    info,
    plot,
    prepare,
    recipe,
    sample,
    score,
    serve,
    train,
)

app.command("prepare")(prepare.command)
app.command("train")(train.command)
app.command("eval")(evaluate.command)
app.command("compress")(compress.command)
app.command("decompress")(compress.decompress)
app.command("sample")(sample.command)
app.command("score")(score.command)
app.command("info")(info.command)
app.command("serve")(serve.command)
app.command("export")(export.command)
app.command("bench")(bench.command)
app.command("plot")(plot.command)
app.command("compare")(compare.command)
app.command("recipe")(recipe.command)


def _print_version(value: bool) -> None:
    if not value:
        return
    from zlm.tools.environment import environment

    for key, text in environment():
        typer.echo(f"{key} {text}" if key in ("zlm", "torch") else f"{key}: {text}")
    raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=_print_version,
        help="Print zlm, torch and Python versions, the device, and the cell and precision "
             "this machine gets, then exit.")] = False,
) -> None:
    """Character-level language models with zoneout LSTMs."""


def main() -> None:
    """Console-script entry point. Library notices (the `zlm` loggers: e.g. compiling the
    CPU cell's C++ step on first use, and how long it took) go to stderr as plain lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("zlm: %(message)s"))
    logger = logging.getLogger("zlm")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    keep_freed_memory()  # before the first large allocation (zlm/core/allocator.py)
    app()

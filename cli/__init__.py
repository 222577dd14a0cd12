"""The `zlm` command-line app (installed as `zlm.cli`).

One small module per subcommand; each parses options, builds a config, calls one
library function and renders the result.

    zlm prepare SOURCE --out DATA_DIR    corpus -> tokenizer + train/valid/test.bin
    zlm train SOURCE [--out RUN_DIR]     train a zoneout LSTM, live BPC, checkpoints
    zlm eval RUN                         bits per character on a split or a file
    zlm compress RUN FILE                code a file with the model (.zlmz); decompress
    zlm sample RUN                       generate text
    zlm info RUN                         what a run or checkpoint holds, without tensors
    zlm bench                            cell throughput against torch.nn.LSTM
    zlm plot RUN [RUN ...]               learning curves: a PNG (--out) or a terminal view
    zlm compare RUN [RUN ...]            what differs between runs, and their BPC
    zlm recipe NAME                      whole experiments: zoneout-ablation, equal-budget
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="zlm",
    help="Character-level language models with zoneout LSTMs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

from zlm.cli import (  # noqa: E402
    bench,
    compare,
    compress,
    decompress,
    evaluate,
    info,
    plot,
    prepare,
    recipe,
    sample,
    train,
)

app.command("prepare")(prepare.command)
app.command("train")(train.command)
app.command("eval")(evaluate.command)
app.command("compress")(compress.command)
app.command("decompress")(decompress.command)
app.command("sample")(sample.command)
app.command("info")(info.command)
app.command("bench")(bench.command)
app.command("plot")(plot.command)
app.command("compare")(compare.command)
app.command("recipe")(recipe.command)


def main() -> None:
    """Console-script entry point."""
    app()

"""`zlm export RUN --format onnx|torch-export -o OUT`: parse options, call `export_run`, report.

OUT is a directory: the single-step model (tokens, h, c -> logits, h, c), the tokenizer
beside it and zlm-export.json (see `zlm.inference.export`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from zlm.cli.render import handle_errors


@handle_errors
def command(
    run: Annotated[Path, typer.Argument(
        help="A RUN_DIR (its best/, else its latest complete checkpoint) or a checkpoint "
             "directory.", metavar="RUN_OR_CHECKPOINT", show_default=False)],
    out: Annotated[Path, typer.Option(
        "-o", "--out", help="Directory to write: the model, its tokenizer, zlm-export.json.",
        metavar="OUT", show_default=False)],
    format: Annotated[str, typer.Option(
        "--format", help="onnx (needs pip install 'zlm\\[export]') | torch-export (.pt2).")] = "onnx",
    force: Annotated[bool, typer.Option(help="Replace OUT if it exists.")] = False,
) -> None:
    """Export the eval-mode model as a single-step function (tokens, h, c -> logits, h, c)."""
    from zlm.inference.export import ExportConfig, export_run

    result = export_run(run, ExportConfig(format=format, out=out, force=force))
    m = result.meta
    typer.echo(f"wrote {result.model_file} ({m['format']}: tokens (B,), h, c ({m['layers']}, B, "
               f"{m['hidden']}) -> logits (B, {m['vocab_size']}), h, c), "
               f"{m['tokenizer']['file']} and zlm-export.json in {result.out}")

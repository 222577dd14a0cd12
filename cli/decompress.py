"""`zlm decompress RUN FILE.zlmz [-o OUT]`: restore a file `zlm compress` coded."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from zlm.cli.compress import render
from zlm.cli.errors import handle_errors
from zlm.core.progress import make_byte_progress
from zlm.inference.compress import decompress_file


@handle_errors
def command(
    run: Annotated[Path, typer.Argument(
        help="The RUN_DIR or checkpoint the file was compressed with.",
        metavar="RUN_OR_CHECKPOINT", show_default=False)],
    file: Annotated[Path, typer.Argument(help="A .zlmz file.", show_default=False)],
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Output path [default: FILE without .zlmz].",
        show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite OUT.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Decompress FILE.zlmz; refuses another model, a damaged or a truncated file."""
    path, result = decompress_file(run, file, out, force, make_byte_progress)
    render(path, result, as_json, "decompressed")

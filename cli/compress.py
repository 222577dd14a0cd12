"""`zlm compress RUN FILE [-o OUT]` and `zlm decompress RUN FILE.zlmz [-o OUT]`.

The two halves of one codec (like gzip and gunzip), so one module: `command` codes a
file with the model's predictions into .zlmz, `decompress` restores it (refusing another
model, a damaged or a truncated file).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from zlm.cli.render import handle_errors, print_pairs, use_rich
from zlm.errors import UsageError
from zlm.inference.adapt_config import DEFAULT_DECAY, DEFAULT_LR, DEFAULT_SEGMENT, DynamicConfig

if TYPE_CHECKING:
    from zlm.inference.compress import CompressResult


@handle_errors
def command(
    run: Annotated[Path, typer.Argument(
        help="The RUN_DIR or checkpoint whose model codes the file (decompression needs "
             "the same one).", metavar="RUN_OR_CHECKPOINT", show_default=False)],
    file: Annotated[Path, typer.Argument(help="Any file (text or not).", show_default=False)],
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Output path \\[default: FILE.zlmz].", show_default=False)] = None,
    adapt: Annotated[bool, typer.Option(
        "--adapt", help="Dynamic evaluation while coding (decompression repeats it): "
        "smaller files, about 2-3x slower.")] = False,
    dynamic_lr: Annotated[float, typer.Option(help="--adapt: step size.")] = DEFAULT_LR,
    dynamic_decay: Annotated[float, typer.Option(
        help="--adapt: decay toward the trained weights.")] = DEFAULT_DECAY,
    segment: Annotated[int, typer.Option(
        help="--adapt: steps per segment (one update each).")] = DEFAULT_SEGMENT,
    streams: Annotated[int | None, typer.Option(
        help="Parallel streams S \\[default: one per 2048 bytes and per 512 bytes of the "
             "file's zlib size, at most 64]: more is faster, each costs a cold start.",
        show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite OUT.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Compress FILE with the model's next-token distribution and a range coder."""
    from zlm.core.rich_display import make_byte_progress
    from zlm.inference.compress import compress_file

    dyn = DynamicConfig(dynamic_lr, dynamic_decay, segment) if adapt else None
    if streams is not None and streams < 1:
        raise UsageError(f"--streams must be >= 1, got {streams}")
    path, result = compress_file(run, file, out, dyn, streams, force, make_byte_progress)
    render(path, result, as_json, "compressed")


@handle_errors
def decompress(
    run: Annotated[Path, typer.Argument(
        help="The RUN_DIR or checkpoint the file was compressed with.",
        metavar="RUN_OR_CHECKPOINT", show_default=False)],
    file: Annotated[Path, typer.Argument(help="A .zlmz file.", show_default=False)],
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Output path \\[default: FILE without .zlmz].",
        show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite OUT.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Decompress FILE.zlmz; refuses another model, a damaged or a truncated file."""
    from zlm.core.rich_display import make_byte_progress
    from zlm.inference.compress import decompress_file

    path, result = decompress_file(run, file, out, force, make_byte_progress)
    render(path, result, as_json, "decompressed")


def rows(path: Path, r: CompressResult, verb: str) -> list[tuple[str, str]]:
    d = r.to_dict()
    out = [(verb, str(path)),
           ("sizes", f"{r.original_bytes:,} -> {r.compressed_bytes:,} bytes "
                     f"(header {r.header_bytes} bytes)"),
           ("bits per char", f"{d['bits_per_char']:.4f} over {r.characters:,} characters"),
           ("bits per byte", f"{d['bits_per_byte']:.4f}")]
    if r.model_bits is not None:
        out.append(("model code length", f"{d['model_bits_per_char']:.4f} bits/char "
                                          f"({r.model_bits / 8:,.0f} bytes)"))
    stored = ("none stored" if not r.stored_blocks else "all stored" if r.stored_blocks == r.blocks
              else f"{r.stored_blocks} stored")
    out += [("layout", f"{r.streams} parallel streams, {r.symbols:,} symbols, {r.blocks} blocks "
                       f"({stored})" + (f"; adapting ({r.adapt.describe()})" if r.adapt else "")),
            ("speed", f"{d['kb_per_s']:,.1f} KB/s ({r.seconds:.2f} s)")]
    return out


def render(path: Path, result: CompressResult, as_json: bool, verb: str) -> None:
    if as_json:
        typer.echo(json.dumps({"output": str(path), **result.to_dict()}))
    else:
        print_pairs(rows(path, result, verb), use_rich())

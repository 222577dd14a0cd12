"""`zlm prepare SOURCE --out DATA_DIR`: parse options, call `zlm.prepare.prepare`, render.

A progress bar and a summary table on a terminal; plain lines when stdout is not a TTY
or NO_COLOR is set.
"""

from __future__ import annotations

import pathlib
import time
from typing import Annotated

import typer

from zlm.cli.render import handle_errors, use_rich
from zlm.errors import UsageError


def _fractions(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--split {text} is not three fractions; pass e.g. 0.9,0.05,0.05") \
            from None


@handle_errors
def command(
    source: Annotated[list[str], typer.Argument(
        help="Text file(s), a directory (read recursively, sorted), a .gz file, or a corpus "
             "name: tinyshakespeare, ptb-char, text8, enwik8, stdlib (offline).",
        metavar="SOURCE...", show_default=False)],
    out: Annotated[pathlib.Path, typer.Option(
        "--out", "-o", help="DATA_DIR to write (refused if it exists and is not empty).",
        show_default=False)],
    tokenizer: Annotated[str | None, typer.Option(
        help="char | byte | bpe | unigram. Default: the corpus's own (byte for enwik8), "
             "else char.", show_default=False)] = None,
    vocab_size: Annotated[int | None, typer.Option(
        help="Vocabulary size for bpe/unigram (default 1024).", show_default=False)] = None,
    split: Annotated[str | None, typer.Option(
        help="Contiguous train,valid,test fractions by characters. Default 0.9,0.05,0.05 "
             "(named corpora: their published split).", show_default=False)] = None,
    valid: Annotated[pathlib.Path | None, typer.Option(
        help="Validation file (with --test, instead of --split).", show_default=False)] = None,
    test: Annotated[pathlib.Path | None, typer.Option(
        help="Test file (with --valid, instead of --split).", show_default=False)] = None,
    unknown: Annotated[str | None, typer.Option(
        help="Characters of valid/test missing from train: error | replace (U+FFFD) | include "
             "(vocabulary from the whole corpus). Default error (stdlib: replace).",
        show_default=False)] = None,
    format: Annotated[str, typer.Option(
        "--format", help="Source format for files: text | ptb-char (Mikolov's PTB "
                         "character files).")] = "text",
    mirror: Annotated[pathlib.Path | None, typer.Option(
        help="Local copy of named corpora, laid out as DIR/<name>/<file> (default: "
             "$ZLM_CORPORA, then the cache, then download).", show_default=False)] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace an existing DATA_DIR.")] = False,
) -> None:
    """Tokenize a corpus into DATA_DIR: tokenizer, train/valid/test.bin and dataset.json."""
    from zlm.data.prepare import PrepareConfig, prepare

    config = PrepareConfig(
        tokenizer=tokenizer, vocab_size=vocab_size, split=_fractions(split),
        valid=valid, test=test, unknown=unknown, mirror=mirror, format=format,
    )
    src: str | list[str] = source[0] if len(source) == 1 else list(source)
    rich = use_rich()
    start = time.perf_counter()
    if rich:
        dataset = _with_progress_bar(src, out, config, force)
    else:
        dataset = prepare(src, out, config, force=force)
    elapsed = time.perf_counter() - start
    _render(dataset, elapsed, rich)


def _with_progress_bar(src, out, config, force):
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from zlm.data.prepare import prepare

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task("preparing", total=None)

        def on_progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total or None)

        return prepare(src, out, config, on_progress=on_progress, force=force)


def _render(dataset, elapsed: float, rich: bool) -> None:
    from zlm.data.dataset import SPLITS

    meta = dataset.meta
    tok = meta["tokenizer"]
    splits = {s: dataset.split_info(s) for s in SPLITS}
    total_bytes = sum(i.bytes for i in splits.values())
    speed = total_bytes / 1e6 / max(elapsed, 1e-9)
    head = (f"{tok['kind']} tokenizer, vocabulary {tok['vocab_size']:,}, dtype {meta['dtype']}, "
            f"unit {meta['unit']}")
    tail = f"{total_bytes / 1e6:,.1f} MB in {elapsed:.2f} s ({speed:,.1f} MB/s)"
    if not rich:
        typer.echo(f"prepared {dataset.path}: {head}")
        for s, i in splits.items():
            typer.echo(f"{s}: {i.tokens:,} tokens, {i.characters:,} characters, "
                       f"{i.bytes:,} bytes")
        typer.echo(tail)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{dataset.path}", caption=f"{head}\n{tail}")
    for col in ("split", "tokens", "characters", "bytes"):
        table.add_column(col, justify="left" if col == "split" else "right")
    for s, i in splits.items():
        table.add_row(s, f"{i.tokens:,}", f"{i.characters:,}", f"{i.bytes:,}")
    Console().print(table)

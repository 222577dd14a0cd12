"""`zlm score RUN [FILE | -]`: parse options, call `zlm.inference.score.score`, render.

On a terminal the text is printed with each character coloured by its bits, then a
legend and the totals; piped (or NO_COLOR) each line of the text is printed after its
bits and BPC. `--html OUT` writes a self-contained heat map page (hover: bits and the
model's top-k next tokens); `--json` prints one JSON object per character, then one
`{"summary": {...}}` object with the totals.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from zlm.cli.evaluate import CacheFlag, CacheLambda, CacheSize, CacheTheta, cache_config
from zlm.cli.render import handle_errors, print_pairs, use_rich
from zlm.cli.textinput import read_text
from zlm.core.metrics import LN2
from zlm.inference.adapt_config import DEFAULT_CACHE_SIZE, DEFAULT_CACHE_THETA

if TYPE_CHECKING:
    from zlm.inference.score import ScoredText


@handle_errors
def command(
    run: Annotated[Path, typer.Argument(
        help="A RUN_DIR (its best/, else its latest complete checkpoint) or a checkpoint "
             "directory.", metavar="RUN_OR_CHECKPOINT", show_default=False)],
    file: Annotated[str, typer.Argument(
        help="A UTF-8 text file, or - to read standard input.", metavar="FILE|-")] = "-",
    html: Annotated[Path | None, typer.Option(
        "--html", help="Write a self-contained HTML heat map to OUT (hover: bits, top-k).",
        metavar="OUT", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="One JSON object per character (char, bits, top), then a summary.")] = False,
    top_k: Annotated[int, typer.Option(help="Most likely next tokens kept per character.")] = 5,
    batch_size: Annotated[int, typer.Option(
        help="Parallel streams (each after the first reads the --stream-context tokens before its "
             "stretch first); 1 = exact.")] = 1,
    stream_context: Annotated[int, typer.Option(
        "--stream-context",
        help="With --batch-size above 1: tokens of context each stream after the first "
             "reads before its stretch, not scored (0: a zero state).")] = 256,
    bptt: Annotated[int, typer.Option(
        help="Window length in tokens; the state is carried across windows.")] = 256,
    unknown: Annotated[str, typer.Option(
        help="Characters outside a char vocabulary: error | replace (U+FFFD, if the "
             "vocabulary has it).")] = "error",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda.")] = "auto",
    cache: CacheFlag = False,
    cache_size: CacheSize = DEFAULT_CACHE_SIZE,
    cache_theta: CacheTheta = DEFAULT_CACHE_THETA,
    cache_lambda: CacheLambda = None,
) -> None:
    """Bits the model spends on each character of a text: a heat map of its surprise."""
    from zlm.cli.heatmap import check_html_target, write_html
    from zlm.inference.score import ScoreConfig, score

    config = ScoreConfig(streams=batch_size, bptt=bptt, top_k=top_k, unknown=unknown, device=device,
                         stream_context=stream_context,
                         cache=cache_config(cache, cache_size, cache_theta, cache_lambda))
    if html is not None:
        check_html_target(html)  # before the model loads
    text = read_text(file, "FILE")
    source = "standard input" if file == "-" else file
    result = score(run, text, config, source)
    if html is not None:
        write_html(result, html, source)
    if as_json:
        for i in range(len(result.text)):
            typer.echo(json.dumps(result.char_dict(i), ensure_ascii=False))
        typer.echo(json.dumps({"summary": result.summary()}))
    elif html is None:
        _render(result, use_rich())
    else:
        typer.echo(f"wrote {html} ({result.score.bpc:.4f} bits/character over "
                   f"{result.score.characters:,} characters)")


def _rows(r: ScoredText) -> list[tuple[str, str]]:
    s = r.score
    rows = [("BPC", f"{s.bpc:.4f} bits/character ({s.nats / LN2:,.1f} bits "
                    f"over {s.characters:,} characters)")]
    if s.bytes != s.characters:
        rows.append(("bits per byte", f"{s.bits_per_byte:.4f} bits/byte over {s.bytes:,} bytes"))
    rows += [("characters", r.attribution + f" ({r.tokenizer} tokenizer, {s.tokens:,} tokens)"),
             ("protocol", r.protocol), ("source", r.source), ("checkpoint", r.checkpoint)]
    return rows


def _render(result: ScoredText, rich: bool) -> None:
    from zlm.cli.heatmap import plain_lines, print_rich

    if rich:
        print_rich(result)
    else:
        for line in plain_lines(result):
            typer.echo(line)
    print_pairs(_rows(result), rich)

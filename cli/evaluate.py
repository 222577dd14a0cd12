"""`zlm eval RUN_OR_CHECKPOINT`: parse options, call `zlm.inference.evaluate.evaluate`, render.

Prints BPC (bits per character of the original text), bits per byte where it differs,
perplexity per token and per character, token and character counts, speed, and the
protocol; `--json` prints the same as one JSON object.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from zlm.cli.render import handle_errors, print_pairs, use_rich
from zlm.errors import UsageError
from zlm.inference.adapt_config import (
    DEFAULT_CACHE_SIZE,
    DEFAULT_CACHE_THETA,
    DEFAULT_DECAY,
    DEFAULT_LR,
    DEFAULT_SEGMENT,
    CacheConfig,
    DynamicConfig,
)

if TYPE_CHECKING:
    from zlm.inference.evaluate import EvalResult


# The cache's options, shared with `zlm score`.
CacheFlag = Annotated[bool, typer.Option(
    "--cache", help="The continuous cache (Grave et al. 2017): each prediction mixed with "
    "the tokens that followed the stream's recent positions whose states match this one; "
    "no weight changes. BPC is the cached value, static BPC beside it.")]
CacheSize = Annotated[int, typer.Option(help="--cache: past positions of each stream it remembers.")]
CacheTheta = Annotated[float, typer.Option(help="--cache: sharpness of the match, exp(theta h_t . h_i).")]
CacheLambda = Annotated[float | None, typer.Option(
    help="--cache: fix the cache's share of the mixture at this value \\[default: a mixture "
         "over shares 0 to 0.9 that switches as the text does].", show_default=False)]


def cache_config(on: bool, size: int, theta: float, share: float | None) -> CacheConfig | None:
    return CacheConfig(size, theta, share) if on else None


@handle_errors
def command(
    run: Annotated[Path, typer.Argument(
        help="A RUN_DIR (its best/, else its latest complete checkpoint) or a checkpoint "
             "directory.", metavar="RUN_OR_CHECKPOINT", show_default=False)],
    split: Annotated[str | None, typer.Option(
        help="valid | test | train: a split of the DATA_DIR the model was trained on "
             "\\[default: valid].", show_default=False)] = None,
    file: Annotated[Path | None, typer.Option(
        "--file", help="Score this UTF-8 text file instead of a split.",
        show_default=False)] = None,
    batch_size: Annotated[int | None, typer.Option(
        help="Parallel streams the text is cut into (each after the first reads the "
             "--stream-context tokens before its stretch first) \\[default: 16; 1 with --dynamic or "
             "--cache: one stream adapts to, or remembers, all the text before it].",
        show_default=False)] = None,
    stream_context: Annotated[int, typer.Option(
        "--stream-context",
        help="Tokens of context each stream after the first reads before its stretch, not "
             "scored, so it does not start cold (0: every stream starts from a zero "
             "state).")] = 256,
    bptt: Annotated[int, typer.Option(
        help="Window length in tokens; the state is carried across windows.")] = 256,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda.")] = "auto",
    unknown: Annotated[str, typer.Option(
        help="--file characters outside a char vocabulary: error | replace (U+FFFD, if "
             "the vocabulary has it).")] = "error",
    dynamic: Annotated[bool, typer.Option(
        "--dynamic", help="Dynamic evaluation (Krause et al. 2018): after predicting each "
        "segment, one RMS-normalised gradient step on it, decaying toward the trained "
        "weights; the checkpoint is not modified. BPC is the dynamic value, static BPC "
        "beside it.")] = False,
    dynamic_lr: Annotated[float, typer.Option(
        help="--dynamic: step size of the RMS-normalised update.")] = DEFAULT_LR,
    dynamic_decay: Annotated[float, typer.Option(
        help="--dynamic: decay toward the trained weights per update.")] = DEFAULT_DECAY,
    segment: Annotated[int, typer.Option(
        help="--dynamic: tokens per segment (one update each; replaces --bptt).")] = DEFAULT_SEGMENT,
    cache: CacheFlag = False,
    cache_size: CacheSize = DEFAULT_CACHE_SIZE,
    cache_theta: CacheTheta = DEFAULT_CACHE_THETA,
    cache_lambda: CacheLambda = None,
    eval_tokens: Annotated[int, typer.Option(
        help="Score at most this many predictions, spread over the text: each stream its "
             "stretch's first piece, as `zlm train --eval-tokens` validates (0: all). "
             "`--split train --eval-tokens N` is the generalisation gap's train side, N "
             "50000 or half the tokens validation scores if fewer.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Bits per character of a split or a text file, state carried across the whole text."""
    from zlm.inference.evaluate import EvalConfig, evaluate

    if split is not None and file is not None:
        raise UsageError("pass --split or --file, not both")
    dyn = DynamicConfig(dynamic_lr, dynamic_decay, segment) if dynamic else None
    cached = cache_config(cache, cache_size, cache_theta, cache_lambda)
    config = EvalConfig(split=None if file is not None else (split or "valid"), file=file,
                        streams=(1 if dynamic or cache else 16) if batch_size is None else batch_size,
                        bptt=bptt, unknown=unknown, device=device, dynamic=dyn, cache=cached,
                        sample=eval_tokens, stream_context=stream_context)
    result = evaluate(run, config)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
    else:
        _render(result, use_rich())


def _rows(r: EvalResult) -> list[tuple[str, str]]:
    s = r.score
    how, what = {(True, False): ("dynamic", "dynamic evaluation"),
                 (False, True): ("with the cache", "the cache"),
                 (True, True): ("dynamic, with the cache", "dynamic evaluation with the cache"),
                 }.get((r.dynamic is not None, r.cache is not None), ("", ""))
    rows = [("BPC", f"{s.bpc:.4f} bits/character" + (f" ({how})" if how else ""))]
    if r.static is not None:
        gain = r.static.bpc - s.bpc
        rows.append(("static BPC", f"{r.static.bpc:.4f} bits/character ({what} gains {gain:+.4f})"))
    rows.append(("characters", f"{s.characters:,}"))
    if s.bytes != s.characters:
        rows.append(("bits per byte", f"{s.bits_per_byte:.4f} bits/byte over {s.bytes:,} bytes"))
    rows += [("perplexity", f"{s.perplexity:.4f} per token ({r.tokenizer} tokens)"),
             ("char perplexity", f"{s.char_perplexity:.4f} per character"),
             ("tokens", f"{s.tokens:,}"),
             ("speed", f"{r.chars_per_s:,.0f} characters/s ({r.seconds:.2f} s)"),
             ("protocol", r.protocol),
             ("source", r.source),
             ("checkpoint", r.checkpoint)]
    return rows


def _render(result: EvalResult, rich: bool) -> None:
    print_pairs(_rows(result), rich)

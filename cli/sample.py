"""`zlm sample RUN_OR_CHECKPOINT`: parse options, call `zlm.inference.sample.sample_checkpoint`, render.

One sample streams to stdout as it is generated (flushed every token). Several samples
are generated together as one batch and each is printed, under a `--- sample i/N ---`
line, when the batch is done. `--json` prints one JSON line per sample with its text and
average log-likelihood.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from zlm.cli.errors import handle_errors
from zlm.inference.sample import SampleConfig, sample_checkpoint


@handle_errors
def command(
    run: Annotated[Path, typer.Argument(
        help="A RUN_DIR (its best/, else its latest complete checkpoint) or a checkpoint "
             "directory.", metavar="RUN_OR_CHECKPOINT", show_default=False)],
    prime: Annotated[str, typer.Option(help="Text to continue (printed first).")] = "",
    length: Annotated[int, typer.Option(
        help="Tokens to generate (characters for a char model).")] = 500,
    temperature: Annotated[float, typer.Option(help="Softmax temperature; 0 = greedy.")] = 1.0,
    top_k: Annotated[int | None, typer.Option(
        help="Sample among the K most likely tokens only.", show_default=False)] = None,
    top_p: Annotated[float | None, typer.Option(
        help="Sample among the most likely tokens holding probability P (nucleus).",
        show_default=False)] = None,
    seed: Annotated[int | None, typer.Option(
        help="Random seed: the same seed gives the same text on this machine "
             "[default: random, printed to stderr].", show_default=False)] = None,
    num_samples: Annotated[int, typer.Option(
        help="Samples generated together as one batch.")] = 1,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda.")] = "auto",
    precision: Annotated[str, typer.Option(
        help="auto | fp32 | bf16: auto uses bf16 weights in the step on CPUs with native bf16.")] = "auto",
    as_json: Annotated[bool, typer.Option(
        "--json", help="One JSON line per sample: text, log-likelihood.")] = False,
) -> None:
    """Generate text, streaming it to stdout as it is produced."""
    config = SampleConfig(length=length, prime=prime, temperature=temperature, top_k=top_k,
                          top_p=top_p, seed=seed, num_samples=num_samples)
    stream = None if as_json or num_samples > 1 else _echo
    samples = sample_checkpoint(run, config, device, stream, precision)
    if as_json:  # each line carries its seed
        for i, s in enumerate(samples):
            typer.echo(json.dumps({"index": i, **s.to_dict()}))
        return
    if stream is not None:
        typer.echo("")
    else:
        for i, s in enumerate(samples):
            typer.echo(f"--- sample {i + 1}/{len(samples)} ---")
            typer.echo(s.prime + s.text)
    if seed is None:
        typer.echo(f"(seed {samples[0].seed}; pass --seed {samples[0].seed} to repeat)", err=True)


def _echo(piece: str) -> None:
    typer.echo(piece, nl=False)  # click flushes after every echo

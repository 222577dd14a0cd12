"""`zlm sample RUN_OR_CHECKPOINT`: parse options, call `zlm.inference.sample.sample_checkpoint`, render.

The prime is `--prime TEXT`, `--prime -` (standard input) or `--prime-file FILE`. One
sample streams to stdout as it is generated (flushed every token). Several samples
are generated together as one batch and each is printed, under a `--- sample i/N ---`
line, when the batch is done. `--json` prints one JSON line per sample with its text and
average log-likelihood.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from zlm.cli.render import handle_errors
from zlm.cli.textinput import read_text
from zlm.errors import UsageError


@handle_errors
def command(
    run: Annotated[Path, typer.Argument(
        help="A RUN_DIR (its best/, else its latest complete checkpoint) or a checkpoint "
             "directory.", metavar="RUN_OR_CHECKPOINT", show_default=False)],
    prime: Annotated[str, typer.Option(
        help="Text to continue (printed first); - reads it from standard input.")] = "",
    prime_file: Annotated[Path | None, typer.Option(
        "--prime-file", help="Continue the text of this UTF-8 file.", metavar="FILE",
        show_default=False)] = None,
    unknown: Annotated[str, typer.Option(
        help="Prime characters outside a char vocabulary: error | replace (U+FFFD, if the "
             "vocabulary has it).")] = "error",
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
             "\\[default: random, printed to stderr].", show_default=False)] = None,
    num_samples: Annotated[int, typer.Option(
        help="Samples generated together as one batch.")] = 1,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda.")] = "auto",
    precision: Annotated[str, typer.Option(
        help="auto | fp32 | bf16: auto uses bf16 weights in the step on CPUs with native bf16.")] = "auto",
    as_json: Annotated[bool, typer.Option(
        "--json", help="One JSON line per sample: text, log-likelihood.")] = False,
) -> None:
    """Generate text, streaming it to stdout as it is produced."""
    from zlm.inference.sample import SampleConfig, sample_checkpoint

    prime, flag = _prime(prime, prime_file)
    config = SampleConfig(length=length, prime=prime, temperature=temperature, top_k=top_k,
                          top_p=top_p, seed=seed, num_samples=num_samples, unknown=unknown,
                          prime_flag=flag)
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


def _prime(prime: str, prime_file: Path | None) -> tuple[str, str]:
    """The prime text and how it was given: --prime TEXT, --prime - (stdin), --prime-file FILE."""
    if prime_file is not None:
        if prime:
            raise UsageError("pass --prime or --prime-file, not both")
        return read_text(str(prime_file), "--prime-file"), f"--prime-file {prime_file}"
    if prime == "-":
        return read_text("-", "--prime"), "--prime - (standard input)"
    return prime, "--prime"


def _echo(piece: str) -> None:
    typer.echo(piece, nl=False)  # click flushes after every echo

"""`zlm train SOURCE`: train a zoneout LSTM with a live BPC display."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from zlm.cli.render import handle_errors
from zlm.core.rich_display import make_reporter
from zlm.inference.language_model import load
from zlm.training.config import parse_duration
from zlm.training.distributed import rank_from_env
from zlm.training.runner import TrainRequest, run_training

H_MODEL, H_TRAIN, H_RUN = "Model", "Training", "Run"


@handle_errors
def command(
    source: Annotated[str, typer.Argument(help="A prepared DATA_DIR, a text file, or a corpus name (e.g. stdlib).")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Run directory [default: runs/<source name>].", rich_help_panel=H_RUN)] = None,
    resume: Annotated[bool, typer.Option(help="Continue the run in --out from its latest complete checkpoint (starts fresh if there is none).", rich_help_panel=H_RUN)] = False,
    preset: Annotated[str | None, typer.Option(help="cpu-small or zoneout-ptb-char [default: cpu-small, adapted by the defaults rule to the corpus size and --time-budget/--epochs/--max-steps]; explicit options override it.", rich_help_panel=H_RUN)] = None,
    hidden: Annotated[int | None, typer.Option(help="Units per LSTM layer.", rich_help_panel=H_MODEL)] = None,
    layers: Annotated[int | None, typer.Option(help="Stacked zoneout LSTM layers.", rich_help_panel=H_MODEL)] = None,
    embed: Annotated[int | None, typer.Option(help="Embedding width.", rich_help_panel=H_MODEL)] = None,
    zoneout_cell: Annotated[float | None, typer.Option(help="z_c: probability a cell unit keeps its value.", rich_help_panel=H_MODEL)] = None,
    zoneout_hidden: Annotated[float | None, typer.Option(help="z_h: probability a hidden unit keeps its value.", rich_help_panel=H_MODEL)] = None,
    dropout: Annotated[float | None, typer.Option(help="Non-recurrent dropout.", rich_help_panel=H_MODEL)] = None,
    cell: Annotated[str | None, typer.Option(help="auto | fused | reference | plain (auto: plain when both zoneouts are 0).", rich_help_panel=H_MODEL)] = None,
    batch_size: Annotated[int | None, typer.Option(help="Streams per process.", rich_help_panel=H_TRAIN)] = None,
    bptt: Annotated[int | None, typer.Option(help="Truncated backprop window (tokens).", rich_help_panel=H_TRAIN)] = None,
    lr: Annotated[float | None, typer.Option(help="Learning rate.", rich_help_panel=H_TRAIN)] = None,
    optimizer: Annotated[str | None, typer.Option(help="adam | adamw | sgd.", rich_help_panel=H_TRAIN)] = None,
    weight_decay: Annotated[float | None, typer.Option(help="Weight decay.", rich_help_panel=H_TRAIN)] = None,
    clip: Annotated[float | None, typer.Option(help="Max gradient norm (0 = off).", rich_help_panel=H_TRAIN)] = None,
    schedule: Annotated[str | None, typer.Option(help="constant | cosine | plateau.", rich_help_panel=H_TRAIN)] = None,
    warmup: Annotated[int | None, typer.Option(help="Linear warmup steps.", rich_help_panel=H_TRAIN)] = None,
    epochs: Annotated[float | None, typer.Option(help="Passes over the training split.", rich_help_panel=H_TRAIN)] = None,
    max_steps: Annotated[int | None, typer.Option(help="Optimizer steps.", rich_help_panel=H_TRAIN)] = None,
    time_budget: Annotated[str | None, typer.Option(help="Stop after this much training time, e.g. 10m.", rich_help_panel=H_TRAIN)] = None,
    eval_every: Annotated[int | None, typer.Option(help="Validate and checkpoint every N steps.", rich_help_panel=H_TRAIN)] = None,
    state: Annotated[str | None, typer.Option(help="carry (TBPTT streams) | reset (paper's shuffled chunks).", rich_help_panel=H_TRAIN)] = None,
    reset_prob: Annotated[float | None, typer.Option(help="carry: chance that a stream's state is zeroed before a window (teaches starting mid-text).", rich_help_panel=H_TRAIN)] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed.", rich_help_panel=H_TRAIN)] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda.", rich_help_panel=H_RUN)] = None,
    precision: Annotated[str | None, typer.Option(help="auto | fp32 | bf16 | fp16.", rich_help_panel=H_RUN)] = None,
    cuda_graphs: Annotated[str | None, typer.Option(help="auto | on | off: replay each training window from a CUDA graph (auto: on with the CUDA fused cell in one process).", rich_help_panel=H_RUN)] = None,
    keep_last: Annotated[int | None, typer.Option(help="Step checkpoints to keep (plus best/).", rich_help_panel=H_RUN)] = None,
    log_every: Annotated[int | None, typer.Option(help="Steps between log lines.", rich_help_panel=H_RUN)] = None,
    nproc: Annotated[int | None, typer.Option(help="Launch N local processes (DistributedDataParallel).", rich_help_panel=H_RUN)] = None,
    zero: Annotated[bool, typer.Option(help="Shard optimizer state across processes (ZeRO stage 1).", rich_help_panel=H_RUN)] = False,
    sample: Annotated[int, typer.Option(help="Print a sample of N characters from the best model at the end.", rich_help_panel=H_RUN)] = 0,
    mirror: Annotated[Path | None, typer.Option(help="Local copy of named corpora.", rich_help_panel=H_RUN)] = None,
    unknown: Annotated[str | None, typer.Option(help="A raw SOURCE's characters missing from its train split: include (vocabulary from the whole text; default for files) | replace (U+FFFD) | error.", rich_help_panel=H_RUN)] = None,
) -> None:
    """Train a zoneout LSTM language model on SOURCE; live BPC; safetensors checkpoints."""
    options = dict(locals())  # the signature is the interface: every config option, None = not given
    for name in _NOT_CONFIG:
        options.pop(name)
    options["zero"] = zero or None
    if time_budget is not None:
        options["time_budget"] = parse_duration(time_budget)
    rep = make_reporter()
    req = TrainRequest(source=source, out=out, resume=resume, preset=preset, options=options,
                       nproc=nproc, mirror=mirror, unknown=unknown)
    outcome = run_training(req, rep)
    if outcome.interrupted:
        step = outcome.summary.get("step")
        where = f" at step {step}" if step is not None else ""
        again = f"zlm train {source} --out {outcome.run_dir}" + (f" --nproc {nproc}" if nproc else "") + " --resume"
        rep.message(f"interrupted{where}: checkpoint saved; continue with {again}")
        raise typer.Exit(128 + int(getattr(signal, outcome.interrupted)))
    if sample > 0 and rank_from_env() == 0:
        rep.message("sample:\n" + load(outcome.run_dir).sample(length=sample, temperature=0.8, seed=0))


_NOT_CONFIG = ("source", "out", "resume", "preset", "nproc", "sample", "mirror", "unknown")

"""`zlm train SOURCE`: train a zoneout LSTM with a live BPC display.

The signature is the interface: each option becomes the field of the same name in
`zlm.core.config.Options` (None = not given), and `zlm.training.plan.plan` turns the
source and those options into the run. Each option's help says its default: the
default preset's value, and what the defaults rule chooses instead when the run has a
length (--time-budget, --epochs or --max-steps) and no --preset.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from zlm.cli.render import handle_errors
from zlm.core.config import Options, parse_duration
from zlm.training.defaults import (
    AVERAGE_SHARE,
    EVAL_TOKEN_SHARE,
    EVALS_PER_RUN,
    MIN_EVAL_TOKENS,
    ON_OVERFIT,
    PASSES_PER_EVAL,
    REGIMES,
    RULED,
    ZONEOUT_CELL,
    ZONEOUT_FROM,
    ZONEOUT_FULL,
    ZONEOUT_HIDDEN,
)
from zlm.training.presets import get_preset

H_MODEL, H_TRAIN, H_RUN = "Model", "Training", "Run"
_PRESET = get_preset(None)
_REG, _RICH = REGIMES["regularised"], REGIMES["data-rich"]


def _default(name: str) -> str:
    """What an option not given becomes: the preset's value, and the rule's choice."""
    if name == "schedule":
        value = _PRESET.train.schedule.kind
    elif name == "warmup":
        value = _PRESET.train.schedule.warmup
    else:
        value = getattr(_PRESET.model, name, None)
        value = getattr(_PRESET.train, name) if value is None else value
    shown = _fmt(value)
    if name not in RULED:
        return shown
    if name == "hidden":
        rule = "the largest that trains on 10+ tokens per parameter, by corpus size and measured speed"
    elif name == "eval_every":
        every = "per pass" if PASSES_PER_EVAL == 1 else f"every {PASSES_PER_EVAL:g} passes"
        rule = f"about {EVALS_PER_RUN} validations per run, at least one {every} over the train split"
    elif name == "eval_tokens":
        rule = (f"all of it, unless the validations would score more than {EVAL_TOKEN_SHARE:.2g} of the tokens "
                f"the run trains on: then that share, {MIN_EVAL_TOKENS:,} tokens at least")
    elif name in ("zoneout_cell", "zoneout_hidden"):
        full = ZONEOUT_CELL if name == "zoneout_cell" else ZONEOUT_HIDDEN
        rule = (f"0 up to {ZONEOUT_FROM:g} expected passes, rising with log passes to {full:g} "
                f"at {ZONEOUT_FULL:g} and more")
    elif name == "average":
        rule = f"{AVERAGE_SHARE:g}"
    elif name == "on_overfit":
        rule = ON_OVERFIT
    else:
        reg, rich = getattr(_REG, name), getattr(_RICH, name)
        rule = _fmt(reg) if reg == rich else f"{_fmt(reg)} when regularising, {_fmt(rich)} when data-rich"
    return f"{shown}; with a run length and no --preset, the defaults rule: {rule}"


def _fmt(value) -> str:
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _opt(help: str, panel: str, name: str | None = None, default: str | None = None):
    return typer.Option(help=help, rich_help_panel=panel,
                        show_default=default if default is not None else _default(name))


@handle_errors
def command(
    source: Annotated[str, typer.Argument(help="A prepared DATA_DIR, a text file, or a corpus name (e.g. stdlib).")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Run directory.", rich_help_panel=H_RUN,
                                             show_default="runs/<source name>, -2, -3... if taken")] = None,
    resume: Annotated[bool, typer.Option(help="Continue the run in --out from its latest complete checkpoint "
                                         "(starts fresh if there is none); options given replace its training settings.",
                                         rich_help_panel=H_RUN)] = False,
    preset: Annotated[str | None, _opt("cpu-small or zoneout-ptb-char; explicit options override it.", H_RUN,
                                       default="cpu-small, adapted by the defaults rule")] = None,
    hidden: Annotated[int | None, _opt("Units per LSTM layer.", H_MODEL, "hidden")] = None,
    layers: Annotated[int | None, _opt("Stacked zoneout LSTM layers.", H_MODEL, "layers")] = None,
    embed: Annotated[int | None, _opt("Embedding width.", H_MODEL, "embed")] = None,
    zoneout_cell: Annotated[float | None, _opt("z_c: probability a cell unit keeps its value.", H_MODEL,
                                               "zoneout_cell")] = None,
    zoneout_hidden: Annotated[float | None, _opt("z_h: probability a hidden unit keeps its value.", H_MODEL,
                                                 "zoneout_hidden")] = None,
    dropout: Annotated[float | None, _opt("Non-recurrent dropout.", H_MODEL, "dropout")] = None,
    cell: Annotated[str | None, _opt("auto | fused | reference | plain.", H_MODEL,
                                     default="auto: plain, torch's LSTM kernel, when both zoneouts are 0, "
                                             "else fused")] = None,
    batch_size: Annotated[int | None, _opt("Streams per process.", H_TRAIN, "batch_size")] = None,
    bptt: Annotated[int | None, _opt("Truncated backprop window (tokens).", H_TRAIN, "bptt")] = None,
    lr: Annotated[float | None, _opt("Learning rate.", H_TRAIN, "lr")] = None,
    optimizer: Annotated[str | None, _opt("adam | adamw | sgd.", H_TRAIN, "optimizer")] = None,
    weight_decay: Annotated[float | None, _opt("Weight decay.", H_TRAIN, "weight_decay")] = None,
    clip: Annotated[float | None, _opt("Max gradient norm (0 = off).", H_TRAIN, "clip")] = None,
    schedule: Annotated[str | None, _opt("constant | cosine | plateau.", H_TRAIN, "schedule")] = None,
    warmup: Annotated[int | None, _opt("Linear warmup steps.", H_TRAIN, "warmup")] = None,
    epochs: Annotated[float | None, _opt("Passes over the training split.", H_TRAIN,
                                         default="none: no limit")] = None,
    max_steps: Annotated[int | None, _opt("Optimizer steps.", H_TRAIN, default="none: no limit")] = None,
    time_budget: Annotated[str | None, _opt("Stop after this much training time, e.g. 10m.", H_TRAIN,
                                            default="none: with no limit at all the run trains until interrupted")] = None,
    eval_every: Annotated[int | None, _opt("Validate and checkpoint every N steps.", H_TRAIN, "eval_every")] = None,
    eval_tokens: Annotated[int | None, _opt("Validate on N tokens of the valid split (0: all).", H_TRAIN, "eval_tokens")] = None,
    state: Annotated[str | None, _opt("carry (TBPTT streams) | reset (paper's shuffled chunks).", H_TRAIN,
                                      "state")] = None,
    reset_prob: Annotated[float | None, _opt("carry: chance that a stream's state is zeroed before a window "
                                             "(teaches starting mid-text).", H_TRAIN, "reset_prob")] = None,
    average: Annotated[float | None, _opt("Average the weights over this last share of the run; validation "
                                          "scores the average and best/ keeps it (0 = off; needs a run length).",
                                          H_TRAIN, "average")] = None,
    on_overfit: Annotated[str | None, _opt("continue | cool-down: once valid BPC rises twice in a row, or stays 1% over "
                                           "its best twice (not climbing back), while train BPC falls: back to best/, "
                                           "lr cooled to 0 over half --eval-every, stop.", H_TRAIN, "on_overfit")] = None,
    seed: Annotated[int | None, _opt("Random seed.", H_TRAIN, "seed")] = None,
    device: Annotated[str | None, _opt("auto | cpu | cuda.", H_RUN, default="auto: cuda when available")] = None,
    precision: Annotated[str | None, _opt("auto | fp32 | bf16 | fp16.", H_RUN,
                                          default="auto: bf16 on CUDA and on CPUs with native bf16, else fp32; "
                                                  "fp16 on CUDA without bf16")] = None,
    cuda_graphs: Annotated[str | None, _opt("auto | on | off: replay each training window from a CUDA graph.", H_RUN,
                                            default="auto: on with the CUDA fused cell in one process")] = None,
    keep_last: Annotated[int | None, _opt("Step checkpoints to keep (plus best/).", H_RUN, "keep_last")] = None,
    log_every: Annotated[int | None, _opt("Steps between log lines.", H_RUN, "log_every")] = None,
    nproc: Annotated[int | None, _opt("Launch N local processes (DistributedDataParallel).", H_RUN,
                                      default="1, or torchrun's WORLD_SIZE")] = None,
    zero: Annotated[bool, typer.Option(help="Shard optimizer state across processes (ZeRO stage 1).",
                                       rich_help_panel=H_RUN)] = False,
    sample: Annotated[int, typer.Option(help="Print a sample of N characters from the best model at the end.",
                                        rich_help_panel=H_RUN)] = 0,
    mirror: Annotated[Path | None, _opt("Local copy of named corpora.", H_RUN,
                                        default="$ZLM_CORPORA, else the cache")] = None,
    init_from: Annotated[Path | None, _opt("Start from a trained model (RUN_DIR or checkpoint): its weights, "
                                           "shape and tokenizer; optimizer and schedule start fresh.", H_RUN,
                                           default="none: random weights")] = None,
    unknown: Annotated[str | None, _opt("A raw SOURCE's characters missing from its train split: include "
                                        "(vocabulary from the whole text) | replace (U+FFFD) | error.", H_RUN,
                                        default="include for files; a named corpus's own convention")] = None,
) -> None:
    """Train a zoneout LSTM language model on SOURCE; live BPC; safetensors checkpoints."""
    options = Options(
        hidden=hidden, layers=layers, embed=embed, zoneout_cell=zoneout_cell, zoneout_hidden=zoneout_hidden,
        dropout=dropout, cell=cell, batch_size=batch_size, bptt=bptt, lr=lr, optimizer=optimizer,
        weight_decay=weight_decay, clip=clip, schedule=schedule, warmup=warmup, epochs=epochs,
        max_steps=max_steps, time_budget=parse_duration(time_budget) if time_budget is not None else None,
        eval_every=eval_every, eval_tokens=eval_tokens, state=state, reset_prob=reset_prob, average=average,
        on_overfit=on_overfit, seed=seed, device=device, precision=precision, cuda_graphs=cuda_graphs,
        keep_last=keep_last, log_every=log_every, zero=zero or None)
    _train(source, options, out=out, preset=preset, resume=resume, mirror=mirror, unknown=unknown,
           nproc=nproc, sample=sample, init_from=init_from)


def _train(source: str, options, *, out, preset, resume, mirror, unknown, nproc, sample, init_from) -> None:
    """Plan, run, and turn the outcome into an exit code, a resume hint and the sample."""
    from zlm.core.rich_display import make_reporter
    from zlm.training.plan import plan
    from zlm.training.runner import check_nproc, run

    check_nproc(nproc)
    rep = make_reporter()
    planned = plan(source, options, out=out, preset=preset, resume=resume, mirror=mirror, unknown=unknown,
                   world=nproc, init_from=init_from, reporter=rep)
    again = f"zlm train {source} --out {planned.run_dir}" + (f" --nproc {nproc}" if nproc else "") + " --resume"
    outcome = run(planned, rep, nproc, again)
    if outcome.interrupted:
        step = outcome.summary.get("step")
        where = f" at step {step}" if step is not None else ""
        rep.message(f"interrupted{where}: checkpoint saved; continue with {again}")
        raise typer.Exit(128 + int(getattr(signal, outcome.interrupted)))
    if sample > 0:
        from zlm.inference.language_model import load
        from zlm.training.distributed import rank_from_env

        if rank_from_env() == 0:
            rep.message("sample:\n" + load(outcome.run_dir).sample(length=sample, temperature=0.8, seed=0))

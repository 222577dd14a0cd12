"""`zlm train` end to end: plan the run once, then train in this process or in N local ones.

`plan_run` decides the run directory and refuses one that is taken, prepares a raw source
on the fly into RUN_DIR/data, and resolves the preset and the user's options into typed
configs: every mistake is reported once, before any training process starts.
`run_training` then trains here (or as one rank under torchrun) or launches `--nproc`
workers, and returns the `Outcome`; the CLI turns it into an exit code and a hint.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from zlm.core.reporter import Reporter
from zlm.data import catalog
from zlm.data.dataset import Dataset
from zlm.data.prepare import PrepareConfig, prepare
from zlm.errors import UsageError
from zlm.model.lm import ModelConfig
from zlm.training import defaults, distributed
from zlm.training.config import TrainConfig, configure
from zlm.training.defaults import DefaultsRule
from zlm.training.launch import Interrupted, WorkersFailed, run_local
from zlm.training.presets import get_preset
from zlm.training.run_dir import RunDir, default_run_dir
from zlm.training.trainer import Trainer


@dataclass(frozen=True)
class TrainRequest:
    """What the user asked `zlm train` for, before resolution."""

    source: str  # a DATA_DIR, a text file or a corpus name
    out: Path | None = None  # RUN_DIR (default: runs/<source name>)
    resume: bool = False
    preset: str | None = None  # None: the default preset, said at start
    options: dict = field(default_factory=dict)  # {config field: value}; None = not given
    nproc: int | None = None  # launch this many local processes
    mirror: Path | None = None  # local copy of named corpora
    unknown: str | None = None  # raw sources: zlm prepare's --unknown (default: include)


@dataclass(frozen=True)
class Plan:
    """A resolved request: where, on what, with which configs."""

    run_dir: Path
    data_path: Path
    model: ModelConfig
    train: TrainConfig
    resume: bool
    rule: DefaultsRule | None = None  # what the defaults rule chose (no --preset)


@dataclass(frozen=True)
class Outcome:
    """How training ended: the trainer's summary, or the signal that interrupted it."""

    run_dir: Path
    summary: dict
    interrupted: str | None = None  # SIGINT / SIGTERM name


def plan_run(req: TrainRequest, rep: Reporter) -> Plan:
    """Check, prepare and resolve once (rank 0); other ranks wait for rank 0's data."""
    resume = req.resume or distributed.restart_count() > 0  # a relaunched worker resumes
    # Under torchrun every rank must agree on the run directory: never pick a -2 suffix there.
    run_dir = req.out or default_run_dir(req.source, resume or distributed.world_from_env() > 1)
    if distributed.rank_from_env() == 0:
        RunDir(run_dir).check(resume)
        data = open_or_prepare(req.source, run_dir, req.mirror, rep, req.unknown)
    else:  # prepared data is read-only once rank 0 has written it
        data = _wait_for_data(req.source, run_dir)
    preset = get_preset(req.preset)
    rule = None
    if req.preset is None and distributed.rank_from_env() == 0:  # other ranks take rank 0's (Trainer)
        world = req.nproc or distributed.world_from_env()
        rule = defaults.for_run(preset, data, req.options, run_dir=run_dir, resume=resume, world=world,
                                on_event=rep.message)
        rep.message(f"no --preset given: {preset.name} with the defaults rule"
                    + (f": {rule.line}" if rule is not None else " (not applied: this run started without it)")
                    + "; explicit options override it")
    model, train = configure(preset.model, preset.train, data.vocab_size, defaults.merge(rule, req.options))
    return Plan(run_dir, data.path, model, train, resume, rule)


def run_training(req: TrainRequest, reporter: Reporter | None = None) -> Outcome:
    """Plan, then train here or in `--nproc` local processes."""
    if req.nproc is not None and req.nproc > 1:
        if "WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
            raise UsageError("--nproc starts its own processes; under torchrun leave --nproc out")
        rep = reporter or Reporter()
        plan = plan_run(req, rep)
        _check_devices(plan.train.device, req.nproc)
        return _launch(plan, req, rep)
    rep = reporter if distributed.rank_from_env() == 0 and reporter is not None else Reporter()
    plan = plan_run(req, rep)
    return _train(plan, rep)


def _train(plan: Plan, rep: Reporter) -> Outcome:
    data = Dataset.open(plan.data_path)
    summary = Trainer(plan.run_dir, data, plan.model, plan.train, resume=plan.resume, reporter=rep,
                      rule=plan.rule).fit()
    return Outcome(plan.run_dir, summary, summary.get("interrupted"))


def _train_worker(plan: Plan, print_progress: bool) -> None:
    """One rank of `zlm train --nproc`: the planned run, under the launcher's environment."""
    from zlm.core.rich_display import make_reporter

    rep = make_reporter() if print_progress and distributed.rank_from_env() == 0 else Reporter()
    _train(plan, rep)


def _launch(plan: Plan, req: TrainRequest, rep: Reporter) -> Outcome:
    rep.message(f"launching {req.nproc} processes (torch elastic agent, standalone rendezvous)")
    again = f"zlm train {req.source} --out {plan.run_dir} --nproc {req.nproc} --resume"
    try:
        run_local(_train_worker, (plan, type(rep) is not Reporter), req.nproc)
    except Interrupted as e:
        return Outcome(plan.run_dir, {}, e.signal.name)
    except WorkersFailed as e:
        raise WorkersFailed(f"{e}; continue from the last complete checkpoint with {again}", e.exit_code) from None
    return Outcome(plan.run_dir, {})


def open_or_prepare(source: str, run_dir: Path, mirror: Path | None, rep: Reporter,
                    unknown: str | None = None) -> Dataset:
    """A prepared DATA_DIR as it is; anything else is prepared into RUN_DIR/data (char).

    A text file's vocabulary is every character of the whole file (`--unknown include`,
    as char-rnn and nanoGPT build it), so any UTF-8 text trains without flags; a named
    corpus keeps its own convention. `unknown` overrides both.
    """
    src = Path(source)
    if src.is_dir() and (src / "dataset.json").exists():
        return Dataset.open(src)
    if not src.exists() and source not in catalog.names():
        raise UsageError(f"{source}: no such file, directory or corpus name; pass a text file, a "
                         f"DATA_DIR from zlm prepare, or one of {', '.join(catalog.names())}")
    data_dir = run_dir / "data"
    if (data_dir / "dataset.json").exists():
        rep.message(f"using the data already prepared in {data_dir}")
        return Dataset.open(data_dir)
    if unknown is None and source not in catalog.names():
        unknown = "include"
    vocab = {"include": ", vocabulary from the whole text", "replace": ", unseen characters -> U+FFFD"}
    rep.message(f"preparing {source} into {data_dir} (char tokenizer, 90/5/5 split{vocab.get(unknown, '')})")
    return prepare(source, data_dir, PrepareConfig(mirror=mirror, unknown=unknown))


def _wait_for_data(source: str, run_dir: Path, timeout: float = 3600.0) -> Dataset:
    src = Path(source)
    path = src if (src / "dataset.json").exists() else run_dir / "data"
    deadline = time.time() + timeout
    while not (path / "dataset.json").exists():
        if time.time() > deadline:
            raise UsageError(f"rank 0 did not prepare {path} within {timeout:.0f}s")
        time.sleep(0.5)
    return Dataset.open(path)


def _check_devices(device: str, nproc: int) -> None:
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return
    n = torch.cuda.device_count()
    if nproc > n:
        raise UsageError(f"--nproc {nproc} but this machine has {n} CUDA device(s), one per process; "
                         f"pass --nproc {n} or --device cpu")

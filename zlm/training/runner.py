"""`run(plan)`: train a planned run in this process (or as one rank under torchrun), or
launch `--nproc` local processes that each train it.

Returns the `Outcome`; the CLI turns it into an exit code and a hint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from zlm.core.config import Options
from zlm.core.reporter import Reporter
from zlm.errors import UsageError
from zlm.training import distributed
from zlm.training.launch import Interrupted, WorkersFailed, run_local
from zlm.training.plan import Plan, plan
from zlm.training.trainer import Trainer


@dataclass(frozen=True)
class Outcome:
    """How training ended: the trainer's summary, or the signal that interrupted it."""

    run_dir: Path
    summary: dict
    interrupted: str | None = None  # SIGINT / SIGTERM name


def train(source: str | Path, *, out: str | Path | None = None, preset: str | None = None,
          resume: bool = False, nproc: int | None = None, reporter: Reporter | None = None,
          **options) -> Outcome:
    """The Python API, `zlm.train("corpus.txt", time_budget=600, out="runs/x")`: what `zlm
    train` does - `plan` then `run`. options: `zlm.core.config.Options` fields (time_budget
    in seconds); an unknown one is a one-line UsageError."""
    planned = plan(source, Options.from_dict(options), out=None if out is None else Path(out), preset=preset,
                   resume=resume, world=nproc, reporter=reporter)
    return run(planned, reporter, nproc, f"zlm.train({str(source)!r}, out={str(planned.run_dir)!r}, resume=True)")


def check_nproc(nproc: int | None) -> None:
    """--nproc starts its own processes: refused under torchrun (before any planning)."""
    if nproc is not None and nproc > 1 and "WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        raise UsageError("--nproc starts its own processes; under torchrun leave --nproc out")


def run(plan: Plan, reporter: Reporter | None = None, nproc: int | None = None, again: str = "") -> Outcome:
    """Train `plan` here, or in `nproc` local processes. again: the command that resumes
    the run, for the message when workers fail."""
    rep = reporter if reporter is not None and distributed.rank_from_env() == 0 else Reporter()
    if nproc is not None and nproc > 1:
        _check_devices(plan.spec.train.device, nproc)
        return _launch(plan, nproc, rep, again)
    summary = Trainer(plan, reporter=rep).fit()
    return Outcome(plan.run_dir, summary, summary.get("interrupted"))


def _train_worker(plan: Plan, print_progress: bool) -> None:
    """One rank of `zlm train --nproc`: the planned run, under the launcher's environment."""
    from zlm.core.rich_display import make_reporter

    rep = make_reporter() if print_progress and distributed.rank_from_env() == 0 else Reporter()
    Trainer(plan, reporter=rep).fit()


def _launch(plan: Plan, nproc: int, rep: Reporter, again: str) -> Outcome:
    rep.message(f"launching {nproc} processes (torch elastic agent, standalone rendezvous)")
    try:
        run_local(_train_worker, (plan, type(rep) is not Reporter), nproc)
    except Interrupted as e:
        return Outcome(plan.run_dir, {}, e.signal.name)
    except WorkersFailed as e:
        raise WorkersFailed(f"{e}; continue from the last complete checkpoint with {again}", e.exit_code) from None
    return Outcome(plan.run_dir, {})


def _check_devices(device: str, nproc: int) -> None:
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return
    n = torch.cuda.device_count()
    if nproc > n:
        raise UsageError(f"--nproc {nproc} but this machine has {n} CUDA device(s), one per process; "
                         f"pass --nproc {n} or --device cpu")

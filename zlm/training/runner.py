"""`zlm train` end to end: find or prepare the data, resolve the config, train, report.

This is the one library function the `train` command calls. It decides the run
directory, prepares a raw source on the fly into RUN_DIR/data, picks the display,
launches local processes for --nproc, and prints a sample at the end if asked.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

from zlm.core.report import Reporter
from zlm.data.dataset import Dataset
from zlm.errors import UsageError


@dataclass(frozen=True)
class TrainRequest:
    """What the user asked `zlm train` for, before resolution."""

    source: str
    out: Path | None = None
    resume: bool = False
    preset: str | None = None
    overrides: dict = field(default_factory=dict)
    time_budget: str | None = None
    nproc: int | None = None
    sample_chars: int = 0
    mirror: Path | None = None


def default_run_dir(source: str, resume: bool) -> Path:
    """runs/<name>; without --resume a taken name gets a -2, -3, ... suffix."""
    name = re.sub(r"[^\w.-]+", "-", Path(source.rstrip("/")).name.split(".")[0]) or "run"
    base = Path("runs") / name
    if resume or not base.exists() or not any(base.iterdir()):
        return base
    k = 2
    while (Path("runs") / f"{name}-{k}").exists():
        k += 1
    return Path("runs") / f"{name}-{k}"


def open_or_prepare(source: str, run_dir: Path, mirror: Path | None, rep: Reporter) -> Dataset:
    """A prepared DATA_DIR as it is; anything else is prepared into RUN_DIR/data (char)."""
    src = Path(source)
    if src.is_dir() and (src / "dataset.json").exists():
        return Dataset.open(src)
    from zlm.data import catalog

    if not src.exists() and source not in catalog.names():
        raise UsageError(f"{source}: no such file, directory or corpus name; pass a text file, a "
                         f"DATA_DIR from zlm prepare, or one of {', '.join(catalog.names())}")
    data_dir = run_dir / "data"
    if (data_dir / "dataset.json").exists():
        rep.message(f"using the data already prepared in {data_dir}")
        return Dataset.open(data_dir)
    from zlm.data.prepare import PrepareConfig, prepare

    rep.message(f"preparing {source} into {data_dir} (char tokenizer, 90/5/5 split)")
    return prepare(source, data_dir, PrepareConfig(mirror=mirror))


def run_training(req: TrainRequest, reporter: Reporter | None = None) -> int:
    """Train as requested. Returns the process exit code (0, or 130/143 if interrupted)."""
    from zlm.core.progress import make_reporter
    from zlm.training.config import parse_duration, resolve
    from zlm.training.trainer import check_run_dir, train

    if req.nproc is not None and req.nproc > 1:
        from zlm.training.launch import launch_local

        return launch_local(req)
    import os

    from zlm.training.distributed import restart_count

    is_main = int(os.environ.get("RANK", "0")) == 0
    rep = reporter or (make_reporter() if is_main else Reporter())  # only rank 0 prints
    resume = req.resume or restart_count() > 0  # a worker relaunched by torchrun resumes
    # Under torchrun every rank must agree on the run directory: never pick a -2 suffix there.
    run_dir = req.out or default_run_dir(req.source, resume or int(os.environ.get("WORLD_SIZE", "1")) > 1)
    if is_main:
        check_run_dir(run_dir, resume)
    overrides = dict(req.overrides)
    if req.time_budget is not None:
        overrides["time_budget"] = parse_duration(req.time_budget)
    data = open_or_prepare(req.source, run_dir, req.mirror, rep) if is_main else None
    if not is_main:  # other ranks wait for rank 0 to prepare; prepared data is then read-only
        data = _wait_for_data(req.source, run_dir)
    model_cfg, train_cfg, preset = resolve(data.vocab_size, req.preset, overrides)
    if req.preset is None:
        rep.message(f"no --preset given: using {preset} (explicit options override it)")
    summary = train(run_dir, data, model_cfg, train_cfg, resume=resume, reporter=rep)
    if summary.get("interrupted"):
        rep.message(f"interrupted at step {summary['step']}: checkpoint saved; continue with "
                    f"zlm train {req.source} --out {run_dir} --resume")
        return 128 + int(getattr(signal, summary["interrupted"]))
    if req.sample_chars > 0 and is_main:
        from zlm.inference.sample import SampleConfig, load_model, sample_text

        lm = load_model(run_dir)
        text = sample_text(lm, SampleConfig(length=req.sample_chars, temperature=0.8, seed=0))
        rep.message("sample:\n" + text)
    return 0


def _wait_for_data(source: str, run_dir: Path, timeout: float = 3600.0) -> Dataset:
    import time

    src = Path(source)
    path = src if (src / "dataset.json").exists() else run_dir / "data"
    deadline = time.time() + timeout
    while not (path / "dataset.json").exists():
        if time.time() > deadline:
            raise UsageError(f"rank 0 did not prepare {path} within {timeout:.0f}s")
        time.sleep(0.5)
    return Dataset.open(path)

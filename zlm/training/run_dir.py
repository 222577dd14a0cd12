"""The run directory: its name, the refusal to overwrite it, config.json, metrics.jsonl, best/.

    RUN_DIR/config.json        the run's spec (zlm.core.spec.RunSpec)
    RUN_DIR/metrics.jsonl      one JSON object per logged event (zlm.core.metrics.MetricsLog)
    RUN_DIR/checkpoints/       training checkpoints (zlm.training.state.Checkpointer)
    RUN_DIR/best/              the weights with the best valid BPC, loadable on their own
    RUN_DIR/data/              a raw source prepared on the fly (zlm.training.plan)
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from zlm.core import checkpoint as ckpt
from zlm.core.metrics import MetricsLog
from zlm.data.dataset import Dataset
from zlm.errors import UsageError, ZlmError


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


class RunDir:
    """One RUN_DIR; the files the trainer writes there besides its checkpoints."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def check(self, resume: bool) -> None:
        """Without --resume, an existing non-empty RUN_DIR is refused (data/ alone is reused)."""
        if not resume and self.path.exists() and any(p.name != "data" for p in self.path.iterdir()):
            raise UsageError(
                f"{self.path} already exists and is not empty; pass --resume to continue it, "
                f"or --out to choose another run directory"
            )

    def open(self, config: dict) -> MetricsLog:
        """Create RUN_DIR, write config.json, open metrics.jsonl; one-line error if it cannot."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            ckpt.write_json(self.path / "config.json", config)
            return MetricsLog(self.path / "metrics.jsonl")
        except OSError as e:
            raise ZlmError(f"cannot write to the run directory {self.path} ({e.strerror or e}); "
                           f"make it writable or pass another --out") from None

    def write_best(self, model, config: dict, data: Dataset, step: int, bpc: float,
                   train_slice_bpc: float | None = None) -> None:
        """best/: the weights with the best valid BPC so far, swapped in atomically (with the
        train slice's BPC at that validation: `zlm info RUN` shows the gap of the model it names)."""
        final = self.path / "best"
        tmp = None
        try:
            tmp = ckpt.temp_directory(final)
            ckpt.write_tensors(tmp / "model.safetensors", model.state_dict())
            ckpt.write_json(tmp / "config.json", config)
            trainer = {"step": step, "valid_bpc": bpc, "best_bpc": bpc}
            if train_slice_bpc is not None:
                trainer["train_slice_bpc"] = train_slice_bpc
            ckpt.write_json(tmp / "trainer.json", trainer)
            data.copy_description(tmp)
            ckpt.finish_directory(tmp, final, step)
        except OSError as e:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise ZlmError(f"could not write {final} ({e.strerror or e}); free disk space or make the run "
                           f"directory writable, then resume with --resume; the previous best/ is untouched") from None

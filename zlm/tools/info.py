"""What a run or checkpoint holds, read from JSON and safetensors headers only.

Owns `describe(path)`, the library function behind `zlm info`: model config, parameter
count (from the tensor shapes in the header of model.safetensors), tokenizer and
vocabulary, training step, best valid BPC, and the files with their sizes. It never
reads tensor data, so it is instant on a multi-gigabyte checkpoint and works while a
checkpoint is being copied. The manifest is checked shallowly (format version, files
present with the recorded sizes); checksums are left to `zlm eval` / `zlm sample`,
which load the tensors.

Nothing here imports torch (nor does anything it imports), so `zlm info` answers at once.
"""

from __future__ import annotations

import math
from pathlib import Path

from zlm.core import checkpoint as ckpt
from zlm.core.checkpoint import read_json
from zlm.core.metrics import read_metrics
from zlm.core.spec import read_spec
from zlm.errors import CheckpointError


def find_checkpoint(path: Path) -> Path:
    """A checkpoint directory for `path`: itself, RUN_DIR/best, or the newest step directory
    whose manifest and file sizes check out (no checksums: nothing is read in full)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a RUN_DIR or a checkpoint directory")
    if path.is_file():
        path = path.parent
    if (path / ckpt.MANIFEST).exists():
        return path
    if (path / "best" / ckpt.MANIFEST).exists():
        return path / "best"
    for step in reversed(ckpt.step_dirs(path)):
        try:
            ckpt.verify(step, deep=False)
            return step
        except CheckpointError:
            continue
    raise CheckpointError(f"{path} holds no complete checkpoint; pass a RUN_DIR or a checkpoint directory")


def _mismatches(expected: dict, found: dict) -> list[str]:
    out = [f"{k} missing" for k in sorted(set(expected) - set(found))]
    out += [f"{k} unexpected" for k in sorted(set(found) - set(expected))]
    out += [f"{k} is {found[k]} but the config implies {expected[k]}"
            for k in sorted(set(expected) & set(found)) if tuple(found[k]) != expected[k]]
    return out


def describe(path) -> dict:
    """Everything `zlm info` shows, as a JSON-able dict. Reads no tensor data."""
    path = Path(path)
    where = find_checkpoint(path)
    manifest = ckpt.verify(where, deep=False)
    spec = read_spec(where)
    header = ckpt.read_header(where / "model.safetensors")
    shapes = {k: tuple(v.get("shape", ())) for k, v in header.items()
              if k != "__metadata__" and isinstance(v, dict)}
    dtypes = sorted({v.get("dtype", "?") for k, v in header.items()
                     if k != "__metadata__" and isinstance(v, dict)})
    trainer = read_json(where / "trainer.json", "trainer state") if (where / "trainer.json").exists() else {}
    dataset = read_json(where / "dataset.json", "dataset description") if (where / "dataset.json").exists() else {}
    tok = dataset.get("tokenizer") or spec.data.tokenizer or {}
    files = [{"name": p.name, "bytes": p.stat().st_size} for p in sorted(where.iterdir()) if p.is_file()]
    info = {
        "path": str(path),
        "checkpoint": str(where),
        "format_version": manifest.get("version"),
        "zlm_version": manifest.get("zlm_version") or spec.zlm_version,
        "step": trainer.get("step", manifest.get("step")),
        "epoch": trainer.get("epoch"),
        "valid_bpc": trainer.get("valid_bpc"),
        "best_valid_bpc": _finite(trainer.get("best_bpc")),
        "train_slice_bpc": trainer.get("train_slice_bpc"),
        "cool_down": (trainer.get("overfit") or {}).get("cool_down"),  # the overfitting guard's reaction
        "model": spec.model.to_dict(),
        "resolved": spec.resolved.to_dict(),  # precision, cell, kernel and recurrent product it trained with
        "parameters": sum(math.prod(s) for s in shapes.values()),
        "dtypes": dtypes,
        "mismatches": _mismatches(spec.model.parameter_shapes(), shapes),
        "tokenizer": {"kind": tok.get("kind"), "vocab_size": tok.get("vocab_size"),
                      "unit": dataset.get("unit") or spec.data.unit},
        "data": spec.data.path,
        "parent": None if spec.parent is None else {"path": spec.parent.path,
                                                    "model_sha256": spec.parent.model_sha256},
        "train": spec.train.to_dict(),
        "files": files,
        "total_bytes": sum(f["bytes"] for f in files),
    }
    run = where.parent.parent if where.parent.name == "checkpoints" else where.parent
    if info["train_slice_bpc"] is None and isinstance(info["step"], int):
        info["train_slice_bpc"] = _logged_slice(run / "metrics.jsonl", info["step"])
    steps = ckpt.step_dirs(run)
    if steps:
        latest = _latest(steps)
        info["run"] = {"dir": str(run), "checkpoints": [p.name for p in steps],
                       "latest_step": None if latest is None else latest[1]}
        if latest is not None and "overfit" not in trainer and (latest[0] / "trainer.json").is_file():
            info["cool_down"] = (read_json(latest[0] / "trainer.json", "trainer state").get("overfit")
                                 or {}).get("cool_down")  # best/ keeps no trainer state: the run's latest does
    return info


def _logged_slice(metrics: Path, step: int) -> float | None:
    """The train slice's BPC the run logged at its validation of `step`: a checkpoint written
    before trainer.json kept it (best/ did not) still shows its gap."""
    try:
        events = read_metrics(metrics)
    except OSError:
        return None
    found = None
    for e in events:
        if e.get("event") == "eval" and e.get("step") == step and e.get("train_slice_bpc") is not None:
            found = e["train_slice_bpc"]  # the last: a resumed run may have validated this step again
    return found


def _latest(steps: list[Path]) -> tuple[Path, int | None] | None:
    """The newest complete step checkpoint and its step."""
    for p in reversed(steps):
        try:
            manifest = ckpt.verify(p, deep=False)
        except CheckpointError:
            continue
        return p, manifest.get("step")
    return None


def _finite(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None

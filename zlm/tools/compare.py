"""The rows of `zlm compare`: what differs between runs, and how well each did.

Owns `compare_runs(run_dirs) -> Comparison`. Settings come from each run's config.json
("model", "train" and "resolved", nested dicts flattened as `schedule.kind`); only the settings
whose values differ across the runs become columns. Results: best valid BPC (the
validations in metrics.jsonl), test BPC (RUN_DIR/results.json, written by the recipes
from the best checkpoint; absent -> None), parameters, characters/s (median of the
logged training windows) and training time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from zlm.core.checkpoint import read_json_or_none
from zlm.core.spec import read_spec
from zlm.tools.curves import RunCurves, read_runs

# Settings that never change what is learned, or are always equal by construction.
IGNORED = {"model.vocab_size", "train.device", "train.keep_last", "train.log_every",
           "train.max_nonfinite", "train.cell", "train.eval_streams"}
RESULT_COLUMNS = ("best_valid_bpc", "test_bpc", "parameters", "chars_per_s", "train_time_s")


@dataclass(frozen=True)
class Comparison:
    """`settings`: the differing setting names (columns), `rows`: one dict per run with
    "run", each setting, and RESULT_COLUMNS (None where unknown)."""

    settings: list[str]
    rows: list[dict]

    def to_dict(self) -> dict:
        return {"settings": self.settings, "runs": self.rows}


def flatten(d: dict, prefix: str = "") -> dict:
    """{"train": {"schedule": {"kind": "x"}}} -> {"train.schedule.kind": "x"}."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def short_name(key: str) -> str:
    """Column name: 'model.zoneout_cell' -> 'zoneout_cell', 'train.schedule.kind' ->
    'schedule.kind'."""
    return key.split(".", 1)[1] if "." in key else key


def settings(config: dict) -> dict:
    """A config.json's settings, flattened: the model, the training options and what "auto"
    resolved to (precision, cell, kernel, recurrent product: `resolved.precision`, ...)."""
    return flatten({part: config.get(part, {}) for part in ("model", "train", "resolved")})


def differing(configs: list[dict]) -> list[str]:
    """Flattened keys whose values are not all equal (a key missing in a run counts)."""
    flat = [settings(c) for c in configs]
    keys: list[str] = []
    for f in flat:
        keys += [k for k in f if k not in keys]
    return [k for k in keys if k not in IGNORED
            and len({repr(f.get(k)) for f in flat}) > 1]


def read_test_bpc(run_dir: Path) -> float | None:
    """RUN_DIR/results.json's test BPC (of the best checkpoint), if a recipe wrote it."""
    doc = read_json_or_none(Path(run_dir) / "results.json") or {}
    v = doc.get("test_bpc")
    return float(v) if isinstance(v, (int, float)) else None


def result_row(run: RunCurves) -> dict:
    results = read_json_or_none(run.path / "results.json") or {}
    valid = results.get("valid_bpc")
    best = run.best_valid_bpc
    return {
        "best_valid_bpc": best if best is not None else valid,
        "test_bpc": read_test_bpc(run.path),
        "gap": run.gap,
        "parameters": run.parameters,
        "chars_per_s": statistics.median(run.chars_per_s) if run.chars_per_s else None,
        "train_time_s": run.elapsed_s,
    }


def compare_runs(run_dirs) -> Comparison:
    """Read each run directory; UsageError (one line) for one that is not a run."""
    runs = read_runs(run_dirs)
    configs = [read_spec(r.path).to_dict() for r in runs]
    keys = differing(configs)
    names = [short_name(k) for k in keys]
    if len(set(names)) < len(names):  # the same name under model and train: keep both whole
        names = list(keys)
    rows = []
    for run, config in zip(runs, configs, strict=True):
        flat = settings(config)
        row = {"run": run.name, "path": str(run.path)}
        row.update({n: flat.get(k) for n, k in zip(names, keys, strict=True)})
        row.update(result_row(run))
        rows.append(row)
    return Comparison(names, rows)

"""Learning curves of finished or running runs, read from RUN_DIR/metrics.jsonl.

Owns `RunCurves` and `read_run(run_dir)`: train and valid BPC against characters seen
and against wall-clock training time, plus the run's key settings for labels.

Characters seen after step s = s x batch_size x bptt x world_size x characters/token,
where characters/token is that of the training split (1 for char tokenizers; from the
DATA_DIR's dataset.json otherwise). Wall-clock time is the trainer's own `elapsed`
(training time, carried across resumes); validations, which log no time of their own,
are placed by interpolating `elapsed` between the logged steps around them.

A resumed run logs some steps twice (those after its last checkpoint); the later value
of a step wins, so a curve is always the history of the run as it now stands.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path

from zlm.core.checkpoint import read_json_or_none
from zlm.core.metrics import LN2, read_metrics
from zlm.core.spec import read_spec
from zlm.errors import UsageError


@dataclass(frozen=True)
class Curve:
    """One BPC series: parallel tuples, ordered by step."""

    steps: tuple[int, ...] = ()
    chars: tuple[float, ...] = ()  # characters seen after each step
    seconds: tuple[float, ...] = ()  # training wall-clock time after each step
    bpc: tuple[float, ...] = ()

    def __len__(self) -> int:
        return len(self.steps)

    def x(self, axis: str) -> tuple[float, ...]:
        """The x values for axis "chars" or "time"."""
        return self.chars if axis == "chars" else self.seconds


@dataclass(frozen=True)
class RunCurves:
    """What a run's metrics.jsonl and config.json say about how it learned."""

    path: Path
    name: str  # the run directory's name
    model: dict  # config.json "model"
    train_config: dict  # config.json "train"
    world_size: int
    chars_per_step: float  # batch_size x bptt x world_size x characters/token
    train: Curve  # training-mode BPC, averaged over each --log-every window
    valid: Curve  # validation BPC (eval mode, whole split)
    parameters: int | None = None
    chars_per_s: tuple[float, ...] = ()  # throughput of each logged window
    elapsed_s: float | None = None  # training time at the end (or at the last log line)
    steps: int = 0  # last step logged
    finished: bool = False  # a "finish" event closes the log (not interrupted)
    final_train_bpc: float | None = None  # last logged window, else the last steps' mean
    gap: float | None = None  # the last validation's valid - train-slice BPC (both in eval mode)
    events: dict = field(default_factory=dict, repr=False)  # event name -> count

    @property
    def best_valid_bpc(self) -> float | None:
        finite = [b for b in self.valid.bpc if b == b and b != float("inf")]
        return min(finite) if finite else None

    @property
    def settings(self) -> str:
        """Key settings for a legend: '1x512 z_c 0.5 z_h 0.05 dropout 0'."""
        return describe_settings(self.model)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.settings})"


def describe_settings(model: dict) -> str:
    """Layers x hidden, z_c, z_h and dropout of a config.json "model" dict."""
    def num(v) -> str:
        return "?" if v is None else f"{v:g}"

    return (f"{model.get('layers', '?')}x{model.get('hidden', '?')} "
            f"z_c {num(model.get('zoneout_cell'))} z_h {num(model.get('zoneout_hidden'))} "
            f"dropout {num(model.get('dropout'))}")


def chars_per_token(run_dir: Path, config: dict) -> float:
    """Characters per token of the training split (1.0 when the data is a char corpus or gone)."""
    if config.get("data", {}).get("unit", "character") == "character" and \
            config.get("data", {}).get("tokenizer", {}).get("kind", "char") == "char":
        return 1.0
    for where in (config.get("data", {}).get("path"), run_dir / "best", run_dir / "data"):
        if not where:
            continue
        meta = read_json_or_none(Path(where) / "dataset.json")
        split = (meta or {}).get("splits", {}).get("train")
        if split and split.get("tokens"):
            return split["characters"] / split["tokens"]
    return 1.0


def read_run(run_dir) -> RunCurves:
    """A run directory's curves. One-line UsageError if it is not a run directory."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "config.json").is_file():
        raise UsageError(f"{run_dir} is not a run directory (no metrics.jsonl and config.json); "
                         "pass the --out directory of a zlm train run")
    config = read_spec(run_dir).to_dict()
    events = read_metrics(run_dir / "metrics.jsonl")
    tc = config.get("train", {})
    world = int(config.get("world_size") or 1)
    per_step = tc.get("batch_size", 1) * tc.get("bptt", 1) * world * chars_per_token(run_dir, config)

    train: dict[int, tuple[float, float]] = {}  # step -> (elapsed, bpc)
    valid: dict[int, float] = {}
    times: dict[int, float] = {0: 0.0}  # step -> elapsed, anchors for validations
    speeds: dict[int, float] = {}
    losses: dict[int, float] = {}  # step -> mean nats per token (every step)
    counts: dict[str, int] = {}
    parameters, finish, last_step, gap = None, None, 0, None
    for e in events:
        kind = e.get("event")
        counts[kind] = counts.get(kind, 0) + 1
        step = e.get("step")
        if kind == "start":
            parameters = e.get("parameters", parameters)
            finish = None  # a resumed run is not finished until it logs "finish" again
        elif kind == "train" and step is not None:
            train[step] = (float(e.get("elapsed", 0.0)), float(e["train_bpc"]))
            times[step] = float(e.get("elapsed", 0.0))
            if e.get("chars_per_s"):
                speeds[step] = float(e["chars_per_s"])
        elif kind == "step" and step is not None and e.get("loss") is not None:
            losses[step] = float(e["loss"])
        elif kind == "eval" and step is not None:
            valid[step] = float(e["valid_bpc"])
            gap = e.get("gap", gap)
        elif kind == "finish":
            finish = e
            if step is not None and e.get("elapsed_s") is not None:
                # rounded to 0.1 s: an anchor only where no train line gave the exact time
                times.setdefault(step, float(e["elapsed_s"]))
        if isinstance(step, int):
            last_step = max(last_step, step)
    anchors = sorted(times.items())

    def curve(points: dict[int, float], seconds) -> Curve:
        steps = tuple(sorted(points))
        return Curve(steps, tuple(s * per_step for s in steps), tuple(seconds(s) for s in steps),
                     tuple(points[s] for s in steps))

    cpt = chars_per_token(run_dir, config)
    tail = [losses[s] for s in sorted(losses)[-10:]]
    final = (train[max(train)][1] if train
             else sum(tail) / len(tail) / cpt / LN2 if tail else None)
    elapsed = finish.get("elapsed_s") if finish else (anchors[-1][1] if len(anchors) > 1 else None)
    return RunCurves(
        path=run_dir, name=run_dir.resolve().name, model=config.get("model", {}), train_config=tc,
        world_size=world, chars_per_step=per_step,
        train=curve({s: v[1] for s, v in train.items()}, lambda s: train[s][0]),
        valid=curve(valid, lambda s: _interpolate(anchors, s)),
        parameters=parameters, chars_per_s=tuple(speeds[s] for s in sorted(speeds)),
        elapsed_s=elapsed, steps=last_step,
        finished=bool(finish) and not finish.get("interrupted"), final_train_bpc=final,
        gap=gap, events=counts,
    )


def _interpolate(anchors: list[tuple[int, float]], step: int) -> float:
    """Elapsed seconds at `step`, linear between the nearest logged steps around it."""
    keys = [s for s, _ in anchors]
    i = bisect.bisect_left(keys, step)
    if i < len(keys) and keys[i] == step:
        return anchors[i][1]
    if i == 0:
        return anchors[0][1]
    if i == len(keys):  # after the last log line: extrapolate at the last pace
        (s0, t0), (s1, t1) = anchors[-2] if len(anchors) > 1 else (0, 0.0), anchors[-1]
        return t1 + (t1 - t0) / max(s1 - s0, 1) * (step - s1)
    (s0, t0), (s1, t1) = anchors[i - 1], anchors[i]
    return t0 + (t1 - t0) * (step - s0) / (s1 - s0)


def read_runs(run_dirs) -> list[RunCurves]:
    """Several runs; a name used twice gets its parent folder prefixed so labels differ."""
    runs = [read_run(p) for p in run_dirs]
    names = [r.name for r in runs]
    out = []
    for r in runs:
        if names.count(r.name) > 1:
            r = RunCurves(**{**r.__dict__, "name": f"{r.path.resolve().parent.name}/{r.name}"})
        out.append(r)
    return out


def sample_at(curve: Curve, axis: str, xs) -> list[float | None]:
    """The curve on bins ending at each x of increasing `xs` (the first starts at 0): the
    last point at or before the bin's end (a step function); None for a bin wholly
    before the first point or after the last (so a short run visibly ends early)."""
    cx = curve.x(axis)
    out: list[float | None] = []
    left = 0.0
    for right in xs:
        i = bisect.bisect_right(cx, right) - 1
        out.append(curve.bpc[i] if i >= 0 and cx and left < cx[-1] else None)
        left = right
    return out

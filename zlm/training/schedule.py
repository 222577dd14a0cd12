"""Learning-rate schedules (constant, cosine with warmup, reduce-on-plateau) and the
overfitting guard's cool-down.

Constant and cosine are pure functions of the step (cosine under a --time-budget alone:
of the training time spent, so the decay ends when the budget does); plateau keeps a
little state (`state_dict`) that changes only when validation reports a BPC.

The overfitting guard (`--on-overfit cool-down`): a run that has started to overfit is
taken back to its best weights, its learning rate cooled to 0 over half a validation
interval, and stopped.

A corpus that overfits after a pass or two wastes the rest of a run's budget: every later
validation is worse than the best, and the best checkpoint is one taken at a high learning
rate, never annealed. The guard watches what each validation measures, valid BPC and the
eval-mode BPC of the fixed train slice (the generalisation gap's two sides):

    overfitting   valid BPC rose at RISES validations in a row, by MIN_RISE of its value in
                  all, while the train slice's BPC fell over them (the model still learns the
                  train split and loses on held-out text)
    drifting      or valid BPC scored at least MIN_RISE above the run's best at RISES
                  validations in a row, while the train slice's BPC is below what it was at
                  the best: the same, slowly and noisily (a run validated once a pass over a
                  small text loses a fraction of a percent a pass, up one pass, down the next,
                  and seldom rises twice in a row)

Once, at the first validation that shows it, the run reloads best/ (what validation scored
best, the weight average included), starts the weight average afresh, and decays the
learning rate linearly from COOL_LR of the schedule's current value (the rate at which it
just overfit) to 0 over the next COOL_STEPS x --eval-every steps (less of the text read
again); the validation at their end is the run's last. The run's log says so ("overfit").
COOL_STEPS and COOL_LR were chosen on fortunes-zh, the one benchmark corpus the guard
reacts on (docs/defaults-rule.md).

`OverfitGuard` is part of the run's state (trainer.json's "overfit"): a resumed run keeps
the recent validations and an unfinished cool-down, and continues exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from zlm.core.config import ScheduleConfig
from zlm.errors import UsageError


class LRSchedule:
    """lr(step) for the next optimizer step; observe(bpc) after each validation."""

    def __init__(self, cfg: ScheduleConfig, base_lr: float, total_steps: int | None,
                 time_budget: float | None = None):
        if cfg.kind == "cosine" and total_steps is None and time_budget is None:
            raise UsageError("--schedule cosine needs a length: pass --max-steps, --epochs or --time-budget")
        self.cfg, self.base_lr, self.total_steps, self.time_budget = cfg, base_lr, total_steps, time_budget
        self.scale = 1.0  # plateau reductions so far, multiplied
        self.best = math.inf
        self.bad = 0

    def progress(self, step: int, elapsed: float = 0.0) -> float:
        """How far through the run (0..1) cosine is: by steps after warmup, or by training
        time against --time-budget; with both limits, whichever is further along."""
        c, parts = self.cfg, []
        if self.total_steps is not None:
            parts.append(max(step - c.warmup, 0) / max(self.total_steps - c.warmup, 1))
        if self.time_budget is not None and step >= c.warmup:
            parts.append(elapsed / self.time_budget)
        return min(max(parts, default=0.0), 1.0)

    def lr(self, step: int, elapsed: float = 0.0) -> float:
        c = self.cfg
        warm = min(1.0, (step + 1) / c.warmup) if c.warmup else 1.0
        if c.kind == "cosine":
            progress = self.progress(step, elapsed)
            ratio = c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
            return self.base_lr * warm * ratio
        return self.base_lr * warm * self.scale

    def observe(self, bpc: float) -> None:
        if self.cfg.kind != "plateau" or not math.isfinite(bpc):
            return
        if bpc < self.best:
            self.best, self.bad = bpc, 0
            return
        self.bad += 1
        if self.bad >= self.cfg.patience:
            self.scale *= self.cfg.factor
            self.bad = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "best": self.best, "bad": self.bad}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.best, self.bad = float(state["scale"]), float(state["best"]), int(state["bad"])


# ------------------------------------------------------------------ the overfitting guard
RISES = 2  # validations in a row at which valid BPC rose (while the train slice fell)
MIN_RISE = 0.01  # by this share of its value over them at least (less is noise between validations)
COOL_STEPS = 0.5  # the cool-down's length, as a share of --eval-every
COOL_LR = 0.5  # its starting learning rate, as a share of the schedule's when it reacted


def overfitting(history: Sequence[tuple[float, float | None]], rises: int = RISES,
                min_rise: float = MIN_RISE) -> bool:
    """Whether the last `rises` validations of `history` ((valid BPC, train-slice BPC) in
    order) each scored valid worse than the one before, by `min_rise` of the first's value
    in all, while the train slice scored better at the last than at the first of them."""
    if len(history) < rises + 1:
        return False
    recent = history[-(rises + 1):]
    valid = [v for v, _ in recent]
    first, last = recent[0][1], recent[-1][1]
    if first is None or last is None:
        return False
    rose = all(b > a for a, b in zip(valid[:-1], valid[1:], strict=True))
    rose = rose and valid[-1] - valid[0] >= min_rise * valid[0]
    return rose and last < first


def drifting(history: Sequence[tuple[float, float | None]], best: tuple[float, float | None] | None,
             rises: int = RISES, min_rise: float = MIN_RISE) -> bool:
    """Whether the last `rises` validations of `history` each scored valid at least `min_rise`
    of `best`'s valid BPC above it, while the train slice scored better at the last of them
    than at `best` (the run's best validation before them, (valid BPC, train-slice BPC)), and
    the last did not score valid `min_rise` or more below the one before it: a run climbing
    back from one bad validation is not drifting away from its best."""
    if best is None or best[1] is None or len(history) < max(rises, 2):
        return False
    recent = history[-rises:]
    above = all(v >= best[0] * (1 + min_rise) for v, _ in recent)
    climbing_back = history[-1][0] <= history[-2][0] * (1 - min_rise)
    last = recent[-1][1]
    return above and not climbing_back and last is not None and last < best[1]


def first_overfit(history: Sequence[tuple[float, float | None]]) -> int | None:
    """The index of the first validation in `history` at which a run's guard reacts (None:
    never): the validations replayed through `OverfitGuard`, as the trainer shows them."""
    guard = OverfitGuard("cool-down")
    return next((k for k, (valid, train) in enumerate(history) if guard.observe(valid, train)), None)


@dataclass
class CoolDown:
    """The reaction under way: steps (at, until] at a learning rate falling from `lr` to 0."""

    at: int  # the step of the validation that showed overfitting
    until: int  # the run stops after this step
    lr: float  # the schedule's learning rate when it reacted
    best_step: int  # the step whose weights (best/) it went back to

    def lr_at(self, step: int) -> float:
        """The learning rate of the optimizer step after `step` steps (linear to 0 at `until`)."""
        return self.lr * max(self.until - step, 0) / max(self.until - self.at, 1)


class OverfitGuard:
    """Watches validations (`observe`) and holds the cool-down once it reacted.

    mode: "continue" (never reacts; the run only records what it sees) or "cool-down".
    """

    def __init__(self, mode: str):
        self.mode = mode
        self.history: list[tuple[float, float | None]] = []  # the last RISES + 1 validations
        self.best: tuple[float, float | None] | None = None  # the best validation before them
        self.cool: CoolDown | None = None
        self.reason = ""  # what it saw when it reacted: "rose" or "drifted"

    def observe(self, valid: float, train_slice: float | None) -> bool:
        """One validation's scores; True when the run should react now (once per run). A
        non-finite valid BPC (a diverged model, not an overfitting one) is not watched."""
        if not math.isfinite(valid):
            return False
        self.history = [*self.history, (valid, train_slice)][-(RISES + 1):]
        # the best is the best validation before the last RISES (the ones drifting compares)
        if len(self.history) > RISES:
            entering = self.history[-(RISES + 1)]
            if self.best is None or entering[0] < self.best[0]:
                self.best = entering
        if self.mode != "cool-down" or self.cool is not None:
            return False
        self.reason = ("rose" if overfitting(self.history)
                       else "drifted" if drifting(self.history, self.best) else "")
        return bool(self.reason)

    def seen(self) -> str:
        """What the validations showed when the guard reacted, for the run's log line."""
        valid = [f"{v:.3f}" for v, _ in self.history]
        if self.reason == "rose":
            train = " -> ".join(f"{t:.3f}" for _, t in self.history)
            return f"valid BPC rose at the last validations ({' -> '.join(valid)}) while the train slice's fell ({train})"
        best_valid, best_train = self.best
        return (f"valid BPC stayed {MIN_RISE:.0%} or more above its best, {best_valid:.3f}, at the last {RISES} "
                f"validations ({', '.join(valid[-RISES:])}) while the train slice's fell below its "
                f"{best_train:.3f} there (to {self.history[-1][1]:.3f})")

    def react(self, step: int, eval_every: int, lr: float, best_step: int) -> CoolDown:
        """Begin the cool-down at `step`: COOL_STEPS of `eval_every` steps from COOL_LR of `lr`
        (the schedule's learning rate now) to 0."""
        steps = max(1, round(eval_every * COOL_STEPS))
        self.cool = CoolDown(at=step, until=step + steps, lr=lr * COOL_LR, best_step=best_step)
        return self.cool

    def lr(self, step: int, scheduled: float) -> float:
        """The learning rate for the step after `step`: the schedule's, or the cool-down's."""
        return scheduled if self.cool is None else self.cool.lr_at(step)

    def finished(self, step: int) -> bool:
        """The cool-down is over: the run stops."""
        return self.cool is not None and step >= self.cool.until

    def state_dict(self) -> dict:
        cool = self.cool
        return {"history": [list(h) for h in self.history],
                "best": None if self.best is None else list(self.best),
                "cool_down": None if cool is None else {"at": cool.at, "until": cool.until, "lr": cool.lr,
                                                        "best_step": cool.best_step}}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.history = [_scores(h) for h in state.get("history", [])]
        best = state.get("best")  # absent in a checkpoint written before drifting was watched
        self.best = None if best is None else _scores(best)
        cool = state.get("cool_down")
        self.cool = None if cool is None else CoolDown(**cool)


def _scores(pair) -> tuple[float, float | None]:
    """(valid BPC, train-slice BPC or None) as trainer.json stores them."""
    valid, train = pair
    return float(valid), None if train is None else float(train)

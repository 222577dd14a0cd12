"""Learning-rate schedules: constant, cosine with warmup, and reduce-on-plateau.

Constant and cosine are pure functions of the step (cosine under a --time-budget alone:
of the training time spent, so the decay ends when the budget does); plateau keeps a
little state (`state_dict`) that changes only when validation reports a BPC.
"""

from __future__ import annotations

import math

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

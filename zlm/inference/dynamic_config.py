"""The settings of dynamic evaluation, without torch: `DynamicConfig` and its defaults.

`zlm eval --dynamic` and `zlm compress --adapt` show these defaults in their --help, so they
live apart from the adapter (`zlm.inference.dynamic`, which re-exports them): reading them
never imports torch. Where the defaults come from: `zlm.inference.dynamic`'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from zlm.errors import UsageError

DEFAULT_LR = 1e-3
DEFAULT_DECAY = 1e-3
DEFAULT_SEGMENT = 64


@dataclass(frozen=True)
class DynamicConfig:
    """How the weights follow the text (Krause et al. 2018's RMS rule with decay)."""

    lr: float = DEFAULT_LR  # step size eta of the RMS-normalised update; --dynamic-lr
    decay: float = DEFAULT_DECAY  # lambda: pull toward the trained weights; --dynamic-decay
    segment: int = DEFAULT_SEGMENT  # tokens per segment (one update each); --segment

    def __post_init__(self):
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise UsageError(f"--dynamic-lr must be a finite number >= 0, got {self.lr}")
        if not 0 <= self.decay < 1:
            raise UsageError(f"--dynamic-decay must be in [0, 1), got {self.decay}")
        if self.segment < 1:
            raise UsageError(f"--segment must be >= 1, got {self.segment}")

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"dynamic evaluation: one RMS-normalised step per {self.segment}-token segment "
                f"after predicting it (lr {self.lr:g}, decay {self.decay:g})")

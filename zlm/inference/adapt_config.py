"""The settings of the scorers that adapt to the text as they score it, without torch:
`DynamicConfig` (dynamic evaluation) and `CacheConfig` (the continuous cache), with their
defaults.

`zlm eval --dynamic`, `zlm eval --cache`, `zlm score --cache` and `zlm compress --adapt`
show these defaults in their --help, so they live apart from the scorers
(`zlm.inference.dynamic`, which re-exports the dynamic ones, and `zlm.inference.cache`):
reading them never imports torch. Where the defaults come from: those modules' docstrings.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from zlm.errors import UsageError

DEFAULT_LR = 1e-3
DEFAULT_DECAY = 1e-3
DEFAULT_SEGMENT = 64

DEFAULT_CACHE_SIZE = 2000
DEFAULT_CACHE_THETA = 0.5
CACHE_LAMBDAS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # the switching mixture's shares
CACHE_SWITCH_RATE = 0.03  # alpha: the weight each step moves back to all shares evenly


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


@dataclass(frozen=True)
class CacheConfig:
    """The continuous cache (Grave et al. 2017): how far back, how sharp, how much weight."""

    size: int = DEFAULT_CACHE_SIZE  # past positions of each stream it remembers; --cache-size
    theta: float = DEFAULT_CACHE_THETA  # sharpness of the match exp(theta h_t . h_i); --cache-theta
    mix: float | None = None  # lambda, the cache's fixed share; None: switch among CACHE_LAMBDAS; --cache-lambda

    def __post_init__(self):
        if self.size < 1:
            raise UsageError(f"--cache-size must be >= 1, got {self.size}")
        if not (self.theta >= 0 and math.isfinite(self.theta)):
            raise UsageError(f"--cache-theta must be a finite number >= 0, got {self.theta}")
        if self.mix is not None and not 0 <= self.mix < 1:
            raise UsageError(f"--cache-lambda must be in [0, 1), got {self.mix}")

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        share = (f"lambda {self.mix:g}" if self.mix is not None else
                 f"lambda switching among {', '.join(f'{x:g}' for x in CACHE_LAMBDAS)}, "
                 f"rate {CACHE_SWITCH_RATE:g}")
        return (f"continuous cache: each prediction mixed with the tokens that followed the "
                f"last {self.size:,} positions of its stream, weighted by exp({self.theta:g} "
                f"h_t . h_i) ({share})")

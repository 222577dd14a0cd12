"""Zoneout masks: drawn once, outside every cell, so all cells see the same ones.

A "keep" is the probability of keeping the previous state value at a step:
- training: a (T, B, H) tensor of 0/1 draws, d ~ Bernoulli(z), one per unit, per
  timestep, per example (SPEC.md section 4);
- evaluation, or z == 0: the plain float z (the expectation; 0.0 is a plain LSTM).
Masks come from the torch RNG of the device (or the generator given), so seeding and
saving that RNG state makes training, and resuming it, reproducible.
"""

from __future__ import annotations

import torch
from torch import Tensor

Keep = Tensor | float


def draw_keep(
    z: float,
    shape: tuple[int, int, int],
    training: bool,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
) -> Keep:
    """The keep for one state of one layer over a window of shape (T, B, H)."""
    if not training or z == 0.0:
        return float(z)
    u = torch.rand(shape, device=device, generator=generator)  # (T, B, H) fp32 uniforms
    return (u < z).to(dtype)


def keep_at(keep: Keep, t: int) -> Keep:
    """The keep for step t: a (B, H) slice of a mask, or the float itself."""
    return keep if isinstance(keep, float) else keep[t]

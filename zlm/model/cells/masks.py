"""Zoneout masks: drawn once, outside every cell, so all cells see the same ones.

A "keep" is the probability of keeping the previous state value at a step:
- training: a (T, B, H) tensor of 0/1 draws, d ~ Bernoulli(z), one per unit, per
  timestep, per example (SPEC.md section 4);
- evaluation, or z == 0: the plain float z (the expectation; 0.0 is a plain LSTM).
Masks come from the torch RNG of the device (or the generator given), so seeding and
saving that RNG state makes training, and resuming it, reproducible.

The draw uses 16 random bits per element, not a 32-bit float uniform: one full-range
int64 draw gives four elements, each kept when its int16 lies below a threshold, so
P(keep) = round(z * 2^16) / 2^16, within 7.7e-6 of z. Measured (2 cores, (100, 32, 512),
torch 2.13): 2.3 ms against 8.1 ms for `torch.rand(shape) < z`; with bf16 matmuls the
old draw was 12-28% of a whole training step (`zlm bench`'s mask_draw_share).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

Keep = Tensor | float

# How a training mask is drawn. "bits16" since zlm 0.2; "rand32" (one fp32 uniform per
# element) is what runs started before it drew, kept so that they resume bit for bit
# (the run's config.json "resolved" block names the draw).
MASK_DRAWS = ("bits16", "rand32")
MASK_DRAW = MASK_DRAWS[0]  # what a new run draws


def draw_keep(
    z: float,
    shape: tuple[int, int, int],
    training: bool,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
    draw: str = MASK_DRAW,
) -> Keep:
    """The keep for one state of one layer over a window of shape (T, B, H)."""
    if not training or z == 0.0:
        return float(z)
    if draw == "rand32":
        u = torch.rand(shape, device=device, generator=generator)  # (T, B, H) fp32 uniforms
        return (u < z).to(dtype)
    if draw != "bits16":
        raise ValueError(f"unknown mask draw {draw!r}; one of {MASK_DRAWS}")
    level = round(z * 65536)  # keep iff a uniform 16-bit draw is below this many of 2^16
    if level >= 65536:
        return torch.ones(shape, dtype=dtype, device=device)
    n = math.prod(shape)
    bits = torch.empty((n + 3) // 4, dtype=torch.int64, device=device)
    bits.random_(-(2**63), None, generator=generator)  # every one of the 64 bits uniform
    r16 = bits.view(torch.int16)[:n].view(shape)  # (T, B, H) uniform on [-2^15, 2^15)
    return torch.lt(r16, level - 32768, out=torch.empty(shape, dtype=dtype, device=device))


def keep_at(keep: Keep, t: int) -> Keep:
    """The keep for step t: a (B, H) slice of a mask, or the float itself."""
    return keep if isinstance(keep, float) else keep[t]

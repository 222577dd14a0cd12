"""Zoneout masks: drawn once, outside every cell, so all cells see the same ones.

A "keep" is the probability of keeping the previous state value at a step:
- training: a (T, B, H) tensor of 0/1 draws, d ~ Bernoulli(z), one per unit, per
  timestep, per example (Krueger et al. 2016);
- evaluation, or z == 0: the plain float z (the expectation; 0.0 is a plain LSTM).

The draw ("mix16") takes ONE full-range int64 seed per mask from the torch generator of
the device (or the one given), so seeding and saving that generator's state makes
training, and resuming it, reproducible. The random bits are splitmix64's outputs for a
counter started at the seed (`mix_words`; the constants in
`zlm.model.cells.kernel_constants`): a counter-based hash, so any part of the mask can be
computed on its own. Each element takes 16 of those bits - one 64-bit word gives four
elements, each kept when its int16 lies below a threshold - so
P(keep) = round(z * 2^16) / 2^16, within 7.7e-6 of z.

On the CPU with the compiled extension, zlm/model/cells/csrc/mask_draw.cpp writes the 0/1
mask in one pass over memory; elsewhere (no extension, CUDA, other dtypes) the torch
expression here gives the same bits. Their costs: docs/kernels.md.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from zlm.model.cells import cpu_ext
from zlm.model.cells.kernel_constants import MASK_BITS, SPLITMIX_GAMMA, SPLITMIX_MIX, SPLITMIX_SHIFTS

Keep = Tensor | float

_LANES = 64 // MASK_BITS  # mask elements per 64-bit word
_OFFSET = 1 << (MASK_BITS - 1)  # a lane read as a signed int16 is uniform on [-_OFFSET, _OFFSET)


def draw_keep(
    z: float,
    shape: tuple[int, int, int],
    training: bool,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
) -> Keep:
    """The keep for one state of one layer over a window of shape (T, B, H): a (T, B, H)
    0/1 mask of `dtype` in training, else the float z."""
    if not training or z == 0.0:
        return float(z)
    level = round(z * (1 << MASK_BITS))  # keep iff a uniform 16-bit draw is below this many of 2^16
    if level >= 1 << MASK_BITS:
        return torch.ones(shape, dtype=dtype, device=device)
    out = torch.empty(shape, dtype=dtype, device=device)
    seed = torch.empty(1, dtype=torch.int64, device=device).random_(-(2**63), None, generator=generator)
    ext = cpu_ext.loaded()
    if ext is not None and out.device.type == "cpu" and dtype in (torch.float32, torch.float64):
        ext.draw_mask(seed, level - _OFFSET, out)  # the same bits, written as the mask
        return out
    n = math.prod(shape)
    words = mix_words(seed, -(-n // _LANES))  # (ceil(n / 4),) int64
    r16 = words.view(torch.int16)[:n].view(shape)  # (T, B, H) uniform on [-2^15, 2^15)
    return torch.lt(r16, level - _OFFSET, out=out)


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _shift_right(z: Tensor, k: int) -> Tensor:
    """Logical shift of int64 words (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix_words(seed: Tensor, count: int) -> Tensor:
    """splitmix64's outputs for the states seed + i * GAMMA, i = 1 .. count: (count,) int64.

    int64 arithmetic wraps modulo 2^64 in torch (CPU and CUDA), as the C++ uint64 does.
    """
    s1, s2, s3 = SPLITMIX_SHIFTS
    z = seed + torch.arange(1, count + 1, dtype=torch.int64, device=seed.device) * _signed(SPLITMIX_GAMMA)
    z = (z ^ _shift_right(z, s1)) * _signed(SPLITMIX_MIX[0])
    z = (z ^ _shift_right(z, s2)) * _signed(SPLITMIX_MIX[1])
    return z ^ _shift_right(z, s3)


def keep_at(keep: Keep, t: int) -> Keep:
    """The keep for step t: a (B, H) slice of a mask, or the float itself."""
    return keep if isinstance(keep, float) else keep[t]

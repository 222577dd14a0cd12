"""Zoneout masks: drawn once, outside every cell, so all cells see the same ones.

A "keep" is the probability of keeping the previous state value at a step:
- training: a (T, B, H) tensor of 0/1 draws, d ~ Bernoulli(z), one per unit, per
  timestep, per example (Krueger et al. 2016);
- evaluation, or z == 0: the plain float z (the expectation; 0.0 is a plain LSTM).
Masks come from the torch RNG of the device (or the generator given), so seeding and
saving that RNG state makes training, and resuming it, reproducible.

The draw uses 16 random bits per element, not a 32-bit float uniform: one 64-bit word gives
four elements, each kept when its int16 lies below a threshold, so
P(keep) = round(z * 2^16) / 2^16, within 7.7e-6 of z. The words ("mix16", new runs since 2026-12-04)
are splitmix64's outputs for a counter started at ONE full-range int64 drawn from the
torch generator: the generator's state still decides every mask (seeding and saving it
makes a run reproducible), and the words come from a counter-based hash, which the C++
extension computes and writes as the 0/1 mask in one pass (the same bits as the torch
expression below, which runs without the extension and on CUDA). Measured (2 cores,
(100, 32, 512), fp32): 0.5 ms a mask against 2.2 ms for "bits16" (a torch `random_` word
per four elements, then `lt`) and 8.1 ms for "rand32" (`torch.rand(shape) < z`);
with bf16 matmuls the masks had been 4-8% of a whole training step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from zlm.model.cells import cpu_ext
from zlm.model.cells.kernel_constants import SPLITMIX_GAMMA, SPLITMIX_MIX, SPLITMIX_SHIFTS

Keep = Tensor | float

# How a training mask is drawn. "mix16" for new runs; "bits16" (torch random_
# words) and "rand32" (one fp32 uniform per element, before) are what runs started earlier
# drew, kept so that they resume bit for bit (the run's config.json "resolved" block names
# the draw).
MASK_DRAWS = ("mix16", "bits16", "rand32")
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
    if draw not in MASK_DRAWS:
        raise ValueError(f"unknown mask draw {draw!r}; one of {MASK_DRAWS}")
    level = round(z * 65536)  # keep iff a uniform 16-bit draw is below this many of 2^16
    if level >= 65536:
        return torch.ones(shape, dtype=dtype, device=device)
    n = math.prod(shape)
    out = torch.empty(shape, dtype=dtype, device=device)
    count = (n + 3) // 4  # a word per four elements, every one of its 64 bits uniform
    if draw == "bits16":
        words = torch.empty(count, dtype=torch.int64, device=device).random_(-(2**63), None, generator=generator)
    else:  # mix16: the generator gives the seed only
        seed = torch.empty(1, dtype=torch.int64, device=device).random_(-(2**63), None, generator=generator)
        ext = cpu_ext.loaded()
        if ext is not None and out.device.type == "cpu" and dtype in (torch.float32, torch.float64):
            ext.draw_mask(int(seed), level - 32768, out)  # the same bits, written as the mask
            return out
        words = mix_words(seed, count)
    r16 = words.view(torch.int16)[:n].view(shape)  # (T, B, H) uniform on [-2^15, 2^15)
    return torch.lt(r16, level - 32768, out=out)


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

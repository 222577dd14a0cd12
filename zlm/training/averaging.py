"""Weight averaging over the end of a run (`--average`): what validation scores and best/ keeps.

The weights of the last steps of a run wander around a minimum by as much as the learning
rate lets them, so which of them is validated (and which becomes "best") is partly luck.
Averaging them (Polyak averaging; averaged SGD is among the largest single gains of
AWD-LSTM's ablation) keeps one model that sits nearer the middle. Over the last `share` of
a run of known length (by steps, epochs or time, whichever ends it) every step's weights are
added to a running mean; from the first averaged step on, validation scores the mean (the
live weights keep training) and best/ saves it when it improves.

The mean and its count are part of a checkpoint (average.safetensors, trainer.json's
"average"), so a resumed run averages exactly as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor


class WeightAverage:
    """The running mean of a model's parameters over the steps since averaging started.

    share: the part of the run (0..1) at its end that is averaged; 0 turns averaging off.
    named: the model's (name, parameter) pairs.
    """

    def __init__(self, share: float, named: Sequence[tuple[str, Tensor]]):
        self.share = share
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.mean: list[Tensor] | None = None
        self.count = 0  # steps in the mean

    def wanted(self, progress: float | None) -> bool:
        """Averaging is on and the run is `progress` (0..1) through: into its last `share`."""
        return self.share > 0 and progress is not None and progress >= 1.0 - self.share

    @torch.no_grad()
    def add(self) -> None:
        """The parameters as they are now into the mean (on their device: no host read)."""
        if self.mean is None:
            self.mean = [p.detach().float().clone() for p in self.params]
            self.count = 1
            return
        self.count += 1
        torch._foreach_lerp_(self.mean, [p.detach().float() for p in self.params], 1.0 / self.count)

    @contextmanager
    def applied(self) -> Iterator[bool]:
        """The mean copied into the parameters for the block (True), the live weights back
        after it; nothing changes (False) before the first averaged step."""
        if self.mean is None:
            yield False
            return
        with torch.no_grad():
            live = [p.detach().clone() for p in self.params]
            for p, m in zip(self.params, self.mean, strict=True):
                p.copy_(m)
        try:
            yield True
        finally:
            with torch.no_grad():
                for p, w in zip(self.params, live, strict=True):
                    p.copy_(w)

    def tensors(self) -> dict[str, Tensor]:
        """{parameter name: mean} for a checkpoint (empty before the first averaged step)."""
        if self.mean is None:
            return {}
        return {n: m.detach().cpu() for n, m in zip(self.names, self.mean, strict=True)}

    def load(self, tensors: dict[str, Tensor], count: int) -> None:
        """Restore a mean of `count` steps from `tensors` (onto the parameters' devices)."""
        if count <= 0:
            self.mean, self.count = None, 0
            return
        self.mean = [tensors[n].to(device=p.device, dtype=torch.float32).clone()
                     for n, p in zip(self.names, self.params, strict=True)]
        self.count = count

"""The only module that touches torch.distributed, DDP and ZeRO.

`setup()` reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK) and returns a
`Parallel` object; the trainer calls its methods and never branches on the world size.
With no such environment it is a single process and every method is trivial.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Parallel:
    """This process's place in the job, and the few collective operations training needs."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def make_optimizer(self, cls: type, params, **kwargs) -> torch.optim.Optimizer:
        """The optimizer (ZeroRedundancyOptimizer around cls under --zero)."""
        return cls(params, **kwargs)

    def sum(self, values: list[float]) -> list[float]:
        """Sum floats across ranks (float64)."""
        return list(values)

    def gather_state(self, t: torch.Tensor) -> torch.Tensor:
        """(L, B, H) per rank -> (L, W*B, H) on every rank, ranks in order."""
        return t

    def scatter_state(self, t: torch.Tensor) -> torch.Tensor:
        """(L, W*B, H) -> this rank's (L, B, H)."""
        return t

    def consolidate_optimizer(self, optimizer) -> dict | None:
        """The full optimizer state_dict on rank 0 (None elsewhere)."""
        return optimizer.state_dict()

    def gather_object(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] on every rank."""
        return [obj]

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


def setup(backend_device: torch.device | None = None, zero: bool = False) -> Parallel:
    """A Parallel for this process (single process when not under torchrun)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise NotImplementedError("multi-process training is being built")
    return Parallel()

"""Resolve once: what `--precision auto` and `--cell auto` became when a run started.

A fresh run resolves on rank 0 and broadcasts it, so every rank of a DDP job runs the
same precision and kernel; the result is written to config.json under "resolved". A
resumed run never re-resolves: it reads the "resolved" block of the checkpoint it resumes
from, on whatever machine it now runs, so its losses continue bit for bit where the same
kernel exists. A run written before zlm stored this block (config.json has "auto") gets
what that zlm resolved "auto" to: fp32 on a CPU (bf16, else fp16, on CUDA) and the fused
cell in Python on a CPU (Triton on CUDA). The zoneout mask draw is stored too: a run
whose block lacks it started before the 16-bit draw and keeps fp32 uniforms ("rand32");
one that names "bits16" (torch random_ words, before "mix16") keeps that, new runs draw "mix16".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from zlm.core import checkpoint as ckpt
from zlm.core.precision import precision_reason, resolve_precision
from zlm.errors import CheckpointError
from zlm.model.cells import KERNELS, CellChoice, choose_cell
from zlm.model.lm import ModelConfig
from zlm.training.config import TrainConfig


@dataclass(frozen=True)
class Resolved:
    """The concrete settings a run trains with (config.json "resolved")."""

    precision: str  # fp32 | bf16 | fp16
    cell: str  # fused | reference | plain (what --cell asked for, resolved)
    kernel: str  # compiled | python | triton | reference | plain (the code that runs)
    why: str = ""  # one line for the start display (not stored)

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise CheckpointError(f"config.json names an unknown cell kernel {self.kernel!r}; use another checkpoint")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("why")
        return d


def resolve_fresh(cfg: TrainConfig, model: ModelConfig, device: torch.device, on_event=None) -> Resolved:
    """Resolve `auto` on this machine (rank 0 does this for a new run)."""
    precision = resolve_precision(device, cfg.precision)
    cell = choose_cell(cfg.cell, device, on_event, zoneout=(model.zoneout_cell, model.zoneout_hidden))
    return Resolved(precision, cell.name, cell.kernel, precision_reason(device, precision, cfg.precision))


def stored(checkpoint: Path, device: torch.device) -> Resolved:
    """What the run in `checkpoint` was resolved to when it started."""
    config = ckpt.read_json(checkpoint / "config.json", "training configuration")
    try:
        r = Resolved(**config["resolved"])
    except (TypeError, KeyError) as e:
        raise CheckpointError(f"{checkpoint}/config.json has a damaged 'resolved' block ({e})") from None
    return Resolved(r.precision, r.cell, r.kernel, f"as this run started ({checkpoint.name}/config.json)")



def cell_for(resolved: Resolved, requested: str, model: ModelConfig, device: torch.device,
             on_event=None) -> CellChoice:
    """The cell a resolution names, on this machine (a warning if its kernel is missing here).

    requested: --cell as given; when it is what the resolution names, the start line says
    "requested", otherwise it says why `auto` chose it."""
    request = requested if requested == resolved.cell else "auto"
    return choose_cell(request, device, on_event, zoneout=(model.zoneout_cell, model.zoneout_hidden),
                       kernel=resolved.kernel)

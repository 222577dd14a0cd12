"""Resolve once: what `--precision auto` and `--cell auto` become when a run starts.

`zlm.training.plan` resolves a fresh run here (on rank 0, for every rank) and the result
is stored in config.json under "resolved" (`zlm.core.spec.Resolved`), with what runs the
compiled CPU cell's recurrent products here. A resumed run never re-resolves: it runs what
its config.json names, on whatever machine it now runs, so its losses continue bit for bit
where the same kernel and product exist (a warning says when they do not).
"""

from __future__ import annotations

import torch

from zlm.core.config import TrainConfig
from zlm.core.precision import precision_reason, resolve_precision
from zlm.core.spec import PRODUCT_NAMES, Resolved
from zlm.model.cells import CellChoice, choose_cell, recurrent_product
from zlm.model.config import ModelConfig


def resolve_fresh(cfg: TrainConfig, model: ModelConfig, device: torch.device, on_event=None) -> Resolved:
    """Resolve `auto` on this machine (rank 0 does this for a new run)."""
    precision = resolve_precision(device, cfg.precision)
    cell = choose_cell(cfg.cell, device, on_event, zoneout=(model.zoneout_cell, model.zoneout_hidden))
    return Resolved(precision, cell.name, cell.kernel, precision_reason(device, precision, cfg.precision),
                    recurrent_product(cell.kernel, precision, model.hidden))


def cell_for(resolved: Resolved, requested: str, model: ModelConfig, device: torch.device,
             on_event=None) -> CellChoice:
    """The cell a resolution names, on this machine (a warning if its kernel is missing here).

    requested: --cell as given; when it is what the resolution names, the start line says
    "requested", otherwise it says why `auto` chose it."""
    request = requested if requested == resolved.cell else "auto"
    cell = choose_cell(request, device, on_event, zoneout=(model.zoneout_cell, model.zoneout_hidden),
                       kernel=resolved.kernel)
    here = recurrent_product(cell.kernel, resolved.precision, model.hidden)
    if resolved.product and cell.kernel == resolved.kernel and here != resolved.product and on_event is not None:
        on_event(f"warning: this run's recurrent products ran on {PRODUCT_NAMES[resolved.product]}, here on "
                 f"{PRODUCT_NAMES.get(here, here)}: it continues, but its losses differ in the last bits")
    return cell

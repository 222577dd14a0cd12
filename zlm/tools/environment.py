"""`zlm --version`: what this install is and what this machine gives it.

Owns `environment()`: zlm, torch and Python versions, the device `--device auto` picks,
the cell `--cell auto` picks on it (and why) and the precision `--precision auto` resolves
to for training there (`zlm eval` stays fp32 unless asked). It asks the same functions
training asks (`choose_cell`, `resolve_runtime`), so it cannot disagree with them.
"""

from __future__ import annotations

import platform

import torch

from zlm.core.precision import resolve_runtime
from zlm.model.cells import choose_cell
from zlm.model.cells.cpu_ext import cpu_name
from zlm.version import __version__


def _device_line(device: torch.device) -> str:
    if device.type != "cuda":
        why = "no CUDA device" if torch.version.cuda else "CPU-only torch build"
        return f"cpu: {cpu_name()} ({torch.get_num_threads()} threads; {why})"
    i = device.index or 0
    p = torch.cuda.get_device_properties(i)
    return (f"cuda:{i} {p.name} (compute {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB; "
            f"{torch.cuda.device_count()} device(s), CUDA {torch.version.cuda})")


def environment() -> list[tuple[str, str]]:
    """(name, value) rows, in the order `zlm --version` prints them."""
    rt = resolve_runtime("auto", "auto")
    cell = choose_cell("auto", rt.device)
    return [
        ("zlm", __version__),
        ("torch", torch.__version__),
        ("Python", f"{platform.python_version()} ({platform.python_implementation()}, "
                   f"{platform.system()} {platform.machine()})"),
        ("device", _device_line(rt.device)),
        ("cell", f"{cell.name}: {cell.reason}"),
        ("precision", f"{rt.precision} for training with --precision auto; eval fp32 unless asked"),
    ]

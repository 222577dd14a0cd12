"""Zoneout LSTM cells behind one chooser.

Every cell has the signature of `zoneout_lstm_reference` (see `zlm.model.cells.reference`):

    cell(x, h0, c0, weight_ih, weight_hh, bias, keep_c, keep_h) -> (y, h_T, c_T)
    x: (T, B, I), h0/c0: (B, H), weight_ih: (4H, I), weight_hh: (4H, H), bias: (4H,),
    keep_c/keep_h: (T, B, H) 0/1 masks or a float; y: (T, B, H).

All cells share the parameter layout, so checkpoints are interchangeable, and take the
same pre-drawn masks, so they are comparable under one seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from zlm.errors import UsageError
from zlm.model.cells.reference import zoneout_lstm_reference

CellFn = Callable[..., tuple[Tensor, Tensor, Tensor]]
CELL_NAMES = ("auto", "fused", "reference")


@dataclass(frozen=True)
class CellChoice:
    """Which cell implementation runs, and why (said once at start)."""

    name: str
    fn: CellFn
    reason: str


def _fused_for(device: torch.device, on_event: Callable[[str], None] | None = None) -> tuple[CellFn | None, str]:
    """The fused cell for this device, or None and the reason it does not apply."""
    if device.type == "cuda":
        try:
            from zlm.model.cells.triton import triton_unavailable_reason, zoneout_lstm_triton
        except ImportError as e:
            return None, f"the CUDA fused cell could not be imported ({e})"
        why = triton_unavailable_reason()
        return (None, why) if why else (zoneout_lstm_triton, "Triton fused cell on CUDA")
    try:
        from zlm.model.cells.fused import zoneout_lstm_fused
    except ImportError as e:
        return None, f"the CPU fused cell could not be imported ({e})"
    from zlm.model.cells.packed_gemm import ONEDNN

    gemm = "oneDNN packed weights for fp32" if ONEDNN else "addmm (no oneDNN in this torch)"
    compiled, why = _compiled_cpu_cell(on_event)
    if compiled is not None:
        return compiled, f"fused CPU cell with the compiled C++ step ({why}; per-step GEMM: {gemm})"
    return zoneout_lstm_fused, f"fused CPU cell in Python ({why}; per-step GEMM: {gemm})"


_compiled: dict = {}


def _compiled_cpu_cell(on_event: Callable[[str], None] | None) -> tuple[CellFn | None, str]:
    """The compiled CPU cell (built on first use) and its ISA, or None and a one-line reason."""
    from zlm.model.cells import cpu_ext

    ext = cpu_ext.load_extension(on_event)
    if ext is None:
        return None, cpu_ext.unavailable_reason() or "the C++ step is unavailable"
    if _compiled.get("ext") is not ext:  # one function object per loaded module
        from zlm.model.cells.compiled import make_compiled_cell

        _compiled.update(ext=ext, fn=make_compiled_cell(ext))
    return _compiled["fn"], cpu_ext.instruction_set()


def choose_cell(request: str = "auto", device: torch.device | str = "cpu",
                on_event: Callable[[str], None] | None = None) -> CellChoice:
    """Resolve `--cell auto|fused|reference` for a device.

    On the CPU, "fused" is the cell with the compiled C++ step when it builds (the first
    use compiles it: `on_event` hears "compiling ..." and the time it took, else the
    `zlm.ext` logger), and the Python fused cell otherwise, with the reason in `reason`.
    """
    device = torch.device(device)
    if request not in CELL_NAMES:
        raise UsageError(f"unknown cell {request!r}; pass --cell auto, fused or reference")
    if request == "reference":
        return CellChoice("reference", zoneout_lstm_reference, "requested with --cell reference")
    fn, why = _fused_for(device, on_event)
    if fn is not None:
        return CellChoice("fused", fn, why if request == "auto" else f"requested with --cell fused: {why}")
    if request == "fused":
        raise UsageError(f"--cell fused is not available: {why}; pass --cell reference")
    return CellChoice("reference", zoneout_lstm_reference, f"fallback: {why}")

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
from zlm.model.cells.plain import lstm_plain
from zlm.model.cells.reference import zoneout_lstm_reference
from zlm.model.config import CELL_NAMES, KERNELS  # noqa: F401 (re-exported)

CellFn = Callable[..., tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class CellChoice:
    """Which cell implementation runs, and why (said once at start).

    name: the --cell value it satisfies (fused | reference | plain); kernel: the code that
    runs (compiled C++ step, Python fused, Triton, reference, plain; which runs when:
    docs/kernels.md). Both are stored in a run's config.json so that a resumed run runs the
    very same kernel (bit-exact losses).
    """

    name: str
    fn: CellFn
    reason: str
    kernel: str = "reference"


def _fused_for(device: torch.device, on_event: Callable[[str], None] | None = None,
               kernel: str | None = None) -> tuple[CellFn | None, str, str]:
    """The fused cell for this device (kernel: the one to prefer), or None and why not."""
    if device.type == "cuda":
        try:
            from zlm.model.cells.triton import triton_unavailable_reason, zoneout_lstm_triton
        except ImportError as e:
            return None, f"the CUDA fused cell could not be imported ({e})", "triton"
        why = triton_unavailable_reason()
        return (None, why, "triton") if why else (zoneout_lstm_triton, "Triton fused cell on CUDA", "triton")
    try:
        from zlm.model.cells.fused import zoneout_lstm_fused
    except ImportError as e:
        return None, f"the CPU fused cell could not be imported ({e})", "python"
    from zlm.model.cells.packed_gemm import ONEDNN, ONEDNN_BF16

    gemm = ("oneDNN packed weights for fp32" + (" and bf16" if ONEDNN_BF16 else "")) if ONEDNN \
        else "addmm (no oneDNN in this torch)"
    if kernel == "python":
        return zoneout_lstm_fused, f"fused CPU cell in Python (as this run was started; per-step GEMM: {gemm})", "python"
    compiled, why = _compiled_cpu_cell(on_event)
    if compiled is not None:
        from zlm.model.cells.compiled import (
            AMX_MAX_HIDDEN,
            MKL_ELSEWHERE_MAX_HIDDEN,
            on_intel,
            recurrent_backend,
        )

        ext = _compiled["ext"]
        if recurrent_backend(ext, hidden=1) == "mkl":  # at every size on Intel's CPUs, else small ones
            sizes = "" if on_intel() else f" up to H {MKL_ELSEWHERE_MAX_HIDDEN} (oneDNN packed weights above)"
            gemm = f"MKL packed GEMM for fp32{sizes}" + (", oneDNN packed weights for bf16" if ONEDNN_BF16 else "")
        if recurrent_backend(ext, torch.bfloat16, AMX_MAX_HIDDEN) == "amx":
            gemm += f" (AMX micro-kernel up to H {AMX_MAX_HIDDEN})"
        return compiled, f"fused CPU cell with the compiled C++ step ({why}; per-step GEMM: {gemm})", "compiled"
    return zoneout_lstm_fused, f"fused CPU cell in Python ({why}; per-step GEMM: {gemm})", "python"


_compiled: dict = {}


def recurrent_product(kernel: str, precision: str, hidden: int) -> str:
    """What runs the compiled CPU cell's recurrent products at this precision and size on this
    machine (`compiled.recurrent_backend`: a key of `zlm.core.spec.PRODUCT_NAMES`), "" for
    every other kernel.
    A run records it: bf16 rounds the recurrent sum differently on AMX (fp32 until the
    element-wise step) than on oneDNN, so a resume elsewhere continues, but not bit for bit."""
    if kernel != "compiled" or "ext" not in _compiled:
        return ""
    from zlm.model.cells.compiled import recurrent_backend

    return recurrent_backend(_compiled["ext"], torch.bfloat16 if precision == "bf16" else torch.float32, hidden)


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
                on_event: Callable[[str], None] | None = None, *, zoneout: tuple[float, float] | None = None,
                kernel: str | None = None) -> CellChoice:
    """Resolve `--cell auto|fused|reference|plain` for a device.

    auto: the plain cell (torch's LSTM kernel) when `zoneout` is (0, 0), else the fused
    cell. On the CPU, "fused" is the cell with the compiled C++ step when it builds (the
    first use compiles it: `on_event` hears "compiling ..." and the time it took, else the
    `zlm.ext` logger), and the Python fused cell otherwise, with the reason in `reason`.
    kernel: the kernel a resumed run was started with; it is used again where it exists.
    """
    device = torch.device(device)
    if request not in CELL_NAMES:
        raise UsageError(f"unknown cell {request!r}; pass --cell auto, fused, reference or plain")
    no_zoneout = zoneout is not None and tuple(zoneout) == (0.0, 0.0)
    if request == "plain" or (request == "auto" and kernel in (None, "plain") and no_zoneout):
        if zoneout is not None and not no_zoneout:
            raise UsageError("--cell plain runs a plain LSTM; pass --zoneout-cell 0 --zoneout-hidden 0 "
                             "or another --cell")
        why = "requested with --cell plain" if request == "plain" else "auto: no zoneout, so torch's LSTM kernel"
        return CellChoice("plain", lstm_plain, why, "plain")
    if request == "reference" or (request == "auto" and kernel == "reference"):
        why = "requested with --cell reference" if request == "reference" else "as this run was started"
        return CellChoice("reference", zoneout_lstm_reference, why, "reference")
    fn, why, got = _fused_for(device, on_event, kernel)
    if fn is not None:
        if kernel is not None and got != kernel and on_event is not None:
            on_event(f"warning: this run was started with the {kernel} kernel, not available here; "
                     f"continuing with {got} (losses may differ in the last bits)")
        return CellChoice("fused", fn, why if request == "auto" else f"requested with --cell fused: {why}", got)
    if request == "fused":
        raise UsageError(f"--cell fused is not available: {why}; pass --cell reference")
    return CellChoice("reference", zoneout_lstm_reference, f"fallback: {why}", "reference")

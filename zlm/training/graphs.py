"""CUDA graphs for training: whether a run's steps are replayed from graphs, and why not.

At batch 32 the recurrence is launch-bound: a window of T steps launches about 2T small
kernels forward and 2T backward (one matmul and one Triton kernel a step). Capturing the
whole window (embedding, every layer's masks and recurrence, decoder, loss and backward)
into one CUDA graph turns those thousands of launches into one `replay()`; capturing the
clipping and the fused optimizer with it (`zlm.training.step.TrainStep`, mode "step")
leaves the host one replay and one learning-rate fill per step. The mechanism
(`zlm.core.graphs.WindowStep`, a graph per window shape) is shared with evaluation; this
module decides whether a run uses it (`graphs_unavailable_reason`, `resolve_graphs`).
The eager step is the reference (tests/training/test_graphs.py, tests/training/test_step.py).
The masks of a replayed window are the ones an eager step would have drawn: the capture
restores the CUDA RNG, and the graph reads the generator's seed and offset at each replay,
so seeding and checkpointing the RNG work as without graphs.
"""

from __future__ import annotations

from zlm.core.config import GRAPH_MODES
from zlm.core.precision import Runtime
from zlm.errors import UsageError


def graphs_unavailable_reason(runtime: Runtime, cell_name: str, world: int, scaler_enabled: bool,
                              hooked: bool = False) -> str | None:
    """None when training windows can be replayed from CUDA graphs, else why not."""
    if runtime.device.type != "cuda":
        return "not on CUDA"
    if cell_name != "fused":
        return f"the {cell_name} cell launches per-step Python work not worth capturing"
    if world > 1:
        return "DistributedDataParallel all-reduces inside backward (one process only)"
    if scaler_enabled:
        return "fp16's GradScaler changes its scale between steps (use bf16)"
    if hooked:
        return "a test hook changes the loss"
    return None


def resolve_graphs(mode: str, why_not: str | None) -> tuple[bool, str]:
    """`--cuda-graphs auto|on|off` -> (enabled, one line saying why)."""
    if mode not in GRAPH_MODES:
        raise UsageError(f"unknown --cuda-graphs {mode!r}; pass auto, on or off")
    if mode == "off":
        return False, "off (--cuda-graphs off)"
    if why_not is None:
        return True, "on"
    if mode == "on":
        raise UsageError(f"--cuda-graphs on is not possible here: {why_not}; pass --cuda-graphs auto")
    return False, f"off ({why_not})"

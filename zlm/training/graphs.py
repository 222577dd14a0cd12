"""CUDA graphs for training: a step captured once per window shape, replayed after.

At batch 32 the recurrence is launch-bound: a window of T steps launches about 2T small
kernels forward and 2T backward (one matmul and one Triton kernel a step). Capturing the
whole window (embedding, every layer's masks and recurrence, decoder, loss and backward)
into one CUDA graph (`zlm.core.graphs.CapturedStep`) turns those thousands of launches
into one `replay()`; capturing the clipping and the fused optimizer with it
(`zlm.training.step.TrainStep`, mode "step") leaves the host one replay and one
learning-rate fill per step.

`WindowStep` wraps the step's function: one TBPTT window -> (loss or the step's numbers,
final state), replayed from a graph per window shape (a few at most, e.g. the shorter last
window of an epoch) when `graphs_unavailable_reason` says it can be, run eagerly
otherwise; the parameters' gradients are exposed after each replay. Both paths compute
the same thing; the eager one is the reference (tests/training/test_graphs.py,
tests/training/test_step.py). The masks of a replayed window are the ones an eager step
would have drawn: the capture restores the CUDA RNG, and the graph reads the generator's
seed and offset at each replay, so seeding and checkpointing the RNG work as without graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from zlm.core.config import GRAPH_MODES
from zlm.core.graphs import CapturedStep, Snapshot
from zlm.core.precision import Runtime
from zlm.errors import UsageError

MAX_SHAPES = 4  # graphs kept per trainer (window shapes); others run eagerly


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


class WindowStep:
    """`fn(x, y, h0, c0) -> (out, h, c)` for one TBPTT window, replayed from CUDA graphs.

    fn is the training step's forward + loss + backward (`zlm.training.step.forward_backward`,
    out the loss), leaving gradients in `param.grad` of `params`, or the whole step (out its
    numbers; `snapshot` then undoes the warm-up's updates). With `graphs` off it is simply
    called; with graphs on, each window shape is captured once and replayed after (shapes
    beyond MAX_SHAPES run eagerly). Either way the caller gets (out, (h, c)) it owns.
    """

    capture = CapturedStep  # tests substitute an eager stand-in

    def __init__(self, fn: Callable[..., tuple[Tensor, Tensor, Tensor]], params: Sequence[Tensor],
                 graphs: bool = False, snapshot: Snapshot | None = None):
        self.fn, self.params, self.graphs, self.snapshot = fn, list(params), graphs, snapshot
        self.captured: dict[tuple, CapturedStep] = {}
        self.replays = 0

    def __call__(self, x: Tensor, y: Tensor, state: tuple[Tensor, Tensor]):
        h0, c0 = state
        key = (tuple(x.shape), tuple(h0.shape))
        graph = self.captured.get(key) if self.graphs else None
        if graph is None and self.graphs and len(self.captured) < MAX_SHAPES:
            graph = self.captured[key] = self.capture(self.fn, (x, y, h0, c0), self.params,
                                                      snapshot=self.snapshot)
        if graph is None:
            loss, h, c = self.fn(x, y, h0, c0)
            return loss, (h, c)
        loss, h, c = graph(x, y, h0, c0)
        self.replays += 1
        return loss.clone(), (h.clone(), c.clone())

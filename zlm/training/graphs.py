"""CUDA graphs: a training window's forward and backward captured once, replayed after.

At batch 32 the recurrence is launch-bound: a window of T steps launches about 2T small
kernels forward and 2T backward (one matmul and one Triton kernel a step), each costing
a few microseconds of CPU time, while the GPU finishes each in less. Capturing the whole
window (embedding, every layer's masks and recurrence, decoder, loss and backward) into
one CUDA graph turns those thousands of launches into one `replay()`.

`CapturedStep` is the mechanism (static inputs, a side-stream warmup, capture, replay,
the parameters' gradients exposed after each replay); `WindowStep` wraps the trainer's
forward + loss + backward from outside: one TBPTT window -> (loss, final state),
gradients left in `param.grad`, replayed from a graph when `graphs_unavailable_reason`
says it can be, run eagerly otherwise. Both paths compute the same thing; the eager one
is the reference (tests/training/test_graphs.py).

Rules the captured function keeps: no host synchronisation (no .item(), no data-dependent
Python branches), fixed shapes (a graph is kept per window shape; a few shapes at most,
e.g. the shorter last window of an epoch), and the CUDA RNG state is restored after the
warmup and capture so that the masks of the first replayed window are the ones an eager
step would have drawn (the graph's RNG ops read the generator's seed and offset at each
replay, so seeding and checkpointing the RNG work as without graphs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from zlm.core.config import GRAPH_MODES
from zlm.core.precision import Runtime
from zlm.errors import UsageError

MAX_SHAPES = 4  # graphs kept per trainer (window shapes); others run eagerly


class CapturedStep:
    """fn(*inputs) captured into one CUDA graph; calling copies inputs in and replays.

    fn may call backward: gradients of `params` are produced inside the graph (each
    parameter's .grad is None at capture, so the graph writes, not accumulates, them)
    and reattached to the parameters after every replay, so the caller can clip and
    step as usual and even set .grad to None in between. Outputs are the graph's static
    tensors, overwritten by the next replay: copy what must outlive it.
    """

    def __init__(self, fn: Callable[..., Sequence[Tensor]], example_inputs: Sequence[Tensor],
                 params: Sequence[Tensor] = (), warmup: int = 3):
        self.device = example_inputs[0].device
        self.check_device(self.device)
        self.fn, self.params, self.warmup = fn, list(params), warmup
        self.static_inputs = [x.detach().clone() for x in example_inputs]
        saved_grads = [p.grad for p in self.params]
        rng = self.get_rng_state()
        self._clear_grads()
        self.static_outputs = self._capture()
        self.grads = [p.grad for p in self.params]
        for p, g in zip(self.params, saved_grads, strict=True):
            p.grad = g
        self.set_rng_state(rng)

    # The CUDA-specific part: four small methods, so that tests can check everything else
    # on the CPU with an eager stand-in (tests/training/test_graphs.py).

    def check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need CUDA tensors; got {device}")

    def get_rng_state(self) -> Tensor:
        return torch.cuda.get_rng_state(self.device)

    def set_rng_state(self, state: Tensor) -> None:
        torch.cuda.set_rng_state(state, self.device)

    def _capture(self) -> tuple[Tensor, ...]:
        """Warm up on a side stream (Triton compiles, cuBLAS picks kernels), then capture."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._clear_grads()
                self.fn(*self.static_inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._clear_grads()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            outputs = tuple(self.fn(*self.static_inputs))
        return outputs

    def _replay(self) -> None:
        self.graph.replay()

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        for static, x in zip(self.static_inputs, inputs, strict=True):
            static.copy_(x, non_blocking=True)
        self._replay()
        for p, g in zip(self.params, self.grads, strict=True):
            p.grad = g
        return self.static_outputs


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
        return True, "on: each window's forward and backward replayed from a CUDA graph"
    if mode == "on":
        raise UsageError(f"--cuda-graphs on is not possible here: {why_not}; pass --cuda-graphs auto")
    return False, f"off ({why_not})"


class WindowStep:
    """`fn(x, y, h0, c0) -> (loss, h, c)` for one TBPTT window, replayed from CUDA graphs.

    fn is the trainer's forward + loss + backward (`zlm.training.trainer.forward_backward`),
    leaving gradients in `param.grad` of `params`. With `graphs` off it is simply called;
    with graphs on, each window shape is captured once and replayed after (shapes beyond
    MAX_SHAPES run eagerly). Either way the caller gets (loss, (h, c)) it owns.
    """

    capture = CapturedStep  # tests substitute an eager stand-in

    def __init__(self, fn: Callable[..., tuple[Tensor, Tensor, Tensor]], params: Sequence[Tensor],
                 graphs: bool = False):
        self.fn, self.params, self.graphs = fn, list(params), graphs
        self.captured: dict[tuple, CapturedStep] = {}
        self.replays = 0

    def __call__(self, x: Tensor, y: Tensor, state: tuple[Tensor, Tensor]):
        h0, c0 = state
        key = (tuple(x.shape), tuple(h0.shape))
        graph = self.captured.get(key) if self.graphs else None
        if graph is None and self.graphs and len(self.captured) < MAX_SHAPES:
            graph = self.captured[key] = self.capture(self.fn, (x, y, h0, c0), self.params)
        if graph is None:
            loss, h, c = self.fn(x, y, h0, c0)
            return loss, (h, c)
        loss, h, c = graph(x, y, h0, c0)
        self.replays += 1
        return loss.clone(), (h.clone(), c.clone())

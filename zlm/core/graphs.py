"""CUDA graphs: a function of fixed-shape tensors captured once, replayed after.

Small steps are launch-bound on a GPU: a training window launches a few kernels per
timestep, a sampling step ~20 small ops per layer, each costing a few microseconds of CPU
time while the GPU finishes it in less. `CapturedStep` records such a function once into a
CUDA graph and replays it with one launch; `WindowStep` keeps one per window shape of a
sequence. Training steps (`zlm.training.step`) and evaluation windows
(`zlm.core.eval_protocol`) use `WindowStep`, the sampling step (`zlm.inference.stepper`)
`CapturedStep`.

Rules the captured function keeps: no host synchronisation (no .item(), no data-dependent
Python branches), fixed shapes, and memory it writes outside its own allocations stays
where it was (buffers, parameters). The global CUDA RNG state is restored after the
warm-up and capture, so the first replay draws what an eager call would have drawn (the
graph's RNG ops read the generator's seed and offset at each replay).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

MAX_SHAPES = 4  # graphs kept per WindowStep (window shapes); others run eagerly

# snapshot() -> restore(): taken before a capture's warm-up, called after the capture, for
# a captured fn that changes state when run (a whole training step moves the weights).
Snapshot = Callable[[], Callable[[], None]]


class CapturedStep:
    """fn(*inputs) captured into one CUDA graph; calling copies inputs in and replays.

    fn may call backward: gradients of `params` are produced inside the graph (each
    parameter's .grad is None at capture, so the graph writes, not accumulates, them)
    and reattached to the parameters after every replay, so the caller can clip and
    step as usual and even set .grad to None in between. Outputs are the graph's static
    tensors, overwritten by the next replay: copy what must outlive it.
    """

    def __init__(self, fn: Callable[..., Sequence[Tensor]], example_inputs: Sequence[Tensor],
                 params: Sequence[Tensor] = (), warmup: int = 3, snapshot: Snapshot | None = None):
        self.device = example_inputs[0].device
        self.check_device(self.device)
        self.fn, self.params, self.warmup = fn, list(params), warmup
        self.static_inputs = [x.detach().clone() for x in example_inputs]
        saved_grads = [p.grad for p in self.params]
        rng = self.get_rng_state()
        restore = snapshot() if snapshot is not None else None
        self._clear_grads()
        self.static_outputs = self._capture()
        self.grads = [p.grad for p in self.params]
        for p, g in zip(self.params, saved_grads, strict=True):
            p.grad = g
        if restore is not None:  # undo what the warm-up calls changed (an optimizer's steps)
            restore()
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


class WindowStep:
    """`fn(x, y, h0, c0) -> (out, h, c)` for one window of a sequence, replayed from CUDA graphs.

    fn is a training step's forward + loss + backward (`zlm.training.step`, out the loss),
    leaving gradients in `param.grad` of `params`, or its whole step (out its numbers;
    `snapshot` then undoes the warm-up's updates), or an evaluation window's forward and
    summed loss (`zlm.core.eval_protocol`). With `graphs` off it is simply called; with
    graphs on, each window shape is captured once and replayed after (shapes beyond
    MAX_SHAPES run eagerly). With `fallback` (a name, e.g. "evaluation") a capture that
    raises warns and the rest runs eagerly; without, the error propagates. Either way the
    caller gets (out, (h, c)) it owns.
    """

    capture = CapturedStep  # tests substitute an eager stand-in

    def __init__(self, fn: Callable[..., tuple[Tensor, Tensor, Tensor]], params: Sequence[Tensor] = (),
                 graphs: bool = False, snapshot: Snapshot | None = None, fallback: str | None = None):
        self.fn, self.params, self.graphs, self.snapshot = fn, list(params), graphs, snapshot
        self.fallback = fallback
        self.captured: dict[tuple, CapturedStep] = {}
        self.replays = 0

    def __call__(self, x: Tensor, y: Tensor, state: tuple[Tensor, Tensor]):
        h0, c0 = state
        key = (tuple(x.shape), tuple(h0.shape), h0.dtype)
        graph = self.captured.get(key) if self.graphs else None
        if graph is None and self.graphs and len(self.captured) < MAX_SHAPES:
            graph = self._capture(key, (x, y, h0, c0))
        if graph is None:
            loss, h, c = self.fn(x, y, h0, c0)
            return loss, (h, c)
        loss, h, c = graph(x, y, h0, c0)
        self.replays += 1
        return loss.clone(), (h.clone(), c.clone())

    def _capture(self, key: tuple, inputs: tuple) -> CapturedStep | None:
        try:
            graph = self.captured[key] = self.capture(self.fn, inputs, self.params, snapshot=self.snapshot)
        except RuntimeError as e:
            if self.fallback is None:
                raise
            warnings.warn(f"{self.fallback} runs eagerly: a CUDA graph capture failed ({e})", stacklevel=3)
            self.graphs = False
            return None
        return graph

"""One training step: what the Trainer runs every step and the speed probe times.

`TrainStep` is one optimizer step on one TBPTT window: forward, loss and backward
(`forward_backward`), clipping, one all-reduce of the loss and the non-finite flag, and the
optimizer - nothing read back to the host. With CUDA graphs it is replayed from a graph:
the window's forward and backward only ("window"), or the whole step ("step") when the
optimizer can be captured (fused Adam/AdamW, the learning rate a device tensor the schedule
fills before each replay). The eager step is the reference (tests/training/test_step.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from zlm.core.config import TrainConfig
from zlm.core.graphs import WindowStep
from zlm.model.lm import State, training_nll

STEP_MODES = ("off", "window", "step")  # what a CUDA graph replays: nothing, forward+backward, all


def forward_backward(model, runtime, scaler, x, y, h0, c0, *, cache: bool = True, fault=None, step: int = 0):
    """(T, B) inputs and targets, state (L, B, H) -> (mean nats per token, h_T, c_T).

    Gradients are left in param.grad (scaled when fp16's scaler is on). The state
    returned is detached fp32. This is what `WindowStep` captures into a CUDA graph
    (cache=False there: autocast's weight cache must not outlive the capture).
    """
    with runtime.autocast(cache=cache):
        logits, (h, c) = model(x, (h0, c0))  # (T, B, V)
    loss = training_nll(logits, y) / y.numel()  # mean nats per token, fp32
    if fault is not None:
        loss = fault(step, loss)
    scaler.scale(loss).backward()
    return loss.detach(), h.detach().float(), c.detach().float()


def build_optimizer(cfg: TrainConfig) -> tuple[type, dict]:
    """The optimizer class and its keyword arguments (ZeRO wraps the same pair).

    Fused: one kernel per step, and it takes a `found_inf` flag tensor that skips the
    update on the device (parameters, moments and step count unchanged), so a non-finite
    step needs no host read to be skipped (`TrainStep`). Fused Adam keeps its step counters
    on the device, so its whole step can be captured in a CUDA graph (`step_mode`)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD, dict(lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay, fused=True)
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls, dict(lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)


def step_mode(graphs: bool, optimizer) -> str:
    """What a CUDA graph replays (STEP_MODES) when graphs are on or off for the run."""
    if not graphs:
        return "off"
    capturable = isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and all(
        g.get("fused", False) for g in optimizer.param_groups)
    return "step" if capturable else "window"


def describe_mode(mode: str) -> str:
    return {"off": "each step runs eagerly",
            "window": "each window's forward and backward replayed from a CUDA graph (the optimizer "
                      "outside it: SGD cannot be captured)",
            "step": "each whole step (forward, backward, clipping, optimizer) replayed from a CUDA graph",
            }[mode]


class TrainStep:
    """step(x, y, state, lr, number) -> ((4,) numbers on the device, final state).

    numbers: the mean loss over ranks, this rank's loss, the gradient norm (before
    clipping) and finite (1/0). A non-finite step is skipped on the device (the fused
    optimizer's `found_inf`, or fp16's GradScaler) and its carried state restarts from zero.

    mode (STEP_MODES): "off" runs eagerly; "window" replays forward and backward from a CUDA
    graph per window shape (`WindowStep`) and runs the rest eagerly; "step" replays all of
    it, with the learning rate a device tensor (float64 on the CPU, where that is bit-exact
    with a Python float; float32 on CUDA) and the parameters and optimizer state put back
    after the capture's warm-up steps, so the first replay is the run's first step.
    """

    def __init__(self, model, runtime, scaler, optimizer, par, clip: float, mode: str = "off", fault=None):
        if mode not in STEP_MODES:
            raise ValueError(f"unknown step mode {mode!r}")
        self.model, self.runtime, self.scaler, self.optimizer, self.par = model, runtime, scaler, optimizer, par
        self.clip = clip if clip > 0 else math.inf
        self.mode, self.fault, self.number = mode, fault, 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.lr: Tensor | None = None
        if mode == "step":
            device = runtime.device
            dtype = torch.float64 if device.type == "cpu" else torch.float32
            self.lr = torch.tensor(float(optimizer.param_groups[0]["lr"]), dtype=dtype, device=device)
            for g in optimizer.param_groups:
                g["lr"], g["capturable"] = self.lr, True
        fn = self._whole if mode == "step" else self._window
        self.graph = WindowStep(fn, self.params, graphs=mode != "off",
                                snapshot=self._snapshot if mode == "step" else None)

    def __call__(self, x: Tensor, y: Tensor, state: State, lr: float, number: int = 0) -> tuple[Tensor, State]:
        self.number = number  # for the fault hook (which turns graphs off)
        if self.lr is not None:
            self.lr.fill_(lr)  # read by the captured optimizer at replay
        else:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        if self.mode == "step":
            numbers, new_state = self.graph(x, y, state)
        else:
            loss, (h, c) = self.graph(x, y, state)
            numbers, h, c = self._update(loss, h, c)
            new_state = (h, c)
        self.optimizer.zero_grad(set_to_none=True)  # a replay reattaches its gradients
        return numbers, new_state

    def _window(self, x, y, h0, c0):
        return forward_backward(self.model, self.runtime, self.scaler, x, y, h0, c0,
                                cache=self.mode == "off", fault=self.fault, step=self.number)

    def _whole(self, x, y, h0, c0):
        return self._update(*self._window(x, y, h0, c0))

    def _update(self, loss: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Clip, agree on skipping, step: -> (numbers, h, c), all on the device."""
        par, opt = self.par, self.optimizer
        self.scaler.unscale_(opt)
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, self.clip).float()
        bad = (~(torch.isfinite(loss) & torch.isfinite(gnorm))).float()
        # One all-reduce: every rank takes the same skip decision (ZeRO's step is a
        # collective) and rank 0 logs the mean loss over all ranks' streams.
        summed = par.sum_(torch.stack([loss.float(), bad]))
        finite = summed[1] == 0
        if not self.scaler.is_enabled():  # the fp16 scaler sets found_inf itself
            local = par.local_optimizer(opt)
            local.grad_scale, local.found_inf = None, (~finite).float()
        self.scaler.step(opt)
        self.scaler.update()
        # A poisoned state restarts from zero, as a reset does.
        h, c = (torch.where(finite, t, torch.zeros_like(t)) for t in (h, c))
        numbers = torch.stack([summed[0] / par.world, loss.float(), gnorm, finite.float()])
        return numbers, h, c

    def _snapshot(self) -> Callable[[], None]:
        """The parameters and optimizer state as they are; the result puts them back (state
        the warm-up created is zeroed: for Adam that is a fresh state, step 0)."""
        opt = self.par.local_optimizer(self.optimizer)
        saved = [p.detach().clone() for p in self.params]
        saved_state = {id(p): {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
                       for p in self.params if p in opt.state}

        @torch.no_grad()
        def restore() -> None:
            for p, s in zip(self.params, saved, strict=True):
                p.copy_(s)
            for p in self.params:
                old = saved_state.get(id(p), {})
                for k, v in opt.state.get(p, {}).items():
                    if torch.is_tensor(v):
                        v.copy_(old[k]) if k in old else v.zero_()

        return restore

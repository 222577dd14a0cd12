"""One training step's parts: the window's forward, loss and backward (what `WindowStep`
may capture into a CUDA graph) and the optimizer - what the Trainer runs and the speed
probe times."""

from __future__ import annotations

import torch

from zlm.core.config import TrainConfig
from zlm.model.lm import token_nll


def forward_backward(model, runtime, scaler, x, y, h0, c0, *, cache: bool = True, fault=None, step: int = 0):
    """(T, B) inputs and targets, state (L, B, H) -> (mean nats per token, h_T, c_T).

    Gradients are left in param.grad (scaled when fp16's scaler is on). The state
    returned is detached fp32. This is what `WindowStep` captures into a CUDA graph
    (cache=False there: autocast's weight cache must not outlive the capture).
    """
    with runtime.autocast(cache=cache):
        logits, (h, c) = model(x, (h0, c0))  # (T, B, V)
    loss = token_nll(logits, y) / y.numel()  # mean nats per token, fp32
    if fault is not None:
        loss = fault(step, loss)
    scaler.scale(loss).backward()
    return loss.detach(), h.detach().float(), c.detach().float()


def build_optimizer(cfg: TrainConfig) -> tuple[type, dict]:
    """The optimizer class and its keyword arguments (ZeRO wraps the same pair).

    Fused: one kernel per step, and it takes a `found_inf` flag tensor that skips the
    update on the device (parameters, moments and step count unchanged), so a non-finite
    step needs no host read to be skipped (`Trainer.train_step`)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD, dict(lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay, fused=True)
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls, dict(lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)

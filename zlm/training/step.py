"""One training window's forward, loss and backward: what the Trainer runs, what
`WindowStep` may capture into a CUDA graph, and what the speed probe times."""

from __future__ import annotations

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

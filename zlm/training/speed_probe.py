"""The defaults rule's speed probe: training tokens/s of a model on this machine.

`zlm.training.plan` calls it for a run with a --time-budget, before the clock starts,
so the rule (`zlm.training.defaults.decide`) knows how much text the budget buys.
"""

from __future__ import annotations

import time

import torch

from zlm.core.config import TrainConfig
from zlm.core.precision import Runtime, resolve_device, resolve_precision
from zlm.model.cells import choose_cell
from zlm.model.lm import ModelConfig, ZoneoutLM
from zlm.training.step import forward_backward


def probe_tokens_per_s(model: ModelConfig, train: TrainConfig, seconds: float = 2.0,
                       on_event=None) -> float:
    """Training tokens/s of `model` on this machine: a few optimizer steps (Adam, clip,
    zoneout masks) on random tokens after one untimed step; the global RNG is left as found."""
    device = resolve_device(train.device, 0)
    runtime = Runtime(device, resolve_precision(device, train.precision))
    rng_state = torch.get_rng_state()
    try:
        cell = choose_cell(train.cell, device, on_event, zoneout=(model.zoneout_cell, model.zoneout_hidden))
        lm = ZoneoutLM(model, cell.fn).to(device)
        opt = torch.optim.Adam(lm.parameters(), lr=1e-4)
        x = torch.randint(model.vocab_size, (train.bptt + 1, train.batch_size), device=device)
        h0, c0 = lm.initial_state(train.batch_size, device)
        scaler = runtime.grad_scaler()

        def step():  # the trainer's window: forward, loss, backward; then clip and update
            forward_backward(lm, runtime, scaler, x[:-1], x[1:], h0, c0)
            torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

        step()
        n, t0 = 0, time.perf_counter()
        while n < 2 or time.perf_counter() - t0 < seconds:
            step()
            n += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return n * train.bptt * train.batch_size / (time.perf_counter() - t0)
    finally:
        torch.set_rng_state(rng_state)

"""The defaults rule's speed probe: training tokens/s of a model on this machine.

`zlm.training.plan` calls it for a run with a --time-budget, before the clock starts,
so the rule (`zlm.training.defaults.decide`) knows how much text the budget buys. It
times the step the run takes: the trainer's `TrainStep` (replayed from a CUDA graph where
the run would be), on random tokens, after untimed warm-up steps; the global RNG is left
as found.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from zlm.core.config import TrainConfig
from zlm.core.precision import Runtime, resolve_device, resolve_precision
from zlm.model.cells import choose_cell
from zlm.model.lm import ModelConfig, ZoneoutLM
from zlm.training.defaults import CUDA_BATCHES, GpuSpeeds
from zlm.training.distributed import Parallel
from zlm.training.graphs import graphs_unavailable_reason, resolve_graphs
from zlm.training.step import TrainStep, build_optimizer, step_mode


def probe_tokens_per_s(model: ModelConfig, train: TrainConfig, seconds: float = 2.0,
                       on_event=None) -> float:
    """Training tokens/s of `model` at `train`'s batch and window on its device."""
    device = resolve_device(train.device, 0)
    runtime = Runtime(device, resolve_precision(device, train.precision))
    rng_state = torch.get_rng_state()
    try:
        cell = choose_cell(train.cell, device, on_event, zoneout=(model.zoneout_cell, model.zoneout_hidden))
        lm = ZoneoutLM(model, cell.fn).to(device)
        opt_cls, opt_kw = build_optimizer(replace(train, lr=1e-4))
        opt = opt_cls(lm.parameters(), **opt_kw)
        scaler = runtime.grad_scaler()
        graphs, _ = resolve_graphs(train.cuda_graphs, graphs_unavailable_reason(
            runtime, cell.name, 1, scaler.is_enabled()))
        train_step = TrainStep(lm, runtime, scaler, opt, Parallel(), 1.0, mode=step_mode(graphs, opt))
        x = torch.randint(model.vocab_size, (train.bptt + 1, train.batch_size), device=device)
        state = lm.initial_state(train.batch_size, device)
        lm.train()

        def step():
            train_step(x[:-1], x[1:], state, 1e-4)

        for _ in range(3 if graphs else 1):  # graphs: warm-up and capture
            step()
        _sync(device)
        n, t0 = 0, time.perf_counter()
        while n < 2 or time.perf_counter() - t0 < seconds:
            step()
            n += 1
            if n % 10 == 0:
                _sync(device)
        _sync(device)
        return n * train.bptt * train.batch_size / (time.perf_counter() - t0)
    finally:
        torch.set_rng_state(rng_state)


def probe_gpu(model: ModelConfig, train: TrainConfig, batch: int | None = None, seconds: float = 1.0,
              on_event=None) -> GpuSpeeds:
    """The CUDA readings: the fused cell (as configured) at each of CUDA_BATCHES (or the
    given batch), and torch's LSTM on cuDNN (zoneout 0) beside it."""
    batches = (batch,) if batch is not None else CUDA_BATCHES
    fused = {b: probe_tokens_per_s(model, replace(train, batch_size=b, cell="fused"), seconds, on_event)
             for b in batches}
    plain_model = replace(model, zoneout_cell=0.0, zoneout_hidden=0.0)
    plain = {b: probe_tokens_per_s(plain_model, replace(train, batch_size=b, cell="plain"), seconds, on_event)
             for b in batches}
    return GpuSpeeds(fused, plain)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""Dynamic evaluation (Krause et al. 2018): adapt the weights to the text already scored.

Owns `DynamicAdapter` (a
private trainable copy of a loaded model and its update rule) and
`dynamic_score_predictions`, the dynamic counterpart of
`zlm.core.eval_protocol.evaluate_predictions` behind `zlm eval --dynamic`. `zlm compress --adapt`
(`zlm.inference.compress`) drives the same adapter, so both apply the same update.
`DynamicConfig` (--dynamic-lr, --dynamic-decay, --segment) and its defaults live in the
torch-free `zlm.inference.adapt_config`, so --help shows them at once; re-exported here.
With `--cache` too, each segment's predictions are mixed with the continuous cache
(`zlm.inference.cache.CacheScorer`) of the adapting model's states before they are scored;
the update still follows the model's own loss.

The text is cut into S parallel streams exactly as the static protocol cuts it, and read
in segments of N tokens (state carried, never reset). For each segment: predict all of
its tokens with the current weights theta (the loss of those predictions is the score),
then take one step on that segment's mean loss (gradient g, truncated at the segment's
start), so every prediction is made before the model learns from it. The update is the
paper's RMS-normalised step with a decay toward the trained weights theta_0 (eq. 8-9):

    MS     = mean over the segments so far of g**2                (per weight)
    rms    = sqrt(MS);  decrate = min(rms / mean(rms), 1 / decay) (mean over all weights)
    theta += -lr * g / (rms + eps) + decay * decrate * (theta_0 - theta)

One difference from the paper, on purpose: Krause et al. collect MS on the training
data; here MS is the running mean of the adapted text's own squared gradients (the
current segment's included). That needs no training data, so the decoder of
`zlm compress --adapt`, which has only the model, can compute the identical update.
The loaded model is never touched: the adapter works on a deep copy, in eval mode
(zoneout uses its expectation, dropout off), in fp32.

Defaults (lr 1e-3, decay 1e-3, segment 64): the best of a small grid on tiny
Shakespeare's valid split with the 1x512 model `zlm train` makes with its defaults in 10
minutes on a loaded 2-core CPU (static 2.414 BPC; docs/inference.md, "Dynamic evaluation", has the
grid). That model is undertrained, and such a model gains most from large steps; a
well-trained one may prefer a smaller --dynamic-lr.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from zlm.core.eval_protocol import EvalProtocol, _windows, warm_states
from zlm.inference.adapt_config import (  # noqa: F401 (the defaults, re-exported)
    DEFAULT_DECAY,
    DEFAULT_LR,
    DEFAULT_SEGMENT,
    CacheConfig,
    DynamicConfig,
)
from zlm.inference.cache import CacheScorer
from zlm.model.lm import ZoneoutLM

EPS = 1e-8  # added to rms in the step's denominator


class DynamicAdapter:
    """A trainable private copy of `model` that takes one step per segment."""

    def __init__(self, model: ZoneoutLM, config: DynamicConfig):
        self.config = config
        self.model = copy.deepcopy(model).float().eval()
        self.params = [p for p in self.model.parameters()]
        for p in self.params:
            p.requires_grad_(True)
        self.theta0 = [p.detach().clone() for p in self.params]
        self.sq_sum = [torch.zeros_like(p) for p in self.params]  # sum of g**2
        self.updates = 0

    def forward(self, inputs: Tensor, targets: Tensor, state) -> tuple[Tensor, tuple]:
        """inputs/targets: (T, B) int64 (targets -100: not scored) -> per-token nats (T, B)
        with a graph to the weights, and the final state (detached)."""
        nll, _, state = self.forward_features(inputs, targets, state)
        return nll, state

    def forward_features(self, inputs: Tensor, targets: Tensor, state) -> tuple[Tensor, Tensor, tuple]:
        """`forward`, and the states the decoder read (T, B, H), detached."""
        if state is not None:
            state = (state[0].detach(), state[1].detach())
        x, new_state = self.model.features(inputs, state)
        logits = self.model.decoder(x)  # (T, B, V)
        nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                              reduction="none", ignore_index=-100).view_as(targets)  # (T, B)
        return nll, x.detach(), (new_state[0].detach(), new_state[1].detach())

    def step(self, nll: Tensor, count: int) -> None:
        """One update from the mean of `nll` over its `count` scored tokens."""
        for p in self.params:
            p.grad = None
        (nll.sum() / max(count, 1)).backward()
        self.apply([p.grad for p in self.params])

    @torch.no_grad()
    def apply(self, grads: list[Tensor]) -> None:
        """theta += -lr g / (rms + eps) + decay * decrate * (theta_0 - theta)."""
        cfg = self.config
        self.updates += 1
        rms = []
        for s, g in zip(self.sq_sum, grads, strict=True):
            s.addcmul_(g, g)
            rms.append((s / self.updates).sqrt_())
        mean_rms = torch.cat([r.flatten() for r in rms]).mean().clamp_min(1e-30)
        for p, p0, g, r in zip(self.params, self.theta0, grads, rms, strict=True):
            if cfg.decay > 0:
                rate = (r / mean_rms).clamp_(max=1.0 / cfg.decay).mul_(cfg.decay)
                pull = (p0 - p).mul_(rate)
            else:
                pull = None
            p.addcdiv_(g, r.add_(EPS), value=-cfg.lr)
            if pull is not None:
                p.add_(pull)

    def score(self, inputs: Tensor, targets: Tensor, state, count: int,
              cache: CacheScorer | None = None) -> tuple[float, tuple]:
        """Predict a segment (its summed nats) with the current weights, then learn from it.
        cache: the segment's score is the cache's mixture with these predictions; the
        update still follows the model's own loss."""
        with torch.enable_grad():
            nll, x, state = self.forward_features(inputs, targets, state)
            log_p = -nll.detach()
            nats = -float(log_p.double().sum()) if cache is None else cache(x, log_p, targets)
            self.step(nll, count)
        return nats, state


def dynamic_score_predictions(model: ZoneoutLM, tokens: np.ndarray, runtime,
                              protocol: EvalProtocol, config: DynamicConfig,
                              cache: CacheConfig | None = None) -> tuple[float, int]:
    """Dynamic counterpart of `evaluate_predictions`: summed nats over the N-1 predictions of
    `tokens` (N,), and their count. Same streams as the static protocol; windows are
    `config.segment` tokens (protocol.bptt is not used); the last stream's remainder is
    scored after the parallel part, still adapting. cache: each prediction is also mixed
    with the continuous cache of the adapting model's states (`zlm eval --dynamic --cache`)."""
    n = len(tokens) - 1
    if n < 1:
        return 0.0, 0
    adapter = DynamicAdapter(model, config)
    S = protocol.streams_for(n)
    L = n // S
    dev = runtime.device
    scorer = None if cache is None else CacheScorer(S, model.config.hidden, cache, dev)
    nats = 0.0
    state = warm_states(model, tokens, np.arange(S) * L, protocol, runtime, config.segment)
    for inputs, targets in _windows(tokens, np.arange(S) * L, L, config.segment, dev):
        more, state = adapter.score(inputs, targets, state, targets.numel(), scorer)
        nats += more
    tail = n - S * L
    if tail:
        state = (state[0][:, -1:].contiguous(), state[1][:, -1:].contiguous())
        if scorer is not None:
            scorer.keep_last()
        for inputs, targets in _windows(tokens, np.array([S * L]), tail, config.segment, dev):
            more, state = adapter.score(inputs, targets, state, targets.numel(), scorer)
            nats += more
    return nats, n

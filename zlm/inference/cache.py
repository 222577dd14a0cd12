"""The continuous cache (Grave et al. 2017, "Improving Neural Language Models with a
Continuous Cache"): predictions that lean on what the text itself just said.

Owns `ContinuousCache` (the memory of each stream's recent states and what followed them)
and its readable reference `cache_probability_reference`; `SwitchingShare` (the cache's
share, chosen as the text goes); `CacheScorer` (both, for one set of streams: what
`zlm eval --cache`, `zlm eval --dynamic --cache` and `zlm score --cache` score with); and
`cache_score_predictions`, the cached counterpart of
`zlm.core.eval_protocol.evaluate_predictions` (with the model's own score from the same
pass). `CacheConfig` (--cache-size, --cache-theta,
--cache-lambda) and the defaults live in the torch-free `zlm.inference.adapt_config`.

The model reads the text exactly as the static protocol does (the same streams and windows,
state carried, never reset). Each stream remembers, for its last `size` positions i, the
vector h_i the decoder read there and the token that followed. The next token's
probability mixes the model's with the cache's:

    p_cache(w) = sum over remembered i with token_{i+1} = w of softmax_i(theta h_t . h_i)
    p(w)       = (1 - lambda) p_model(w) + lambda p_cache(w)

By default lambda is not one number: `SwitchingShare` mixes the predictions of the shares
CACHE_LAMBDAS by how well each did so far, moving CACHE_SWITCH_RATE of the weight back to
all of them after every step (fixed share), so the share follows the text. At a stream's
first position, where nothing is remembered, p is p_model. Every prediction uses only
tokens already scored, so the result is a fair score of the text, and the band of
remembered positions does not depend on the window length (--bptt moves it only by float
rounding). No weight changes: the cache costs one product of each window's states with the
remembered ones, where dynamic evaluation (`zlm eval --dynamic`) costs a backward pass per
segment.

Defaults (size 2000, theta 0.5, the switching share at rate 0.03): chosen on the valid
splits of two corpora with the models `zlm train FILE --time-budget 10m` makes; the grid,
and the test splits of those and two more corpora: docs/inference.md, "The continuous cache".
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from zlm.core.eval_protocol import EvalProtocol, _windows, warm_states
from zlm.core.precision import Runtime
from zlm.inference.adapt_config import CACHE_LAMBDAS, CACHE_SWITCH_RATE, CacheConfig
from zlm.model.lm import NLL_BLOCK, ZoneoutLM


def cache_probability_reference(h: Tensor, targets: Tensor, config: CacheConfig) -> Tensor:
    """p_cache(target_t) for one stream, position by position: h (N, H) the decoder's inputs,
    targets (N,) the tokens that follow them -> (N,) float64, NaN where nothing is
    remembered yet (t = 0). The readable definition `ContinuousCache` is tested against."""
    h = h.double()
    out = torch.full((len(targets),), math.nan, dtype=torch.float64)
    for t in range(1, len(targets)):
        lo = max(0, t - config.size)
        weights = torch.softmax(config.theta * (h[lo:t] @ h[t]), dim=0)  # (t - lo,)
        out[t] = weights[targets[lo:t] == targets[t]].sum()
    return out


class ContinuousCache:
    """Each stream's last `config.size` states and the tokens that followed them."""

    def __init__(self, streams: int, hidden: int, config: CacheConfig, device):
        self.config = config
        self.keys = torch.zeros(streams, config.size, hidden, device=device)  # (B, W, H) fp32
        self.next = torch.full((streams, config.size), -1, dtype=torch.long, device=device)  # -1: empty

    def probability(self, h: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """h (T, B, H) the window's states, targets (T, B) the tokens that follow them ->
        p_cache(target) (T, B) and whether anything was remembered (T, B); then remembers
        the window. Position t of the window sees the stored positions and the window's
        own positions before t, the last `size` of them."""
        p, remembered, _ = self.distribution(h, targets, 0)
        return p, remembered

    def distribution(self, h: Tensor, targets: Tensor, vocab: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """`probability`, and p_cache over all `vocab` tokens (T, B, V) (None for vocab 0)."""
        W, T = self.config.size, h.shape[0]
        q = h.float().transpose(0, 1)  # (B, T, H)
        keys = torch.cat([self.keys, q], 1)  # (B, W + T, H): key k is the window's position k - W
        follow = torch.cat([self.next, targets.t()], 1)  # (B, W + T)
        k = torch.arange(W + T, device=h.device)
        t = torch.arange(T, device=h.device)[:, None]
        band = (k >= t) & (k < W + t)  # (T, W + T): the last W positions before t
        seen = band & (follow[:, None, :] >= 0)  # (B, T, W + T)
        scores = torch.bmm(q, keys.transpose(1, 2)).mul_(self.config.theta)  # (B, T, W + T)
        scores.masked_fill_(~seen, -math.inf)
        remembered = seen.any(-1)  # (B, T)
        scores.masked_fill_(~remembered[..., None], 0.0)  # softmax of nothing: masked out below
        weights = torch.softmax(scores, -1)
        p = (weights * (follow[:, None, :] == targets.t()[:, :, None])).sum(-1) * remembered
        full = None
        if vocab:
            index = follow.clamp_min(0)[:, None, :].expand_as(weights)  # empty slots weigh 0
            full = weights.new_zeros(*weights.shape[:2], vocab).scatter_add_(2, index, weights)
            full = (full * remembered[..., None]).transpose(0, 1)  # (T, B, V)
        self.keys, self.next = keys[:, -W:].contiguous(), follow[:, -W:].contiguous()
        return p.t(), remembered.t(), full

    def keep_last(self) -> None:
        """Keep only the last stream's memory (it alone continues over the text's tail)."""
        self.keys, self.next = self.keys[-1:].contiguous(), self.next[-1:].contiguous()


def mix(log_p: Tensor, p_cache: Tensor, remembered: Tensor, lam) -> Tensor:
    """log((1 - lam) p_model + lam p_cache) of each target, from log p_model (T, B), p_cache
    (T, B) and where anything was remembered (T, B; elsewhere log p_model). lam: a number,
    or a (K,) tensor of shares giving (T, B, K) in float64."""
    lam = torch.as_tensor(lam, dtype=torch.float64)
    log_p, p_cache = log_p.double(), p_cache.double()
    if lam.dim():
        log_p, p_cache, remembered = log_p[..., None], p_cache[..., None], remembered[..., None]
    mixed = torch.logaddexp(log_p + torch.log1p(-lam), p_cache.log() + lam.log())
    return torch.where(remembered, mixed, log_p)


class SwitchingShare:
    """The cache's share lambda chosen as the text goes: per stream, a mixture over
    CACHE_LAMBDAS whose weights follow each share's predictions so far (Bayes), with
    `rate` of the weight moved back to all shares evenly after every step, so the mixture
    can switch when the text does (fixed share, Herbster and Warmuth 1998). Its code length
    is never more than the best single share's in hindsight plus log K + (n - 1) log 1/(1 -
    rate) nats per stream of n predictions."""

    def __init__(self, streams: int, device, rate: float = CACHE_SWITCH_RATE,
                 lambdas: tuple[float, ...] = CACHE_LAMBDAS):
        self.lambdas = torch.tensor(lambdas, dtype=torch.float64, device=device)
        self.device = device
        K = len(lambdas)
        self.w = np.full((streams, K), 1.0 / K)  # each stream's weights over the shares, summing to 1
        self.keep, self.spread = 1.0 - rate, rate / K

    def score(self, log_p: Tensor, p_cache: Tensor, remembered: Tensor) -> Tensor:
        """log p(target) (T, B) float64 under the mixture; then the weights move on. A window
        of fewer streams than before continues the last of them (the text's tail)."""
        return self.run(log_p, p_cache, remembered)[0]

    def run(self, log_p: Tensor, p_cache: Tensor, remembered: Tensor) -> tuple[Tensor, Tensor]:
        """`score`, and the share each prediction had in effect (T, B): the weights' mean of
        the shares, since a mixture of (1 - lambda_k) p + lambda_k p_cache is (1 - mean) p +
        mean p_cache.

        Per step, with each share's probability of the target q_k = exp(each_k - m) scaled by
        the step's largest m (so nothing underflows): p = m + log sum_k w_k q_k, then
        w <- (1 - rate) w q / sum(w q) + rate / K. The loop runs in numpy on the host: a
        step is a few operations on (B, K) numbers, where torch's cost per call would be most
        of the time."""
        each = mix(log_p, p_cache, remembered, self.lambdas).cpu().numpy()  # (T, B, K)
        T, B, _ = each.shape
        top = each.max(-1)  # (T, B)
        q = np.exp(each - top[..., None])
        w = self.w[-B:]
        weights = np.empty_like(q)  # the weights in effect at each step
        total = np.empty((T, B))
        for t in range(T):
            weights[t] = w
            joint = w * q[t]
            total[t] = joint.sum(-1)
            w = joint * (self.keep / total[t])[:, None] + self.spread
        self.w = w
        out = torch.from_numpy(top + np.log(total)).to(self.device)
        return out, torch.from_numpy(weights @ self.lambdas.cpu().numpy()).to(self.device)


class CacheScorer:
    """A set of streams' memory and share: the cached nats of each window they score, from
    the model's log-probabilities and the states the decoder read (`zlm eval --cache`, and
    with `--dynamic` the adapting model's)."""

    def __init__(self, streams: int, hidden: int, config: CacheConfig, device):
        self.config = config
        self.cache = ContinuousCache(streams, hidden, config, device)
        self.switching = SwitchingShare(streams, device) if config.mix is None else None

    def nats(self, log_p: Tensor, p_cache: Tensor, remembered: Tensor) -> float:
        """Summed -log p(target) under the mixture, from `ContinuousCache.probability`'s parts."""
        if self.switching is None:
            return -float(mix(log_p, p_cache, remembered, self.config.mix).sum())
        return -float(self.switching.score(log_p, p_cache, remembered).sum())

    def __call__(self, h: Tensor, log_p: Tensor, targets: Tensor) -> float:
        """h (T, B, H) the window's states, log p_model(target) (T, B) -> summed cached nats;
        then remembers the window."""
        return self.nats(log_p, *self.cache.probability(h, targets))

    def log_probs(self, h: Tensor, log_p: Tensor, targets: Tensor) -> Tensor:
        """The mixture's log-probabilities of every token (T, B, V) float64 from the model's
        (T, B, V), with the share each prediction had in effect (`zlm score --cache`); its
        values at the targets are what `__call__` sums. Remembers the window."""
        at = log_p.gather(-1, targets[..., None]).squeeze(-1)  # (T, B)
        p_target, remembered, full = self.cache.distribution(h, targets, log_p.shape[-1])
        if self.switching is None:
            share = torch.full(at.shape, self.config.mix, dtype=torch.float64, device=at.device)
        else:
            share = self.switching.run(at, p_target, remembered)[1]
        share = share.where(remembered, torch.zeros((), dtype=torch.float64, device=at.device))[..., None]
        mixed = torch.logaddexp(log_p.double() + torch.log1p(-share), full.double().log() + share.log())
        return mixed.where(remembered[..., None], log_p.double())

    def keep_last(self) -> None:
        """Only the last stream goes on (the text's tail)."""
        self.cache.keep_last()


def token_log_probs(decoder, x: Tensor, targets: Tensor, block: int | None = NLL_BLOCK) -> Tensor:
    """log p_model(target) per position, (T, B) fp32, from the decoder's input x (T, B, H)
    over blocks of rows of at most `block` logits (`zlm.model.lm.blocked_nll`'s blocks)."""
    flat, tgt = x.flatten(0, 1), targets.flatten()
    rows = flat.shape[0]
    per = rows if block is None else max(1, block // decoder.out_features)
    parts = [-F.cross_entropy(decoder(flat[i:i + per]).float(), tgt[i:i + per], reduction="none")
             for i in range(0, rows, per)]
    return torch.cat(parts).view_as(targets)


def _windows_parts(model: ZoneoutLM, runtime: Runtime, windows, state, cache: ContinuousCache):
    """(log p_model, p_cache, remembered) of each window's targets, each (T, B), carrying the
    state and the cache; then the final state."""
    block = NLL_BLOCK if runtime.device.type == "cpu" else None
    for inputs, targets in windows:
        if state is None:
            state = model.initial_state(inputs.shape[1], runtime.device, model.embedding.weight.dtype)
        with runtime.autocast():
            x, state = model.features(inputs, state)
            log_p = token_log_probs(model.decoder, x, targets, block)
        yield (log_p, *cache.probability(x, targets))
    return state


@torch.no_grad()
def cache_parts(model: ZoneoutLM, tokens: np.ndarray, runtime: Runtime, protocol: EvalProtocol,
                config: CacheConfig, memory: ContinuousCache | None = None):
    """Window by window, (log p_model(target), p_cache(target), remembered), each (T, B), over
    the N-1 predictions of `tokens` (N,) or the protocol's sample of them: the static
    protocol's streams and windows, the last stream continuing over the remainder with its
    state and its memory. `mix` turns them into the score for any lambda. memory: the
    streams' `ContinuousCache` to read and fill (a new one by default)."""
    was_training = model.training
    model.eval()
    n = len(tokens) - 1
    if n >= 1:
        S = protocol.streams_for(n)
        L = n // S
        scored = protocol.per_stream(n)
        dev = runtime.device
        cache = memory or ContinuousCache(S, model.config.hidden, config, dev)
        state = warm_states(model, tokens, np.arange(S) * L, protocol, runtime)
        state = yield from _windows_parts(
            model, runtime, _windows(tokens, np.arange(S) * L, scored, protocol.bptt, dev), state, cache)
        tail = n - S * L if scored == L else 0
        if tail:
            cache.keep_last()
            last = (state[0][:, -1:].contiguous(), state[1][:, -1:].contiguous())
            yield from _windows_parts(
                model, runtime, _windows(tokens, np.array([S * L]), tail, protocol.bptt, dev), last, cache)
    model.train(was_training)


def cache_score_predictions(model: ZoneoutLM, tokens: np.ndarray, runtime: Runtime,
                            protocol: EvalProtocol, config: CacheConfig) -> tuple[float, int, float]:
    """Cached counterpart of `evaluate_predictions` (one process): summed nats over the
    predictions `cache_parts` scores, their count, and the model's own summed nats over the
    same predictions from the same pass (the plain score `zlm eval --cache` prints beside the
    cached one: `evaluate_predictions`' to float rounding, summed per token in float64)."""
    scorer = CacheScorer(protocol.streams_for(len(tokens) - 1), model.config.hidden, config, runtime.device)
    nats, count = 0.0, 0
    plain = torch.zeros((), dtype=torch.float64, device=runtime.device)
    for log_p, p_cache, remembered in cache_parts(model, tokens, runtime, protocol, config, scorer.cache):
        nats += scorer.nats(log_p, p_cache, remembered)
        plain -= log_p.double().sum()
        count += log_p.numel()
    return nats, count, float(plain)

"""The batched decode behind `zlm serve`: one row per generation, rows joining and leaving
between steps (continuous batching), on the decode path `zlm sample` runs.

Everything here runs on the engine's one model thread (`zlm.serve.engine`).

A `Stream` is one generation: the prime's ids, a torch.Generator seeded with the request's
seed, its own `Chooser` (`zlm.inference.sample`) and a stream decoder for the text. `Rows`
holds the active streams as the rows of one batch; `Rows.run` makes up to `steps` tokens
for every row (CHUNK, fewer for a large vocabulary: the logits of a run are kept for the
likelihood), each token one draw per row and ONE step of the model for all rows:

- the draw: rows with the same temperature and no top-k/top-p share one call of the C++
  inverse-CDF `draw` (the one `generate` calls); greedy rows one argmax; rows with top-k
  or top-p (or without the extension) call their own `Chooser`;
- the step: with the "decode" kernel (a CPU, an fp32 model, the compiled extension: what
  `zlm sample` runs) one call of the C++ `Decoder` over every row. Its state, the
  Stepper's h and c, holds the active rows in front: when rows join or leave, the kept
  rows' state and the new rows' are written there and h and c are re-viewed as (L, n, H)
  on the same storage (the Decoder reads the batch size from h at every step, and its
  buffers were sized for the capacity). With the other kernels ("cpp", "torch": no
  compiler, an fp64 model, CUDA) each stream steps its own batch-1 Stepper: exact, not
  batched.

Why a stream's tokens do not depend on the other rows: the Decoder sums each row in the
same order whatever the batch and its place in it (it takes 4 rows per pass over a weight
tile, each with its own accumulators; decoder.cpp); the draw
goes row by row, and a row's uniforms come from its own generator in the same blocks of
CHUNK that `generate` draws for one sample; the prime runs through the model alone
(batch 1), in `generate`'s windows. So a stream makes the tokens `generate` makes for
one sample with the same seed, precision and kernel (tests/serve/test_engine.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from zlm.inference.sample import CHUNK, PRIME_WINDOW, Chooser, SampleConfig
from zlm.inference.stepper import Stepper

Lane = Callable[[int, Tensor, Tensor], None]  # (step j, logits (n, V), tokens out (n,))
RING_ELEMENTS = 1 << 22  # logits kept for one run of steps at most (16 MB of fp32)


class Stream:
    """One generation's decode state: what the model thread keeps for one request."""

    def __init__(self, lm, cfg: SampleConfig, prime_ids: Tensor, seed: int, ext):
        dev = lm.runtime.device
        self.cfg, self.seed, self.prime_ids = cfg, seed, prime_ids
        self.gen = torch.Generator(device=dev).manual_seed(seed)
        self.chooser = ch = Chooser(cfg, lm.model.config.vocab_size, self.gen, 1, ext)
        fast = ch.ext is not None and ch.top_k is None and ch.top_p is None
        fast = fast and lm.model.decoder.weight.dtype == torch.float32
        self.lane = "greedy" if ch.greedy else "fast" if fast else "own"
        self.u = torch.empty(0, dtype=torch.float64, device=dev)  # drawn, not yet used
        self.decoder = lm.tokenizer.stream_decoder()
        self.produced = 0  # tokens made
        self.nats = 0.0  # -log p of them under the model (temperature 1, no truncation)
        self.text = ""  # made and not yet handed out (`take_text`)
        self.stepper: Stepper | None = None  # its own, when the kernel is not "decode"

    @property
    def remaining(self) -> int:
        return self.cfg.length - self.produced

    def uniforms(self, n: int) -> Tensor:
        """(n,) the next uniforms of this stream's generator, left unused until `advance`:
        drawn CHUNK at a time, as `Chooser.uniforms` draws them for one sample."""
        while self.u.numel() < n:
            fresh = torch.rand((CHUNK, 1), generator=self.gen, dtype=torch.float64, device=self.u.device)
            self.u = torch.cat([self.u, fresh.view(-1)])
        return self.u[:n]

    def advance(self, ids: list[int], nats: float) -> None:
        """Record the tokens of a burst: their text, likelihood, and the uniforms used."""
        self.text += "".join(map(self.decoder.feed, ids))
        if self.lane == "fast":
            self.u = self.u[len(ids):]
        self.produced += len(ids)
        self.nats += nats
        if self.remaining == 0:
            self.text += self.decoder.flush()

    def take_text(self) -> str:
        text, self.text = self.text, ""
        return text


class Rows:
    """The active streams as the rows of one batch (see the module docstring)."""

    def __init__(self, lm, capacity: int, kernel: str = "auto"):
        self.lm, self.model = lm, lm.model
        dev, cfg = lm.runtime.device, lm.model.config
        self.capacity, self.kernel_choice = capacity, kernel
        self.lp = lm.runtime.precision == "bf16" and dev.type == "cpu"  # as `generate` decides
        probe = Stepper(self.model, 1, lp=self.lp, kernel=kernel)
        self.kernel, self.ext = probe.kernel, probe.ext
        self.batched = self.kernel == "decode"
        self.shared = Stepper(self.model, capacity, lp=self.lp, kernel=kernel) if self.batched else None
        self.spare: list[Stepper] = [] if self.batched else [probe]  # batch-1 Steppers to reuse
        self.V, self.L, self.H = cfg.vocab_size, cfg.layers, cfg.hidden
        dt = self.model.decoder.weight.dtype
        self.steps = max(8, min(CHUNK, RING_ELEMENTS // (capacity * self.V)))  # per run, at most
        self.ring_store = torch.empty((self.steps + 1) * capacity * self.V, dtype=dt, device=dev)
        self.tok_store = torch.zeros(self.steps * capacity, dtype=torch.long, device=dev)
        self.streams: list[Stream] = []
        if self.batched:
            self._view(0)

    def ring(self, n: int) -> Tensor:
        """(steps + 1, n, V): row j the logits of step j; row 0 is the next draw's (its
        rows keep their place whatever n is)."""
        return self.ring_store[: (self.steps + 1) * n * self.V].view(self.steps + 1, n, self.V)

    def current(self, n: int) -> Tensor:
        """(n, V) the logits of each row's next draw: ring(n)[0]."""
        return self.ring_store[: n * self.V].view(n, self.V)

    def tokens(self, n: int) -> Tensor:
        return self.tok_store[: self.steps * n].view(self.steps, n)

    @torch.no_grad()
    def prefill(self, prime_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Run a prime (P,) through the model alone, as `generate` does: the state (h, c),
        each (L, 1, H), and the first distribution (1, V)."""
        ids = prime_ids.to(self.lm.runtime.device)[:, None]  # (P, 1)
        state = None
        for a in range(0, ids.shape[0], PRIME_WINDOW):
            logits, state = self.model(ids[a : a + PRIME_WINDOW], state)
        return state[0], state[1], logits[-1].float()

    def regroup(self, keep: list[int], joining: list[tuple[Stream, tuple[Tensor, Tensor, Tensor]]]) -> None:
        """Keep the rows `keep` (indices, in order), then append the joining streams with
        their prefilled state; the kept rows' state and next logits move to the front."""
        k, n_old = len(keep), len(self.streams)
        if k == n_old and not joining:
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.ring_store.device)
        cur_keep = self.current(n_old).index_select(0, idx)
        if self.batched:
            h_keep, c_keep = self.shared.h.index_select(1, idx), self.shared.c.index_select(1, idx)
        for i in sorted(set(range(n_old)) - set(keep)):
            self._release(self.streams[i])
        self.streams = [self.streams[i] for i in keep] + [s for s, _ in joining]
        n = len(self.streams)
        cur = self.current(n)
        cur[:k] = cur_keep
        for i, (s, (h, c, logits)) in enumerate(joining):
            cur[k + i] = logits[0]
            if not self.batched:
                s.stepper = self.spare.pop() if self.spare else Stepper(self.model, 1, lp=self.lp,
                                                                       kernel=self.kernel_choice)
                s.stepper.set_state(h, c)
        if self.batched:
            self._view(n)
            self.shared.h[:, :k], self.shared.c[:, :k] = h_keep, c_keep
            for i, (_, (h, c, _)) in enumerate(joining):
                self.shared.h[:, k + i], self.shared.c[:, k + i] = h[:, 0], c[:, 0]

    def _view(self, n: int) -> None:
        """Re-view the shared Stepper's h and c as (L, n, H) on their own storage."""
        for t in (self.shared.h, self.shared.c):
            t.set_(t.untyped_storage(), 0, (self.L, n, self.H), (n * self.H, self.H, 1))

    def _release(self, s: Stream) -> None:
        if s.stepper is not None and len(self.spare) < self.capacity:
            self.spare.append(s.stepper)
        s.stepper = None

    def clear(self) -> None:
        self.regroup([], [])

    @torch.no_grad()
    def run(self, budget_s: float, stop: Callable[[], bool]) -> int:
        """Make tokens for every row until the budget is spent, `stop()` says so, `steps`
        tokens are made or a stream has all it asked for; returns the steps made."""
        n = len(self.streams)
        if n == 0:
            return 0
        steps = min(self.steps, min(s.remaining for s in self.streams))
        ring, toks = self.ring(n), self.tokens(n)
        lanes = self._lanes(steps, n)
        step = self._step_fn()
        end = time.perf_counter() + budget_s
        j = 0
        while j < steps:
            cur, out = ring[j], toks[j]
            for lane in lanes:
                lane(j, cur, out)
            step(out, ring[j + 1])
            j += 1
            if stop() or time.perf_counter() >= end:
                break
        self._record(j, n)
        return j

    def _record(self, steps: int, n: int) -> None:
        """Hand each stream its tokens and their log-likelihood; the next logits to row 0."""
        ring, toks = self.ring(n), self.tokens(n)
        t = toks[:steps]  # (steps, n)
        logp = torch.log_softmax(ring[:steps], -1).gather(2, t.unsqueeze(2)).squeeze(2)  # (steps, n)
        nats = (-logp.double().sum(0)).tolist()
        for s, ids, x in zip(self.streams, t.t().tolist(), nats, strict=True):
            s.advance(ids, x)
        ring[0].copy_(ring[steps])

    def _step_fn(self) -> Callable[[Tensor, Tensor], None]:
        if self.batched:
            return self.shared.decoder.step  # tokens (n,), out (n, V)
        steppers = [s.stepper for s in self.streams]

        def each(tok: Tensor, out: Tensor) -> None:
            for r, st in enumerate(steppers):
                st(tok[r : r + 1], out=out[r : r + 1])

        return each

    def _lanes(self, steps: int, n: int) -> list[Lane]:
        """The draws of one step, grouped (see the module docstring)."""
        fast: dict[float, list[int]] = {}
        greedy: list[int] = []
        lanes: list[Lane] = []
        for r, s in enumerate(self.streams):
            if s.lane == "fast":
                fast.setdefault(s.chooser.inv_t, []).append(r)
            elif s.lane == "greedy":
                greedy.append(r)
            else:
                lanes.append(_own_lane(r, s.chooser))
        for inv_t, rows in fast.items():
            u = torch.stack([self.streams[r].uniforms(steps) for r in rows], 1)  # (steps, G)
            lanes.append(self._fast_lane(inv_t, rows, u, n))
        if greedy:
            lanes.append(_greedy_lane(greedy, n, self.ring_store.device))
        return lanes

    def _fast_lane(self, inv_t: float, rows: list[int], u: Tensor, n: int) -> Lane:
        draw = self.ext.draw
        if len(rows) == n:
            return lambda j, cur, out: draw(cur, u[j], inv_t, True, out)
        idx = torch.tensor(rows, dtype=torch.long)
        buf = torch.empty(len(rows), self.V, dtype=torch.float32)
        got = torch.empty(len(rows), dtype=torch.long)

        def lane(j: int, cur: Tensor, out: Tensor) -> None:
            torch.index_select(cur, 0, idx, out=buf)
            draw(buf, u[j], inv_t, True, got)
            out.index_copy_(0, idx, got)

        return lane


def _greedy_lane(rows: list[int], n: int, device) -> Lane:
    if len(rows) == n:
        return lambda j, cur, out: torch.argmax(cur, -1, out=out)
    idx = torch.tensor(rows, dtype=torch.long, device=device)
    return lambda j, cur, out: out.index_copy_(0, idx, torch.argmax(cur.index_select(0, idx), -1))


def _own_lane(r: int, chooser: Chooser) -> Lane:
    return lambda j, cur, out: chooser(cur[r : r + 1], out=out[r : r + 1].view(1, 1))

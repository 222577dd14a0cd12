"""The coding loop `zlm compress` and `zlm decompress` both run, one step at a time.

Owns the stream layout (`Layout`), the one function that turns the model's logits into
integer frequencies (`quantize`), and `run_coder`, the loop shared by the two sides:

    inputs = rest_id for all S streams
    for t in 0 .. steps-1:
        logits = Stepper(inputs)                     (S, V), the model's eval-mode step
        cum    = quantize(logits)                    (S, K+1) int64, the same on both sides
        for s in active streams, in order:           one interleaved range coder
            encode symbol[t, s]  /  decode it        (+ 8 raw bits after an ESC)
        inputs = the symbols just coded (rest_id after an ESC or past a stream's end)
        --adapt: after each segment of N steps, one dynamic-evaluation update on the
        segment just coded (zlm.inference.dynamic), then the Stepper reloads the weights

The encoder knows every symbol in advance but never uses it before the decoder could:
both sides run this same loop with the same batch of S streams, the same kernels (the
`Stepper`'s "cpp" kernel, fp32, on the CPU) and THREADS threads, so each step's logits, and
so each frequency table, are bit-for-bit the same. Cold starts: every stream starts from
a zero state with rest_id as its input, as the decoder must.
"""

from __future__ import annotations

import contextlib
import math
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from zlm.inference.dynamic import DynamicAdapter, DynamicConfig
from zlm.inference.rangecoder import RangeDecoder, RangeEncoder
from zlm.inference.stepper import Stepper
from zlm.inference.symbols import Alphabet
from zlm.model.lm import ZoneoutLM

PROB_BITS = 16  # frequency tables total 2**16
ESC_FREQ = 1  # ESC's fixed count out of 2**16 (16 bits per escape, + 8 for its byte)
THREADS = 1  # torch threads while coding: part of the kernel path the decoder must match
MAX_STREAMS = 64
MIN_STREAM_SYMBOLS = 2048  # automatic layout: at least this many symbols per stream


def quantize(logits: np.ndarray, escape: bool) -> tuple[np.ndarray, np.ndarray]:
    """logits (S, V) float32 -> (cum (S, K+1) int64, p (S, V) float64), K = V (+1 for ESC).

    cum: cumulative integer frequencies; every symbol gets >= 1 count, the counts total
    exactly 2**PROB_BITS, and what flooring leaves over goes to each row's most likely
    token. p: the model's softmax in float64 (for its own code length). Both the encoder
    and the decoder call this on bit-identical logits, so they get identical tables.
    (numpy, not torch: a dozen small operations per step cost ~1 us each here.)
    """
    S, V = logits.shape
    mass = (1 << PROB_BITS) - (ESC_FREQ if escape else 0)  # for the V model tokens
    z = logits.astype(np.float64)  # (S, V)
    z -= z.max(1, keepdims=True)
    e = np.exp(z)
    p = e / e.sum(1, keepdims=True)  # (S, V)
    freq = np.floor(p * (mass - V)).astype(np.int64)
    freq += 1  # each >= 1, sum <= mass
    rows = np.arange(S)
    freq[rows, p.argmax(1)] += mass - freq.sum(1)
    cum = np.empty((S, V + 1 + escape), dtype=np.int64)
    cum[:, 0] = 0
    np.cumsum(freq, 1, out=cum[:, 1 : V + 1])
    if escape:
        cum[:, V + 1] = 1 << PROB_BITS
    return cum, p


@dataclass(frozen=True)
class Layout:
    """N symbols cut into S contiguous streams; the first N mod S streams are one longer."""

    symbols: int  # N
    streams: int  # S

    @staticmethod
    def choose(n: int, streams: int | None = None) -> Layout:
        """`--streams`, or automatically: one stream per MIN_STREAM_SYMBOLS, 1..MAX_STREAMS."""
        s = streams if streams else min(MAX_STREAMS, n // MIN_STREAM_SYMBOLS)
        return Layout(n, max(1, min(s, n)))

    @property
    def lengths(self) -> np.ndarray:  # (S,)
        L, r = divmod(self.symbols, self.streams)
        return np.array([L + (s < r) for s in range(self.streams)], dtype=np.int64)

    @property
    def steps(self) -> int:
        return -(-self.symbols // self.streams)

    def grid(self, flat: np.ndarray, fill) -> np.ndarray:
        """(N,) in text order -> (steps, S), stream s down column s; `fill` past its end."""
        out = np.full((self.steps, self.streams), fill, dtype=flat.dtype)
        start = 0
        for s, n in enumerate(self.lengths.tolist()):
            out[:n, s] = flat[start : start + n]
            start += n
        return out

    def flatten(self, grid: np.ndarray) -> np.ndarray:
        """The inverse of `grid`."""
        return np.concatenate([grid[:n, s] for s, n in enumerate(self.lengths.tolist())]
                              or [grid[:0, 0]])


class EncodeSide:
    """Knows every symbol; codes step t's column when the loop reaches it."""

    def __init__(self, sym: np.ndarray, esc: np.ndarray, layout: Layout, alphabet: Alphabet):
        self.sym = layout.grid(sym, -1)  # (steps, S), -1 past a stream's end
        self.esc = layout.grid(esc, 0)  # (steps, S)
        self.escaping = ((self.sym == alphabet.esc).any(1) if alphabet.escape
                         else np.zeros(layout.steps, dtype=bool)).tolist()
        self.active = (layout.lengths[None, :] > np.arange(layout.steps)[:, None]).sum(1).tolist()
        self.coder = RangeEncoder()
        self.esc_id = alphabet.esc

    def step(self, t: int, cum: np.ndarray) -> np.ndarray:
        a = self.active[t]
        col = self.sym[t]  # (S,)
        rows, k = np.arange(a), col[:a]
        lo, hi = cum[rows, k].tolist(), cum[rows, k + 1].tolist()
        if not self.escaping[t]:
            self.coder.encode_many(lo, hi, PROB_BITS)
            return col
        escs = self.esc[t].tolist()
        for s, sym in enumerate(k.tolist()):
            self.coder.encode(lo[s], hi[s], PROB_BITS)
            if sym == self.esc_id:
                self.coder.encode(escs[s], escs[s] + 1, 8)
        return col


class DecodeSide:
    """Learns each symbol as it decodes it, from the same tables."""

    def __init__(self, data: bytes, layout: Layout, alphabet: Alphabet):
        self.coder = RangeDecoder(data)
        self.active = (layout.lengths[None, :] > np.arange(layout.steps)[:, None]).sum(1).tolist()
        self.sym = np.full((layout.steps, layout.streams), -1, dtype=np.int64)
        self.esc = np.zeros((layout.steps, layout.streams), dtype=np.uint8)
        self.esc_id = alphabet.esc

    def step(self, t: int, cum: np.ndarray) -> np.ndarray:
        a, dec, out = self.active[t], self.coder, self.sym[t]
        for s, row in enumerate(cum[:a].tolist()):
            k = bisect_right(row, dec.target(PROB_BITS)) - 1
            dec.consume(row[k], row[k + 1])
            out[s] = k
            if k == self.esc_id:
                self.esc[t, s] = dec.decode_uniform(8)
        return out


@contextlib.contextmanager
def fixed_threads(n: int = THREADS):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def run_coder(model: ZoneoutLM, alphabet: Alphabet, layout: Layout, side,
              adapt: DynamicConfig | None = None, measure: bool = False,
              progress: Callable[[float], None] | None = None) -> float:
    """The shared loop (see the module docstring). side: `EncodeSide` or `DecodeSide`.
    Returns, with measure=True, the model's own code length in bits for the coded
    symbols: -log2 softmax for tokens, the quantised cost (+ 8 bits) for escapes."""
    S, esc, rest = layout.streams, alphabet.esc, alphabet.rest_id
    adapter = DynamicAdapter(model, adapt) if adapt is not None else None
    step = Stepper(adapter.model if adapter else model, S, kernel="cpp")  # the recorded kernel
    inp = np.full(S, rest, dtype=np.int64)  # (S,)
    rows = np.arange(S)
    chosen = np.ones((layout.steps, S))  # model probability of each coded token (1: none)
    n_esc = 0
    seg_in, seg_tg, start = [], [], (step.h.clone(), step.c.clone())
    for t in range(layout.steps):
        logits = step(torch.from_numpy(inp)).numpy()  # (S, V), overwritten next step
        cum, p = quantize(logits, alphabet.escape)
        col = side.step(t, cum)  # (S,) coded symbols, -1 = none
        plain = (col >= 0) & (col != esc)  # (S,) tokens the model predicted
        if measure:
            chosen[t] = np.where(plain, p[rows, np.clip(col, 0, p.shape[1] - 1)], 1.0)
            n_esc += int((col == esc).sum()) if alphabet.escape else 0
        nxt = np.where(plain, col, rest)
        if adapter is not None:
            seg_in.append(inp)
            seg_tg.append(np.where(plain, col, -100))
            if len(seg_in) == adapt.segment or t == layout.steps - 1:
                _update(adapter, step, seg_in, seg_tg, start)
                seg_in, seg_tg, start = [], [], (step.h.clone(), step.c.clone())
        inp = nxt
        if progress is not None and (t % 32 == 31 or t == layout.steps - 1):
            progress((t + 1) / layout.steps)
    if not measure:
        return 0.0
    return float(-np.log2(chosen).sum()) + n_esc * (PROB_BITS - math.log2(ESC_FREQ) + 8)


def _update(adapter: DynamicAdapter, step: Stepper, seg_in, seg_tg, start) -> None:
    """One dynamic-evaluation step on the segment just coded; the Stepper follows."""
    targets = torch.from_numpy(np.stack(seg_tg))  # (T, S)
    count = int((targets != -100).sum())
    if count == 0:
        return
    with torch.enable_grad():
        nll, _ = adapter.forward(torch.from_numpy(np.stack(seg_in)), targets, start)
        adapter.step(nll, count)
    step.load_weights(adapter.model)

"""The coding loop `zlm compress` and `zlm decompress` both run, one step at a time.

Owns the layout of a file into streams and blocks (`Layout`), the three small models mixed
with the LSTM's prediction (`EscapeModel`, `ContextModel`, `MatchModel`), the one function
that turns a distribution into integer frequencies (`quantize`) and `run_coder`, the loop
shared by the two sides:

    inputs = rest_id for all S streams
    for t in 0 .. steps-1:
        p   = softmax(Stepper(inputs))            (S, V) float64, the model's eval-mode step
        q   = [p (1 - e), e]                      (S, K) e: EscapeModel's P(ESC) per stream
        q   = ContextModel.mix(q)                 geometric mix with order-1..4 statistics
        q   = MatchModel.mix(q)                   the rows of streams with a match
        cum = quantize(q)                         (S, K+1) int64, the same on both sides
        for s in active streams, in order:        one interleaved range coder
            code symbol [t, s] (+ its byte after an ESC), unless its block is stored
        the three models learn the symbols of step t (stream by stream, in order)
        inputs = the symbols just coded (rest_id after an ESC or past a stream's end)
        --adapt: after each segment of N steps, one dynamic-evaluation update on the
        segment just coded (zlm.inference.dynamic), then the Stepper reloads the weights

Streams and blocks (`Layout`): the file's L bytes are cut into S streams of contiguous
bytes (stream k holds bytes [k L // S, (k+1) L // S)), each stream into blocks of at most
BLOCK_BYTES, of nearly equal size, at exact byte offsets (a character a cut splits is
escaped byte by byte). Each block is tokenized on its own (`Alphabet.encode`); a stream's
symbols are its blocks' symbols in order. A block is model-coded or stored (its bytes
copied into the file); either way its symbols go through the LSTM and the three models
exactly as if coded, so every prediction depends on the text alone, never on which blocks
were stored: the encoder runs the loop once, recording each symbol's interval, then
stores the blocks the model does not shrink, and the decoder, which reads the stored
blocks first, keeps the same states.

The encoder knows every symbol in advance but never uses it before the decoder could:
both sides run this same loop with the same batch of S streams, the same kernels (the
`Stepper`'s "decode" kernel on every core for static coding, its "cpp" kernel on THREADS
threads with dynamic evaluation; fp32, on the CPU) and the same float64
arithmetic in the same order (numpy's, and Python floats' + - * / in the learning
updates), so each step's frequency table is bit-for-bit the same. Cold starts: every stream starts from a
zero state with rest_id as its input, as the decoder must.

The escape model: P(ESC) for a stream's next symbol is an adaptive frequency in two
contexts (its previous symbol was an ESC or not), counted over all streams and updated
after each step; the LSTM's tokens share the rest. The escaped byte is coded uniformly,
or, when the match model predicted an escape, with its predicted byte favoured.

The context model (`ContextModel`): order-1..4 symbol counts over the text coded so far,
mixed geometrically with the base prediction by learned weights (its docstring).

The match model (as lpaq's): a hash of the last MIN_MATCH extended symbols of a stream
(an ESC and its byte are one extended symbol, see `Alphabet.extend`) -> the position that
followed that context last, over every position already coded in any stream. A match is
verified symbol by symbol (up to VERIFY back) and followed while it predicts right; its
expected symbol's probability is replaced by a logistic mix

    P = squash(w0 stretch(q(expected)) + w1 stretch(hit[len bucket]) + w2)

and the other symbols share 1 - P in q's proportions. hit[b] is the rate at which
matches of length bucket b (lengths MIN_MATCH .. MIN_MATCH+7, then doubling, 16 buckets)
predicted right, counted with a rate 1/(n + 1.5) (n capped at HIT_LIMIT); the weights
(one set for an expected token, one for an expected escaped byte) start at (1, 0, 0),
i.e. at q's own probability, and follow the gradient of the code length (rate MIX_LR).
"""

from __future__ import annotations

import array
import contextlib
import math
import zlib
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

PROB_BITS = 16  # every interval is out of 2**16
TOTAL = 1 << PROB_BITS
THREADS = 1  # torch threads while coding: part of the kernel path the decoder must match
MAX_STREAMS = 64
MIN_STREAM_BYTES = 2048  # automatic layout: at least this many bytes per stream ...
NEW_BYTES_PER_STREAM = 512  # ... and this many bytes of the input's zlib size
BLOCK_BYTES = 1 << 16  # a block: the unit that is model-coded or stored

ESC_LIMIT = 1 << 14  # the escape model halves its counts at this many symbols
ESC_MIN, ESC_MAX = 2.0**-16, 1 - 2.0**-7  # its P(ESC) stays within these

MIN_MATCH = {"char": 6, "byte": 6, "bpe": 3, "unigram": 3}  # context length, by tokenizer
VERIFY = 32  # a new match's length is counted back this far at most
BUCKETS = 16  # match-length buckets of the hit rates
HIT_LIMIT = 1023  # the hit rates' counts stop here (then rate ~1/1024)
MIX_LR = 0.02  # the mixing weights' step size
STRETCH_MAX = 12.0  # stretch(p) = ln(p / (1 - p)) is clipped to +-this
ORDERS = (1, 2, 3, 4)  # the context model's orders (extended symbols)
MAX_CONTEXT_SYMBOLS = 1024  # larger alphabets (subword tokenizers) have no context model
ALPHA = 0.05  # its additive smoothing
COUNT_LIMIT = 1023  # a row's counts are halved past this total
SETS = 6  # its weight sets: the bit length of the highest order's count, capped
MIX_LR_CONTEXT = 0.003  # its weights' step size
_MUL, _GOLD = 0x100000001B3, 0x9E3779B97F4A7C15  # the context hashes (mod 2**64)


def quantize(q: np.ndarray) -> np.ndarray:
    """q (S, K) float64, rows summing to 1 -> cum (S, K+1) int64 cumulative frequencies:
    every symbol gets >= 1 count, the counts total exactly 2**PROB_BITS, and what flooring
    leaves over goes to each row's most likely symbol. Both sides call this on identical q.
    (numpy, not torch: a dozen small operations per step cost ~1 us each here.)"""
    S, K = q.shape
    freq = np.floor(q * (TOTAL - K)).astype(np.int64)
    freq += 1
    freq[np.arange(S), q.argmax(1)] += TOTAL - freq.sum(1)
    cum = np.zeros((S, K + 1), dtype=np.int64)
    np.cumsum(freq, 1, out=cum[:, 1:])
    return cum


def softmax(logits: np.ndarray) -> np.ndarray:
    """(S, V) float32 logits -> (S, V) float64 probabilities."""
    z = logits.astype(np.float64)
    z -= z.max(1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(1, keepdims=True)


def byte_interval(v: int, expect: int, freq: int) -> tuple[int, int]:
    """The interval of escaped byte v out of 2**16: uniform (256 each) when expect < 0,
    else byte `expect` gets about `freq` and the other 255 share the rest evenly."""
    if expect < 0:
        return v << 8, (v + 1) << 8
    other = (TOTAL - freq) // 255
    mine = TOTAL - 255 * other
    if v < expect:
        return v * other, (v + 1) * other
    if v == expect:
        return expect * other, expect * other + mine
    lo = mine + (v - 1) * other
    return lo, lo + other


def _decode_byte(dec: RangeDecoder, expect: int, freq: int) -> int:
    target = dec.target(PROB_BITS)
    if expect < 0:
        v = target >> 8
    else:
        other = (TOTAL - freq) // 255
        mine = TOTAL - 255 * other
        if target < expect * other:
            v = target // other
        elif target < expect * other + mine:
            v = expect
        else:
            v = expect + 1 + (target - expect * other - mine) // other
    dec.consume(*byte_interval(v, expect, freq))
    return v


@dataclass(frozen=True)
class Layout:
    """L bytes cut into S streams of contiguous bytes, each into blocks (module docstring)."""

    length: int  # L
    streams: int  # S (0 for an empty file)

    @staticmethod
    def choose(data: bytes, streams: int | None = None) -> Layout:
        """`--streams`, or automatically: one stream per MIN_STREAM_BYTES of input and per
        NEW_BYTES_PER_STREAM of its zlib size, 1..MAX_STREAMS. Each stream starts cold and
        with the history the others have coded so far, so repetitive input (small zlib
        size) gains more from a long history than from parallel streams."""
        n = len(data)
        if n == 0:
            return Layout(0, 0)
        if not streams:
            novel = len(zlib.compress(data, 6))
            streams = min(MAX_STREAMS, n // MIN_STREAM_BYTES, novel // NEW_BYTES_PER_STREAM)
        return Layout(n, max(1, min(streams, n)))

    def blocks(self) -> list[tuple[int, int, int]]:
        """(stream, start, end) byte ranges of every block, stream by stream."""
        out = []
        for s in range(self.streams):
            a, z = s * self.length // self.streams, (s + 1) * self.length // self.streams
            nb = -(-(z - a) // BLOCK_BYTES)
            out += [(s, a + j * (z - a) // nb, a + (j + 1) * (z - a) // nb) for j in range(nb)]
        return out


def grid(columns: list[np.ndarray], fill: int) -> np.ndarray:
    """S columns of different lengths -> (steps, S) int32, `fill` past a column's end."""
    steps = max((len(c) for c in columns), default=0)
    out = np.full((steps, len(columns)), fill, dtype=np.int32)
    for s, c in enumerate(columns):
        out[: len(c), s] = c
    return out


class EscapeModel:
    """P(ESC) of each stream's next symbol: an adaptive frequency (e + 1/2) / (n + 1) in two
    contexts (the stream's previous symbol was an ESC or not), over all streams."""

    def __init__(self, streams: int):
        self.prev = np.zeros(streams, dtype=bool)  # (S,)
        self.n = [0, 0]
        self.e = [0, 0]

    def probs(self) -> np.ndarray:
        """(S,) float64."""
        p = [min(ESC_MAX, max(ESC_MIN, (e + 0.5) / (n + 1))) for e, n in zip(self.e, self.n, strict=True)]
        return np.where(self.prev, p[1], p[0])

    def learn(self, active: np.ndarray, escaped: np.ndarray) -> None:
        """active: (A,) stream indices; escaped: (A,) bool, their symbol was an ESC."""
        prev = self.prev[active]
        for c in (0, 1):
            here = prev == bool(c)
            self.n[c] += int(here.sum())
            self.e[c] += int((escaped & here).sum())
            if self.n[c] >= ESC_LIMIT:
                self.n[c] >>= 1
                self.e[c] >>= 1
        self.prev[active] = escaped


class ContextModel:
    """Order-k statistics mixed with the base prediction (the LSTM's with the escape model's
    P(ESC)): for each order k in ORDERS, counts of the symbol that followed each context of
    the stream's last k extended symbols (hashed into 2**bits rows per order, no collision
    check, a row halved when its total passes COUNT_LIMIT), smoothed as
    f_k = (c + ALPHA) / (n + ALPHA K). The mixture is geometric:

        q  ~  base^w0  f_1^w1 ... f_m^wm       (normalised over the K symbols)

    with one weight vector per confidence set (the bit length of the highest order's
    count, capped at SETS-1), starting at (1, 0, ..., 0) - the base prediction - and
    following the gradient of the code length (rate MIX_LR_CONTEXT), added stream by
    stream in order. Vectorised over the S streams in numpy float64, the same on both
    sides. Alphabets over MAX_CONTEXT_SYMBOLS (subword tokenizers) have no context model."""

    def __init__(self, lengths: np.ndarray, alphabet: Alphabet):
        self.K = K = alphabet.size
        S, n = len(lengths), int(lengths.sum())
        self.orders = ORDERS if K <= MAX_CONTEXT_SYMBOLS else ()
        bits = max(8, min(16, (2 * n).bit_length(), ((1 << 22) // K).bit_length() - 1))
        self.rows, self.shift = 1 << bits, np.uint64(64 - bits)
        m = len(self.orders)
        self.counts = np.zeros((m * self.rows, K), dtype=np.uint16)  # order i: rows i*R ..
        self.totals = np.zeros(m * self.rows, dtype=np.int64)
        self.offset = (np.arange(m, dtype=np.uint64) * np.uint64(self.rows))[:, None]  # (m, 1)
        self.last = np.zeros((S, max(self.orders, default=1)), dtype=np.uint64)  # ext + 1, newest first
        self.weights = np.zeros((SETS, 1 + m))
        self.weights[:, 0] = 1.0
        self.sets = np.array([1 << j for j in range(SETS - 1)])  # count >= 2**j: set j + 1
        self.idx = self.logs = self.q = self.set = None

    def mix(self, q: np.ndarray) -> np.ndarray:
        """q (S, K) the base prediction -> the mixture (S, K), rows summing to 1."""
        if not self.orders:
            return q
        S, m = q.shape[0], len(self.orders)
        h = np.zeros((m, S), dtype=np.uint64)
        acc = np.zeros(S, dtype=np.uint64)
        k = 0
        for i, order in enumerate(self.orders):
            while k < order:
                acc = acc * np.uint64(_MUL) + self.last[:, k]
                k += 1
            h[i] = acc
        self.idx = idx = (((h * np.uint64(_GOLD)) >> self.shift) + self.offset).astype(np.int64)  # (m, S)
        n = self.totals[idx]  # (m, S)
        logs = np.empty((1 + m, S, self.K))
        np.log(np.maximum(q, 1e-300), out=logs[0])
        np.log((self.counts[idx] + ALPHA) / (n + ALPHA * self.K)[:, :, None], out=logs[1:])
        self.set = np.searchsorted(self.sets, n[-1], side="right")  # (S,)
        z = np.einsum("si,isk->sk", self.weights[self.set], logs)
        z -= z.max(1, keepdims=True)
        out = np.exp(z)
        out /= out.sum(1, keepdims=True)
        self.logs, self.q = logs, out
        return out.copy()  # the match model mixes into the copy

    def learn(self, active: np.ndarray, x: np.ndarray, tok: np.ndarray) -> None:
        """active (A,) streams coded extended symbols x (A,), tokens tok (A,)."""
        if self.orders:
            logs, q = self.logs[:, active], self.q[active]  # (I, A, K), (A, K)
            grad = logs[:, np.arange(len(active)), tok] - np.einsum("ak,iak->ia", q, logs)  # (I, A)
            np.add.at(self.weights, self.set[active], MIX_LR_CONTEXT * grad.T)
            rows = self.idx[:, active].ravel()  # (m A,)
            np.add.at(self.counts, (rows, np.tile(tok, len(self.orders))), 1)
            np.add.at(self.totals, rows, 1)
            full = rows[self.totals[rows] > COUNT_LIMIT]
            if len(full):
                full = np.unique(full)
                self.counts[full] >>= 1
                self.totals[full] = self.counts[full].sum(1)
        self.last[active, 1:] = self.last[active, :-1]
        self.last[active, 0] = (x + 1).astype(np.uint64)


def _stretch(p: np.ndarray) -> np.ndarray:
    """ln(p / (1 - p)), clipped to +-STRETCH_MAX."""
    p = np.clip(p, 1e-12, 1.0 - 1e-12)
    return np.clip(np.log(p / (1.0 - p)), -STRETCH_MAX, STRETCH_MAX)


class MatchModel:
    """The longest earlier occurrence of each stream's recent context, and the mixer that
    folds its prediction into q (module docstring). Positions are in file order (stream
    s's symbol t is base[s] + t); a position is known once its step is coded. The mixing
    is vectorised over the step's streams (numpy float64); the learning runs stream by
    stream, in order (Python floats)."""

    def __init__(self, lengths: np.ndarray, alphabet: Alphabet):
        self.V, self.esc, self.escape = alphabet.vocab, alphabet.esc, alphabet.escape
        self.minlen = MIN_MATCH.get(alphabet.tokenizer.kind, 6)
        self.base = [0]
        for n in lengths.tolist():
            self.base.append(self.base[-1] + n)
        n = self.base[-1]
        self.hist = array.array("i", bytes(4 * n))  # extended symbols, filled as they are coded
        bits = max(12, min(22, (2 * n).bit_length()))
        self.shift = np.uint64(64 - bits)
        self.table = array.array("q", [-1]) * (1 << bits)  # context hash -> the position after it
        S = len(lengths)
        self.last = np.zeros((S, self.minlen), dtype=np.uint64)  # ext + 1, newest first
        self.ptr, self.len = [0] * S, [0] * S  # the match: predicted position, length
        self.slot = [0] * S  # hash slot of the context before the stream's next position
        self.expect = np.full(S, -1, dtype=np.int64)  # the extended symbol expected next
        self.weights = [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]  # expect a token | an escaped byte
        self.hit, self.hit_n = [0.5] * BUCKETS, [0] * BUCKETS
        self.byte_hit, self.byte_n = [0.5] * 4, [0] * 4  # the escaped byte, after a right ESC
        self.pending: dict[int, tuple] = {}

    def _known(self, q: int, t: int) -> bool:
        """Is position q coded once step t is?"""
        return q < len(self.hist) and q - self.base[bisect_right(self.base, q) - 1] <= t

    def _verify(self, j: int, end: int, s: int) -> int:
        """How many symbols before position j equal those before `end` (stream s's next
        position), counted back within both streams, at most VERIFY."""
        hist, lo_j = self.hist, self.base[bisect_right(self.base, j) - 1]
        limit = min(VERIFY, j - lo_j, end - self.base[s])
        n = 0
        while n < limit and hist[j - 1 - n] == hist[end - 1 - n]:
            n += 1
        return n

    def mix(self, active: np.ndarray, q: np.ndarray) -> tuple[list[int], list[int]]:
        """Mixes, in place, the row of q (S, K) of each active stream with a match (the
        rows no longer sum exactly to 1: normalise before use). Returns, per stream, the
        escaped byte the match expects (-1: none) and its frequency out of 2**16."""
        S = len(self.ptr)
        self.pending = {}
        rows = active[self.expect[active] >= 0]
        if not len(rows):
            return [-1] * S, [0] * S
        e = self.expect[rows]
        escaped = e >= self.V
        k = np.where(escaped, self.esc, e)
        d = np.array(self.len)[rows] - self.minlen
        b = np.where(d < 8, d, np.minimum(BUCKETS - 1, 4 + np.frexp(np.maximum(d, 1))[1]))
        pk = q[rows, k]
        x0 = _stretch(pk)
        x1 = _stretch(np.array(self.hit)[b])
        w = np.array(self.weights)[escaped.astype(np.int64)]  # (R, 3)
        P = 1.0 / (1.0 + np.exp(-np.clip(w[:, 0] * x0 + w[:, 1] * x1 + w[:, 2], -40.0, 40.0)))
        q[rows] *= ((1.0 - P) / np.maximum(1.0 - pk, 1e-12))[:, None]
        q[rows, k] = P
        expect_byte, byte_freq = np.full(S, -1, dtype=np.int64), np.zeros(S, dtype=np.int64)
        if escaped.any():
            r = rows[escaped]
            expect_byte[r] = e[escaped] - self.V
            f = np.array(self.byte_hit)[b[escaped] >> 2] * TOTAL
            byte_freq[r] = np.clip(f.astype(np.int64), 256, TOTAL - 255)
        for item in zip(rows.tolist(), e.tolist(), k.tolist(), b.tolist(), x0.tolist(),
                        x1.tolist(), P.tolist(), strict=True):
            self.pending[item[0]] = item[1:]
        return expect_byte.tolist(), byte_freq.tolist()

    def learn(self, t: int, active: np.ndarray, col: np.ndarray) -> None:
        """Step t's extended symbols col (S,) are coded: learn them, stream by stream."""
        hist, table, base, minlen = self.hist, self.table, self.base, self.minlen
        last = self.last
        last[active, 1:] = last[active, :-1]
        last[active, 0] = (col[active] + 1).astype(np.uint64)
        h = np.zeros(len(last), dtype=np.uint64)
        for j in range(minlen):
            h = h * np.uint64(_MUL) + last[:, j]
        slots = ((h * np.uint64(_GOLD)) >> self.shift).tolist()  # of the contexts ending here
        for s in active.tolist():
            x = int(col[s])
            i = base[s] + t
            hist[i] = x
            pend = self.pending.get(s)
            if pend is not None:
                e, k, b, x0, x1, P = pend
                tok = self.esc if x >= self.V and self.escape else x
                y = 1.0 if tok == k else 0.0
                w = self.weights[e >= self.V]
                g = MIX_LR * (y - P)
                w[0] += g * x0
                w[1] += g * x1
                w[2] += g
                self.hit[b] += (y - self.hit[b]) / (self.hit_n[b] + 1.5)
                self.hit_n[b] = min(HIT_LIMIT, self.hit_n[b] + 1)
                if e >= self.V and y:  # the ESC was right: was the byte?
                    c = b >> 2
                    self.byte_hit[c] += (float(x == e) - self.byte_hit[c]) / (self.byte_n[c] + 1.5)
                    self.byte_n[c] = min(HIT_LIMIT, self.byte_n[c] + 1)
                if x == e:
                    self.ptr[s] += 1
                    self.len[s] += 1
                else:
                    self.len[s] = 0
            if self.len[s] and not self._known(self.ptr[s], t):
                self.len[s] = 0
            if t >= minlen:
                table[self.slot[s]] = i
            if t + 1 >= minlen:
                self.slot[s] = slot = slots[s]
                if not self.len[s]:
                    j = table[slot]
                    if j >= 0:
                        n = self._verify(j, i + 1, s)
                        if n >= minlen:
                            self.ptr[s], self.len[s] = j, n
            self.expect[s] = hist[self.ptr[s]] if self.len[s] else -1


class EncodeSide:
    """Knows every symbol; records each interval (lo, hi) and its block in the order the
    decoder consumes them. `costs` prices the blocks, `payload` codes the chosen ones."""

    def __init__(self, ext: np.ndarray, block: np.ndarray, alphabet: Alphabet):
        self.ext = ext  # (steps, S) extended symbols, -1 past a stream's end
        self.block = block  # (steps, S) the block of each symbol
        self.V, self.esc, self.escape = alphabet.vocab, alphabet.esc, alphabet.escape
        self.lo: list[np.ndarray] = []
        self.width: list[np.ndarray] = []  # hi - lo - 1
        self.blk: list[np.ndarray] = []

    def step(self, t: int, active: np.ndarray, cum: np.ndarray, expect_byte, byte_freq) -> np.ndarray:
        col = self.ext[t]
        x, blk = col[active], self.block[t, active]
        escaped = x >= self.V if self.escape else np.zeros(len(x), dtype=bool)
        tok = np.where(escaped, self.esc, x)
        lo, hi = cum[active, tok], cum[active, tok + 1]
        if escaped.any():  # each ESC's byte interval right after it
            L, H, B = [], [], []
            for j, s in enumerate(active.tolist()):
                L.append(int(lo[j]))
                H.append(int(hi[j]))
                B.append(int(blk[j]))
                if escaped[j]:
                    a, z = byte_interval(int(x[j]) - self.V, expect_byte[s], byte_freq[s])
                    L.append(a)
                    H.append(z)
                    B.append(int(blk[j]))
            lo, hi, blk = np.array(L), np.array(H), np.array(B)
        self.lo.append(lo.astype(np.uint16))  # lo < 2**16 and 1 <= hi - lo <= 2**16:
        self.width.append((hi - lo - 1).astype(np.uint16))  # two bytes each
        self.blk.append(blk.astype(np.int32))
        return col

    def _all(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lo, hi, block) of every interval, int64, in coding order."""
        if not self.lo:
            z = np.zeros(0, dtype=np.int64)
            return z, z, z
        lo = np.concatenate(self.lo).astype(np.int64)
        return lo, lo + 1 + np.concatenate(self.width), np.concatenate(self.blk).astype(np.int64)

    def costs(self, blocks: int) -> np.ndarray:
        """(blocks,) float64: the bits each block's intervals cost the range coder."""
        lo, hi, blk = self._all()
        return np.bincount(blk, weights=PROB_BITS - np.log2(hi - lo), minlength=blocks)

    def payload(self, coded: np.ndarray) -> bytes:
        """The range coder's bytes for the intervals of the blocks with coded[block]."""
        lo, hi, blk = self._all()
        keep = coded[blk] if len(blk) else blk.astype(bool)
        if not keep.any():
            return b""
        enc = RangeEncoder()
        enc.encode_many(lo[keep].tolist(), hi[keep].tolist(), PROB_BITS)
        return enc.finish(compact=True)


class DecodeSide:
    """Learns each symbol of a model-coded block as it decodes it, from the same tables;
    the symbols of stored blocks are given."""

    def __init__(self, payload: bytes, ext: np.ndarray, coded: np.ndarray, alphabet: Alphabet):
        self.coder = RangeDecoder(payload, compact=True)
        self.ext = ext  # (steps, S): stored blocks' symbols filled in, -1 elsewhere
        self.coded = coded  # (steps, S) bool: decode this symbol
        self.V, self.esc = alphabet.vocab, alphabet.esc

    def step(self, t: int, active: np.ndarray, cum: np.ndarray, expect_byte, byte_freq) -> np.ndarray:
        out, coded, dec = self.ext[t], self.coded[t], self.coder
        rows = None
        for s in active.tolist():
            if not coded[s]:
                continue
            if rows is None:
                rows = cum.tolist()
            row = rows[s]
            k = bisect_right(row, dec.target(PROB_BITS)) - 1
            dec.consume(row[k], row[k + 1])
            if k == self.esc:
                k = self.V + _decode_byte(dec, expect_byte[s], byte_freq[s])
            out[s] = k
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
def run_coder(model: ZoneoutLM, alphabet: Alphabet, lengths: np.ndarray, side,
              adapt: DynamicConfig | None = None,
              progress: Callable[[float], None] | None = None, kernel: str = "cpp") -> np.ndarray:
    """The shared loop (see the module docstring) over S streams of lengths (S,) symbols.
    side: `EncodeSide` or `DecodeSide`. kernel: the Stepper's, as the file's header
    records it ("decode" or "cpp"). Returns the ideal code length of every symbol under
    the mixed prediction, (steps, S) float64 bits (0 past a stream's end): -log2 q for the
    token, + the quantised cost of an escaped byte."""
    lengths = np.asarray(lengths, dtype=np.int64)
    S = len(lengths)
    steps = int(lengths.max()) if S else 0
    bits = np.zeros((steps, S))
    if steps == 0:
        return bits
    V, esc, rest = alphabet.vocab, alphabet.esc, alphabet.rest_id
    escapes = EscapeModel(S) if alphabet.escape else None
    match = MatchModel(lengths, alphabet)
    context = ContextModel(lengths, alphabet)
    adapter = DynamicAdapter(model, adapt) if adapt is not None else None
    step = Stepper(adapter.model if adapter else model, S, kernel=kernel)  # the recorded kernel
    if step.kernel != kernel and not (kernel == "cpp" and step.kernel == "torch"):
        raise RuntimeError(f"the coder needs the Stepper's {kernel!r} kernel; this build runs {step.kernel!r}")
    inp = np.full(S, rest, dtype=np.int64)  # (S,)
    seg_in, seg_tg, start = [], [], (step.h.clone(), step.c.clone())
    for t in range(steps):
        active = np.flatnonzero(lengths > t)  # (A,)
        p = softmax(step(torch.from_numpy(inp)).numpy())  # (S, V)
        if escapes is None:
            q = p
        else:
            pe = escapes.probs()  # (S,)
            q = np.empty((S, V + 1))
            np.multiply(p, (1.0 - pe)[:, None], out=q[:, :V])
            q[:, V] = pe
        q = context.mix(q)
        expect_byte, byte_freq = match.mix(active, q)
        q /= q.sum(1, keepdims=True)
        cum = quantize(q)
        col = side.step(t, active, cum, expect_byte, byte_freq)  # (S,) extended, -1 = none
        x = col[active]
        escaped = (x >= V) if escapes is not None else np.zeros(len(x), dtype=bool)
        tok = np.where(escaped, esc, x)
        bits[t, active] = -np.log2(q[active, tok])
        if escapes is not None:
            for j in np.flatnonzero(escaped).tolist():
                s = int(active[j])
                lo, hi = byte_interval(int(x[j]) - V, expect_byte[s], byte_freq[s])
                bits[t, s] += PROB_BITS - math.log2(hi - lo)
            escapes.learn(active, escaped)
        context.learn(active, x, tok)
        match.learn(t, active, col)
        nxt = np.full(S, rest, dtype=np.int64)
        nxt[active] = np.where(escaped, rest, x)
        if adapter is not None:
            target = np.full(S, -100, dtype=np.int64)
            target[active] = np.where(escaped, -100, x)
            seg_in.append(inp)
            seg_tg.append(target)
            if len(seg_in) == adapt.segment or t == steps - 1:
                _update(adapter, step, seg_in, seg_tg, start)
                seg_in, seg_tg, start = [], [], (step.h.clone(), step.c.clone())
        inp = nxt
        if progress is not None and (t % 32 == 31 or t == steps - 1):
            progress((t + 1) / steps)
    return bits


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

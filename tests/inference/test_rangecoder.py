"""The 32-bit range coder: exact round trips, carries, truncation, and near-ideal size."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from zlm.inference.rangecoder import RangeDecoder, RangeEncoder


def _table(rng: random.Random, n: int, bits: int) -> list[int]:
    """Cumulative frequencies (n + 1,) summing to 2**bits, each symbol >= 1."""
    cuts = sorted(rng.sample(range(1, 1 << bits), n - 1))
    return [0, *cuts, 1 << bits]


def _roundtrip(symbols, tables, bits):
    enc = RangeEncoder()
    for s, cum in zip(symbols, tables, strict=True):
        enc.encode(cum[s], cum[s + 1], bits)
    data = enc.finish()
    dec = RangeDecoder(data)
    out = []
    for cum in tables:
        v = dec.target(bits)
        s = next(i for i in range(len(cum) - 1) if cum[i] <= v < cum[i + 1])
        dec.consume(cum[s], cum[s + 1])
        out.append(s)
    return out, data, dec


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 400), st.integers(2, 40), st.sampled_from([8, 12, 16]))
def test_roundtrip_random_tables(seed, n, alphabet, bits):
    rng = random.Random(seed)
    tables = [_table(rng, alphabet, bits) for _ in range(n)]
    symbols = [rng.randrange(alphabet) for _ in range(n)]
    out, _, dec = _roundtrip(symbols, tables, bits)
    assert out == symbols
    assert dec.overrun == 0


def test_skewed_symbols_force_carries_and_ff_runs():
    # Always the top symbol of a table where it has almost all the mass: low climbs
    # towards 2**32 and many carries through runs of 0xFF happen.
    bits = 16
    cum_hi = [0, 1, 1 << bits]  # symbol 1 has 65535/65536
    cum_lo = [0, 65535, 1 << bits]  # symbol 1 has 1/65536
    rng = random.Random(3)
    symbols, tables = [], []
    for _ in range(20_000):
        t = cum_hi if rng.random() < 0.97 else cum_lo
        tables.append(t)
        symbols.append(1)
    out, data, _ = _roundtrip(symbols, tables, bits)
    assert out == symbols


def test_encode_many_equals_encode():
    rng = random.Random(7)
    tables = [_table(rng, 5, 16) for _ in range(500)]
    syms = [rng.randrange(5) for _ in range(500)]
    a, b = RangeEncoder(), RangeEncoder()
    for s, c in zip(syms, tables, strict=True):
        a.encode(c[s], c[s + 1], 16)
    b.encode_many([c[s] for s, c in zip(syms, tables, strict=True)], [c[s + 1] for s, c in zip(syms, tables, strict=True)], 16)
    assert a.finish() == b.finish()


def test_uniform_bytes_and_size_near_ideal():
    rng = random.Random(11)
    raw = bytes(rng.randrange(256) for _ in range(5000))
    enc = RangeEncoder()
    for b in raw:
        enc.encode(b, b + 1, 8)
    data = enc.finish()
    assert len(data) <= len(raw) + 5
    dec = RangeDecoder(data)
    assert bytes(dec.decode_uniform(8) for _ in raw) == raw
    # Skewed source: size within 0.5% of the ideal code length (+ the 5-byte flush).
    tables = [_table(rng, 30, 16) for _ in range(3000)]
    syms = [rng.randrange(30) for _ in range(3000)]
    ideal = sum(-math.log2((c[s + 1] - c[s]) / 65536) for s, c in zip(syms, tables, strict=True)) / 8
    out, data, _ = _roundtrip(syms, tables, 16)
    assert out == syms and len(data) <= ideal * 1.005 + 5


def test_truncation_is_counted():
    rng = random.Random(5)
    tables = [_table(rng, 60, 16) for _ in range(300)]
    syms = [rng.randrange(60) for _ in range(300)]
    _, data, _ = _roundtrip(syms, tables, 16)
    dec = RangeDecoder(data[: len(data) // 2])
    for c in tables:
        v = dec.target(16)
        s = next(i for i in range(60) if c[i] <= v < c[i + 1])
        dec.consume(c[s], c[s + 1])
    assert dec.overrun > 0


def test_empty_stream():
    data = RangeEncoder().finish()
    assert len(data) == 5
    assert RangeDecoder(data).overrun == 0


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 300), st.integers(2, 40))
def test_compact_flush_drops_the_zero_bytes_and_decodes_the_same(seed, n, alphabet):
    """compact=True leaves out the first byte (always 0) and the trailing zeros; a compact
    decoder supplies them, so the symbols come back the same."""
    rng = random.Random(seed)
    tables = [_table(rng, alphabet, 16) for _ in range(n)]
    if n and rng.random() < 0.5:  # a run of the least likely symbol: long carries
        tables = [[0, 1, 1 << 16]] * n
    symbols = [rng.randrange(len(t) - 1) for t in tables]
    full = RangeEncoder()
    compact = RangeEncoder()
    for s, cum in zip(symbols, tables, strict=True):
        full.encode(cum[s], cum[s + 1], 16)
        compact.encode(cum[s], cum[s + 1], 16)
    data, small = full.finish(), compact.finish(compact=True)
    assert data[0] == 0
    assert small == data[1:].rstrip(b"\0")
    dec = RangeDecoder(small, compact=True)
    out = []
    for cum in tables:
        v = dec.target(16)
        s = next(i for i in range(len(cum) - 1) if cum[i] <= v < cum[i + 1])
        dec.consume(cum[s], cum[s + 1])
        out.append(s)
    assert out == symbols
    assert RangeEncoder().finish(compact=True) == b""

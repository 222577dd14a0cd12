"""Any byte string <-> the symbols `zlm compress` codes: model tokens plus an escape.

Owns `Alphabet`: how a file's bytes become a sequence of symbols in [0, K) and back,
exactly, for every tokenizer kind. Symbols 0..V-1 are the model's tokens; where the
tokenizer cannot represent the input, symbol V (ESC) is coded instead, followed by one
raw byte (coded uniformly, 8 bits) per ESC:

    byte      every byte is a token; no escape symbol (K = V = 256).
    char      each character of the vocabulary is its token; a character outside it,
              and every byte that is not valid UTF-8, becomes one ESC + byte per byte.
    bpe/      each run of valid UTF-8 is tokenized as a whole (byte fallback covers any
    unigram   character); bytes that are not valid UTF-8 are escaped one by one; a run
              whose tokens would not decode to exactly itself is escaped entirely.

The bytes are read as UTF-8 with Python's surrogateescape, so invalid bytes are lone
surrogates U+DC80..U+DCFF (never in a vocabulary trained on valid text) and
`text.encode("utf-8", "surrogateescape")` gives the original bytes back, always.
After an ESC the model is fed `rest_id` (a newline, or id 0 without one) as its input.

Extended symbols (`extend` / `split`) fold each ESC and its byte into one value, V + byte:
the match model of `zlm.inference.modelcoder` hashes and predicts these.
"""

from __future__ import annotations

import numpy as np

from zlm.data.tokenizers import Tokenizer, context_ids

_SURROGATES = (0xDC80, 0xDD00)  # where surrogateescape puts undecodable bytes


class Alphabet:
    """The coded alphabet of a tokenizer: V tokens (+ ESC), with bytes <-> symbols."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.vocab = tokenizer.vocab_size
        self.escape = tokenizer.kind != "byte"
        self.size = self.vocab + 1 if self.escape else self.vocab  # K
        self.esc = self.vocab if self.escape else -1
        ctx = context_ids(tokenizer)
        self.rest_id = int(ctx[-1]) if ctx is not None else 0  # first input; input after ESC
        if tokenizer.kind == "char":
            self._table = np.full(0x110000, -1, dtype=np.int64)  # code point -> id
            self._table[[ord(c) for c in tokenizer.chars]] = np.arange(self.vocab)
            self._utf8 = [c.encode("utf-8") for c in tokenizer.chars]  # id -> bytes

    # ------------------------------------------------------------------ bytes -> symbols

    def encode(self, data: bytes) -> tuple[np.ndarray, np.ndarray]:
        """data -> symbols (N,) int64 in [0, K) and escaped (N,) uint8: the raw byte where
        the symbol is ESC (0 elsewhere)."""
        kind = self.tokenizer.kind
        if kind == "byte":
            sym = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
            return sym, np.zeros(len(sym), dtype=np.uint8)
        text = data.decode("utf-8", "surrogateescape")
        if kind == "char":
            return self._encode_char(text)
        return self._encode_pieces(text)

    def _escaped(self, raw: bytes) -> tuple[np.ndarray, np.ndarray]:
        return (np.full(len(raw), self.esc, dtype=np.int64),
                np.frombuffer(raw, dtype=np.uint8).copy())

    def _encode_char(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        ids = self._table[cps]  # (C,) -1 where not in the vocabulary
        unknown = np.flatnonzero(ids < 0)
        if not len(unknown):
            return ids, np.zeros(len(ids), dtype=np.uint8)
        raw = [text[i].encode("utf-8", "surrogateescape") for i in unknown.tolist()]
        reps = np.ones(len(ids), dtype=np.int64)
        reps[unknown] = [len(r) for r in raw]
        sym = np.repeat(ids, reps)  # (N,) each unknown char spread over its bytes
        first = np.cumsum(reps) - reps  # where each character's symbols start
        at = np.concatenate([first[i] + np.arange(len(r)) for i, r in zip(unknown, raw, strict=True)])
        sym[at] = self.esc
        esc = np.zeros(len(sym), dtype=np.uint8)
        esc[at] = np.frombuffer(b"".join(raw), dtype=np.uint8)
        return sym, esc

    def _encode_pieces(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        syms, escs, run = [], [], []

        def flush():
            chunk = "".join(run)
            run.clear()
            if not chunk:
                return
            ids = self.tokenizer.encode(chunk)
            if self.tokenizer.decode(ids) == chunk:
                syms.append(ids.astype(np.int64))
                escs.append(np.zeros(len(ids), dtype=np.uint8))
            else:  # not lossless for this run: escape all of its bytes
                s, e = self._escaped(chunk.encode("utf-8", "surrogateescape"))
                syms.append(s)
                escs.append(e)

        for ch in _split_invalid(text):
            if len(ch) == 1 and _SURROGATES[0] <= ord(ch) < _SURROGATES[1]:
                flush()
                s, e = self._escaped(ch.encode("utf-8", "surrogateescape"))
                syms.append(s)
                escs.append(e)
            else:
                run.append(ch)
        flush()
        if not syms:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8)
        return np.concatenate(syms), np.concatenate(escs)

    # ------------------------------------------------------------------ symbols -> bytes

    def decode(self, sym: np.ndarray, esc: np.ndarray) -> bytes:
        """The inverse of `encode`: symbols (N,) and escaped bytes (N,) -> the original bytes."""
        kind = self.tokenizer.kind
        if kind == "byte":
            return np.asarray(sym, dtype=np.uint8).tobytes()
        sym_l, esc_l = np.asarray(sym).tolist(), np.asarray(esc).tolist()
        if kind == "char":
            utf8 = self._utf8
            return b"".join(utf8[s] if s != self.esc else bytes((e,))
                            for s, e in zip(sym_l, esc_l, strict=True))
        out, run = [], []
        for s, e in zip(sym_l, esc_l, strict=True):
            if s == self.esc:
                if run:
                    out.append(self.tokenizer.decode(run).encode("utf-8"))
                    run = []
                out.append(bytes((e,)))
            else:
                run.append(s)
        if run:
            out.append(self.tokenizer.decode(run).encode("utf-8"))
        return b"".join(out)

    # ------------------------------------------------- extended symbols (the match model's)

    def extend(self, sym: np.ndarray, esc: np.ndarray) -> np.ndarray:
        """(symbols, escaped bytes) -> extended symbols (N,) int64: a token is its id, an
        escaped byte b is V + b (so V + 256 values). What the match model remembers and
        predicts: an escape together with its byte."""
        if not self.escape:
            return np.asarray(sym, dtype=np.int64)
        return np.where(sym == self.esc, self.vocab + np.asarray(esc, dtype=np.int64), sym)

    def split(self, ext: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The inverse of `extend`: extended symbols -> (symbols, escaped bytes)."""
        ext = np.asarray(ext, dtype=np.int64)
        if not self.escape:
            return ext, np.zeros(len(ext), dtype=np.uint8)
        escaped = ext >= self.vocab
        return (np.where(escaped, self.esc, ext),
                np.where(escaped, ext - self.vocab, 0).astype(np.uint8))

    def model_inputs(self, sym: np.ndarray) -> np.ndarray:
        """What the model is fed after each symbol: the token, or rest_id after ESC."""
        return np.where(sym == self.esc, self.rest_id, sym) if self.escape else sym


def _split_invalid(text: str):
    """Runs of ordinary characters and single escaped bytes, in order (for subword models)."""
    start = 0
    for i, ch in enumerate(text):
        if _SURROGATES[0] <= ord(ch) < _SURROGATES[1]:
            if start < i:
                yield text[start:i]
            yield ch
            start = i + 1
    if start < len(text):
        yield text[start:]

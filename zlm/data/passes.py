"""The two streaming passes over a corpus that `zlm.data.prepare` makes, in bounded memory.

Owns how the source is seen as one stream of pieces (str chunks, or bytes for the byte
tokenizer), how positions are counted in the dataset's unit (characters, or bytes for
enwik8), and the passes themselves:

    scan   pass 1: units per part, SHA-256 of the content, the first position of every
           code point (char) or a bounded training sample (bpe/unigram);
    write  pass 2: cut the stream at the split boundaries, encode each piece, append the
           ids to <split>.bin; count tokens, characters and bytes per split.

Memory is a few chunks (default 4 MB of source) plus fixed tables, whatever the corpus size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
from collections.abc import Iterator

import numpy as np

from zlm.data import textio
from zlm.data.dataset import SPLITS
from zlm.data.tokenizers import CharTokenizer, Tokenizer, codepoints

SAMPLE_CHARS = 10_000_000  # sentencepiece trains on at most this much of the train split


@dataclasses.dataclass
class Plan:
    """What to read and how: the resolved source before any content is read."""

    parts: list[list[pathlib.Path]]  # one list (split by position) or three (by file)
    split: dict                      # {"kind": "fractions"|"counts"|"files", ...}
    kind: str
    fmt: str
    unit: str
    name: str | None
    unknown: str

    @property
    def files(self) -> list[pathlib.Path]:
        return [p for part in self.parts for p in part]



@dataclasses.dataclass
class Scan:
    """What pass 1 learned."""

    part_units: list[int]
    sha256: str
    first_pos: np.ndarray | None  # (0x110000,) int64: first position of each code point
    sample: str


def _first_positions(cps: np.ndarray, pos: int, seen: np.ndarray, first: np.ndarray) -> bool:
    """Record in `first` where each code point of `cps` (a chunk starting at stream
    position `pos`) not yet in `seen` first occurs; return whether there were any.

    Windows double in size: most distinct characters turn up in the first few KB, so the
    sort behind np.unique only ever sees a few positions.
    """
    found, start, width = False, 0, 1 << 14
    while start < cps.size:
        part = cps[start:start + width]         # (w,) code points
        new = np.flatnonzero(~seen[part])       # (k,) offsets of unseen ones
        if new.size:
            cp, at = np.unique(part[new], return_index=True)
            first[cp] = pos + start + new[at]
            seen[cp] = True
            found = True
        start, width = start + width, width * 2
    return found


def _may_have_new(piece: str, known: bytes, seen: np.ndarray) -> bool:
    """Cheap pre-check for pass 1: does `piece` hold a code point not in `seen`?

    Deleting the known ASCII bytes from the UTF-8 (C speed; ASCII bytes never occur
    inside a multi-byte sequence) leaves the unseen ASCII and all non-ASCII characters,
    usually a small remainder to look up.
    """
    rest = piece.encode("utf-8").translate(None, known)
    return bool(rest) and not seen[codepoints(rest.decode("utf-8"))].all()


def _characters(data: bytes) -> int:
    """Characters in UTF-8 bytes: every byte that is not a continuation byte (10xxxxxx)."""
    if data.isascii():
        return len(data)
    return len(data) - int(np.count_nonzero((np.frombuffer(data, np.uint8) >> 6) == 2))


class Passes:
    """The source as one stream of pieces (str, or bytes for the byte tokenizer)."""

    def __init__(self, plan: Plan, chunk_bytes: int, on_read):
        self.plan, self.chunk_bytes, self.on_read = plan, chunk_bytes, on_read
        self.raw = plan.kind == "byte" and plan.fmt == "text"
        self.by_byte = plan.unit == "byte"

    def pieces(self, files, hasher=None) -> Iterator[str | bytes]:
        if self.raw:
            return textio.iter_bytes(files, self.chunk_bytes, self.on_read, hasher)
        text = textio.iter_text(files, self.chunk_bytes, self.on_read, hasher, self.plan.fmt)
        if self.plan.kind == "byte":
            return (t.encode("utf-8") for t in text)
        return text

    def units(self, piece) -> int:
        if isinstance(piece, str) or self.by_byte:
            return len(piece)
        return _characters(piece)

    def cut(self, piece, k: int) -> int:
        """Index in `piece` where unit k starts (len(piece) if it has no more units)."""
        if isinstance(piece, str) or self.by_byte or k >= len(piece) or piece.isascii():
            return min(k, len(piece))
        leads = np.flatnonzero((np.frombuffer(piece, np.uint8) & 0xC0) != 0x80)
        return int(leads[k]) if k < leads.size else len(piece)

    def scan(self, want_sample: bool) -> Scan:
        """Pass 1: units per part, content hash, first positions / training sample."""
        hasher = hashlib.sha256()
        char = self.plan.kind == "char"
        seen = np.zeros(0x110000, dtype=bool)
        first = np.full(0x110000, np.iinfo(np.int64).max, dtype=np.int64) if char else None
        known = b""  # the ASCII characters in `seen`, as bytes to delete
        sample: list[str] = []
        sampled, pos, part_units = 0, 0, []
        for files in self.plan.parts:
            start = pos
            for piece in self.pieces(files, hasher):
                # Deleting the ASCII characters already seen is a C-speed test for new ones.
                if char and _may_have_new(piece, known, seen):
                    if _first_positions(codepoints(piece), pos, seen, first):
                        known = np.flatnonzero(seen[:128]).astype(np.uint8).tobytes()
                if want_sample and sampled < SAMPLE_CHARS:
                    sample.append(piece[:SAMPLE_CHARS - sampled])
                    sampled += len(sample[-1])
                pos += self.units(piece)
            part_units.append(pos - start)
        return Scan(part_units, hasher.hexdigest(), first, "".join(sample))

    def write(self, tok: Tokenizer, dtype, bounds, directory, unknown) -> dict:
        """Pass 2: encode each split into directory/<split>.bin; return its counts."""
        counts = {s: {"tokens": 0, "characters": 0, "bytes": 0} for s in SPLITS}
        files = {s: open(directory / f"{s}.bin", "wb") for s in SPLITS}
        pending = {s: [] for s in SPLITS}  # bpe/unigram: text up to the last newline
        try:
            pos = 0
            for piece in self.pieces(self.plan.files):
                if pos > 0 and isinstance(piece, bytes) and not self.by_byte:
                    # Bytes that open a chunk but continue the character before it belong
                    # to that character's split (also after the last boundary): as if whole.
                    n = _continuation_prefix(piece)
                    if n:
                        s = 0 if pos <= bounds[1] else 1 if pos <= bounds[2] else 2
                        self._emit(tok, dtype, SPLITS[s], piece[:n], files, counts, pending,
                                   unknown, last=False)
                        piece = piece[n:]
                while piece and pos < bounds[3]:
                    s = 0 if pos < bounds[1] else 1 if pos < bounds[2] else 2
                    take = self.cut(piece, bounds[s + 1] - pos)
                    head, piece = piece[:take], piece[take:]
                    pos += self.units(head)
                    self._emit(tok, dtype, SPLITS[s], head, files, counts, pending, unknown,
                               last=pos == bounds[s + 1])
        finally:
            for f in files.values():
                f.close()
        return counts

    def _emit(self, tok, dtype, split, head, files, counts, pending, unknown, last) -> None:
        c = counts[split]
        if isinstance(head, bytes):
            ids = np.frombuffer(head, dtype=np.uint8)                 # (n,) byte ids
            c["characters"] += _characters(head)
            c["bytes"] += len(head)
        else:
            c["characters"] += len(head)
            c["bytes"] += len(head) if head.isascii() else len(head.encode("utf-8"))
            if isinstance(tok, CharTokenizer):
                ids = tok.ids(head, unknown)                          # (n,) int32
            else:
                # Subword pieces never cross a newline: encode whole lines only, so the
                # result does not depend on where chunks happen to end.
                pending[split].append(head)
                text = "".join(pending[split])
                cut = len(text) if last else text.rfind("\n") + 1
                if cut == 0 and len(text) > 4 * self.chunk_bytes:
                    cut = len(text)  # no newline for a long stretch: bound the buffer
                pending[split] = [text[cut:]] if cut < len(text) else []
                ids = tok.encode(text[:cut], unknown)                 # (m,) int64
        files[split].write(np.ascontiguousarray(ids, dtype=dtype).data)
        c["tokens"] += int(ids.size)


def _continuation_prefix(piece: bytes) -> int:
    """How many UTF-8 continuation bytes (10xxxxxx) `piece` starts with."""
    n = 0
    while n < len(piece) and piece[n] & 0xC0 == 0x80:
        n += 1
    return n

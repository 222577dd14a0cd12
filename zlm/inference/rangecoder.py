"""A 32-bit range coder (arithmetic coding with bytewise renormalisation), in pure Python.

Owns `RangeEncoder` / `RangeDecoder` and nothing about models: a symbol is coded as an
interval [lo, hi) of integer cumulative frequencies out of a total of 2**bits
(bits <= 16). This is the carry-propagating coder of LZMA (Subbotin's range coder with
Schindler's cache): `low` is a 33-bit value whose carry is resolved through the cached
byte and a count of pending 0xFF bytes, `range` stays in [2**24, 2**32) between symbols.

    encode:  r = range >> bits;  low += r * lo;  range = r * (hi - lo)
    decode:  r = range >> bits;  v = code // r  (the symbol whose [lo, hi) holds v);
             code -= r * lo;  range = r * (hi - lo)
    both:    while range < 2**24: shift one byte, range <<= 8

Coding loss: the r * 2**bits <= range truncation wastes at most 2**bits / 2**24 of the
range per symbol (<= 2**-8 with 16-bit frequencies, ~2**-12 on average), i.e. well under
0.01 bits per symbol; `finish` adds 5 bytes (compact: the first byte, always 0, and
trailing zero bytes left out). A decoder that reads past the end of its input gets zero
bytes and counts them (`overrun`): with the full flush that reveals a truncation; with
compact=True the missing zeros are expected, and the length must be checked elsewhere.
"""

from __future__ import annotations

TOP = 1 << 24  # renormalise when range drops below this
MASK32 = 0xFFFFFFFF
MAX_BITS = 16  # frequency totals up to 2**16 keep r = range >> bits >= 2**8


class RangeEncoder:
    """Encodes intervals into bytes. Call `finish()` once, then read `.data`."""

    def __init__(self):
        self.low = 0  # < 2**33: bit 32 is a pending carry
        self.range = MASK32
        self.cache = 0  # the last byte not yet written (a carry may still change it)
        self.pending = 1  # bytes held back: `cache` plus pending-1 bytes of 0xFF
        self.out = bytearray()

    def _shift_low(self) -> None:
        low = self.low
        if low < 0xFF000000 or low > MASK32:
            carry = low >> 32
            self.out.append((self.cache + carry) & 0xFF)
            if self.pending > 1:
                self.out.extend(bytes(((0xFF + carry) & 0xFF,)) * (self.pending - 1))
            self.pending = 0
            self.cache = (low >> 24) & 0xFF
        self.pending += 1
        self.low = (low << 8) & MASK32

    def encode(self, lo: int, hi: int, bits: int) -> None:
        """Code the interval [lo, hi) of a total of 2**bits (0 <= lo < hi <= 2**bits)."""
        r = self.range >> bits
        self.low += r * lo
        self.range = r * (hi - lo)
        while self.range < TOP:
            self.range <<= 8
            self._shift_low()

    def encode_many(self, los: list[int], his: list[int], bits: int) -> None:
        """`encode` for each pair in order (the hot loop: locals, no attribute lookups)."""
        low, rng = self.low, self.range
        for lo, hi in zip(los, his, strict=True):
            r = rng >> bits
            low += r * lo
            rng = r * (hi - lo)
            while rng < TOP:
                rng <<= 8
                self.low = low
                self._shift_low()
                low = self.low
        self.low, self.range = low, rng

    def finish(self, compact: bool = False) -> bytes:
        """Flush: 5 shifts push out `low` and the held-back bytes. Returns all bytes; with
        compact=True without the first byte (always 0) and the trailing zero bytes, which
        a decoder made with compact=True supplies itself."""
        for _ in range(5):
            self._shift_low()
        if compact:
            return bytes(self.out[1:]).rstrip(b"\0")
        return bytes(self.out)

    @property
    def data(self) -> bytes:
        return bytes(self.out)


class RangeDecoder:
    """Decodes what `RangeEncoder` wrote: `target` -> find the symbol -> `consume`."""

    def __init__(self, data: bytes, start: int = 0, compact: bool = False):
        self.data = data
        self.pos = start
        self.overrun = 0  # bytes read past the end (returned as 0)
        self.range = MASK32
        self.code = 0
        self._r = 0
        for _ in range(4 if compact else 5):  # the first byte is the encoder's initial
            self.code = ((self.code << 8) | self._byte()) & MASK32  # cache, always 0

    def _byte(self) -> int:
        if self.pos < len(self.data):
            b = self.data[self.pos]
        else:
            b = 0
            self.overrun += 1
        self.pos += 1
        return b

    def target(self, bits: int) -> int:
        """The cumulative frequency in [0, 2**bits) the next symbol's interval contains."""
        self._r = self.range >> bits
        return min(self.code // self._r, (1 << bits) - 1)

    def consume(self, lo: int, hi: int) -> None:
        """Remove the decoded symbol's interval [lo, hi) (after `target`)."""
        r = self._r
        self.code -= r * lo
        self.range = r * (hi - lo)
        while self.range < TOP:
            self.code = ((self.code << 8) | self._byte()) & MASK32
            self.range <<= 8

    def decode_uniform(self, bits: int) -> int:
        """A symbol coded as [v, v + 1) of 2**bits (e.g. a raw byte with bits=8)."""
        v = self.target(bits)
        self.consume(v, v + 1)
        return v

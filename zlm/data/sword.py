"""SWORD Bible-software modules read without the SWORD library: blocks and plain text.

Owns `sword_blocks` (the zlib blocks of a zText/zCom module, in index order) and
`osis_to_text` (OSIS markup -> one line per paragraph). The benchmark's prose corpus
(`corpora/benchmark.json`, assembled by `zlm.data.benchmark_corpora`) is such a module.
"""

from __future__ import annotations

import html
import pathlib
import re
import struct
import zlib

from zlm.errors import DataError

_BREAK = re.compile(r"<div\b[^>]*\beID=[^>]*/>|</title>|</l>|<l\b[^>]*\beID=[^>]*/>"
                    r"|</item>|<lb\b[^>]*/>|</p>")
_NOTE = re.compile(r"<note\b.*?</note>", re.S)
_TAG = re.compile(r"<[^>]*>")
_SPACES = re.compile(r"[ \t\u00a0]+")


def osis_to_text(osis: str) -> str:
    """OSIS markup -> plain text: a line break where a paragraph, title, verse line or
    list item ends, notes and other tags dropped, entities decoded, spaces collapsed,
    one line per paragraph and no empty lines."""
    text = _TAG.sub("", _BREAK.sub("\n", _NOTE.sub("", osis)))
    lines = (_SPACES.sub(" ", html.unescape(line)).strip() for line in text.split("\n"))
    return "".join(line + "\n" for line in lines if line)


def sword_blocks(module: pathlib.Path, testament: str, ext: str) -> list[bytes]:
    """The decompressed blocks of a SWORD zText/zCom module's testament, in index order.

    The block index (`ot.bzs`, or `ot.czs` for commentaries) holds 12-byte entries
    (offset, compressed size, uncompressed size; little-endian uint32) into the zlib
    stream file (`ot.bzz` / `ot.czz`)."""
    index = (module / f"{testament}.{ext}s").read_bytes()
    data = (module / f"{testament}.{ext}z").read_bytes()
    blocks = []
    for i in range(0, len(index) - len(index) % 12, 12):
        offset, size, unpacked = struct.unpack_from("<III", index, i)
        try:
            block = zlib.decompress(data[offset:offset + size])
        except zlib.error:
            raise DataError(f"{module.name}/{testament}.{ext}z: block {i // 12} does not "
                            "decompress; the package is not the pinned one") from None
        if len(block) != unpacked:
            raise DataError(f"{module.name}/{testament}.{ext}z: block {i // 12} has "
                            f"{len(block)} bytes, its index says {unpacked}")
        blocks.append(block)
    return blocks

"""Reading corpus sources as streams of chunks, in bounded memory.

Owns everything between a SOURCE on disk and the text (or bytes) a tokenizer sees:

- which files a SOURCE names (`resolve_files`): one file, several, or a directory read
  recursively in sorted order of relative path (hidden files and folders skipped);
- reading them in fixed-size chunks (`iter_bytes`), gzip-decompressed when a file
  starts with the gzip magic bytes, a UTF-8 byte order mark at the start of each file
  stripped, NUL bytes and mostly-binary files refused (a UTF-16 or UTF-32 file, refused
  too, by an error that names its encoding and the command that converts it:
  `_wide_encoding`);
- strict incremental UTF-8 decoding (`iter_text`): a multi-byte character split across
  chunks decodes exactly as if read whole; invalid UTF-8 is a `DataError` naming the
  file and byte offset. Line endings are kept as they are (CRLF stays CRLF);
- source formats: "text" (as is) and "ptb-char" (Mikolov's PTB character files: one
  sentence per line, characters separated by spaces, `_` for a space; decoded into the
  real character stream with a newline ending each line).

Files are concatenated as they are, with nothing inserted between them.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import os
import pathlib
import re
import zlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from zlm.errors import DataError, UsageError

CHUNK_BYTES = 4 << 20
FORMATS = ("text", "ptb-char")
_BOM = b"\xef\xbb\xbf"
_GZIP_MAGIC = b"\x1f\x8b"
_CONTROL = np.ones(256, dtype=bool)  # bytes that do not occur in text
_CONTROL[32:] = False
_CONTROL[list(b"\t\n\v\f\r\x1b")] = False
_BINARY_FRACTION = 0.3  # more control bytes than this in the first 64 KB -> binary
_WIDE_BOMS = ((b"\xff\xfe\0\0", "UTF-32"), (b"\0\0\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
              (b"\xfe\xff", "UTF-16"))  # longest first: UTF-32LE's mark starts with UTF-16LE's; iconv reads the mark
_WIDE_NUL_SHARE = 0.1  # UTF-16 without a mark: NUL at this share of one parity's bytes (ASCII: spaces, newlines)
# and at almost none of the other's

OnRead = Callable[[int], None]  # called with the number of on-disk bytes just consumed


def resolve_files(source, names: Sequence[str] = ()) -> list[pathlib.Path]:
    """SOURCE (a path or a list of paths) -> the files to read, in reading order.

    names: corpus names to suggest when a path does not exist.
    """
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not items:
        raise UsageError("no SOURCE given; pass a text file, a directory or a corpus name")
    files: list[pathlib.Path] = []
    for item in items:
        path = pathlib.Path(item).expanduser()
        if path.is_dir():
            found = _walk(path)
            if not found:
                raise UsageError(f"{path}: directory has no files; pass a folder of text files")
            files += found
        elif path.is_file():
            files.append(path)
        elif path.exists():
            raise UsageError(f"{path}: not a regular file; pass a text file or a directory")
        else:
            hint = f" or a corpus name ({', '.join(names)})" if names else ""
            raise UsageError(f"{path}: no such file or directory; pass a text file, "
                             f"a directory{hint}")
    return files


def _walk(root: pathlib.Path) -> list[pathlib.Path]:
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [pathlib.Path(folder) / n for n in names if not n.startswith(".")]
    return sorted((p for p in found if p.is_file()), key=lambda p: p.relative_to(root).parts)


def disk_size(files: Sequence[pathlib.Path]) -> int:
    """Total on-disk bytes (compressed size for .gz): the unit of progress reports."""
    return sum(p.stat().st_size for p in files)


def _is_gzip(path: pathlib.Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == _GZIP_MAGIC


def _read_file(path, chunk_bytes, on_read, hasher) -> Iterator[tuple[int, bytes]]:
    """(offset, data) chunks of one file; offset is in decompressed bytes, BOM stripped."""
    gz = _is_gzip(path)
    _check_not_binary(path, gz)
    with open(path, "rb") as raw:
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
        offset, seen = 0, 0
        while True:
            try:
                data = stream.read(chunk_bytes)
                while offset == 0 and data and len(data) < len(_BOM) and _BOM.startswith(data):
                    more = stream.read(len(_BOM) - len(data))  # tiny chunks: see a whole BOM
                    if not more:
                        break
                    data += more
            except (OSError, EOFError, zlib.error) as e:
                raise DataError(f"{path}: corrupt gzip data ({e}); re-download or "
                                "re-compress the file") from None
            if on_read is not None:
                pos = raw.tell()
                on_read(pos - seen)
                seen = pos
            if not data:
                return
            if hasher is not None:
                hasher.update(data)
            start = offset
            if offset == 0:
                if data.startswith(_BOM):
                    data, start = data[len(_BOM):], len(_BOM)
            nul = data.find(b"\0")
            if nul >= 0:
                raise _wide_error(path, gz) or DataError(
                    f"{path}: NUL byte at byte offset {start + nul}: this looks like a binary file; pass a text file")
            offset = start + len(data)
            yield start, data


def _check_not_binary(path, gz: bool) -> None:
    """Refuse a file whose first 64 KB are mostly control bytes (whatever the chunk size)."""
    try:
        with (gzip.open if gz else open)(path, "rb") as f:
            head = np.frombuffer(f.read(65536), dtype=np.uint8)
    except (OSError, EOFError, zlib.error):
        return  # a corrupt gzip stream is reported, with its reason, by the reader
    if head.size == 0:
        return
    controls = np.count_nonzero(_CONTROL[head])
    if controls > _BINARY_FRACTION * head.size:
        raise _wide_error(path, gz, head.tobytes()) or DataError(
            f"{path}: mostly control bytes: this looks like a binary file; pass a text file")


def _wide_encoding(head: bytes) -> str | None:
    """The UTF-16 or UTF-32 encoding `head` (a file's first bytes) is in, by its byte order
    mark or, for UTF-16 without one, by NUL bytes at one parity of offsets (the high byte of
    Latin-script characters) and almost none at the other; None for anything else."""
    for mark, name in _WIDE_BOMS:
        if head.startswith(mark):
            return name
    pairs = np.frombuffer(head[:len(head) // 2 * 2], dtype=np.uint8).reshape(-1, 2)
    if len(pairs) < 32:  # too few characters to tell by
        return None
    even, odd = (np.count_nonzero(pairs[:, i] == 0) / len(pairs) for i in (0, 1))
    if odd >= _WIDE_NUL_SHARE and even < 0.01:
        return "UTF-16LE"
    if even >= _WIDE_NUL_SHARE and odd < 0.01:
        return "UTF-16BE"
    return None


def _wide_error(path, gz: bool, head: bytes | None = None) -> DataError | None:
    """The error for a UTF-16 or UTF-32 file (one line, with the conversion), else None."""
    if head is None:
        try:
            with (gzip.open if gz else open)(path, "rb") as f:
                head = f.read(65536)
        except (OSError, EOFError, zlib.error):
            return None
    name = _wide_encoding(head)
    if name is None:
        return None
    return DataError(f"{path}: {name} text; zlm reads UTF-8: convert it first, e.g. "
                     f"iconv -f {name} -t UTF-8 {path} > {pathlib.Path(path).stem}-utf8.txt")


def iter_bytes(files: Sequence[pathlib.Path], chunk_bytes: int = CHUNK_BYTES,
               on_read: OnRead | None = None, hasher=None) -> Iterator[bytes]:
    """The concatenated content of `files` as byte chunks (no decoding)."""
    for path in files:
        for _, data in _read_file(path, chunk_bytes, on_read, hasher):
            yield data


def iter_text(files: Sequence[pathlib.Path], chunk_bytes: int = CHUNK_BYTES,
              on_read: OnRead | None = None, hasher=None, fmt: str = "text") -> Iterator[str]:
    """The concatenated content of `files` as str chunks, strictly UTF-8 decoded."""
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt} is not a format; use one of {', '.join(FORMATS)}")
    for path in files:
        dec = codecs.getincrementaldecoder("utf-8")(errors="strict")
        ptb = PtbCharDecoder(path) if fmt == "ptb-char" else None
        end = 0
        for offset, data in _read_file(path, chunk_bytes, on_read, hasher):
            pending = len(dec.getstate()[0])  # bytes of a split character from before
            try:
                text = dec.decode(data)
            except UnicodeDecodeError as e:
                raise _wide_error(path, _is_gzip(path)) or _utf8_error(
                    path, offset - pending + e.start, e.object[e.start]) from None
            end = offset + len(data)
            text = ptb.feed(text) if ptb is not None else text
            if text:
                yield text
        try:
            text = dec.decode(b"", final=True)
        except UnicodeDecodeError as e:
            raise _utf8_error(path, end - len(e.object) + e.start, e.object[e.start]) from None
        if ptb is not None:
            text = ptb.feed(text) + ptb.flush()
        if text:
            yield text


def _utf8_error(path, offset: int, byte: int) -> DataError:
    return DataError(f"{path}: invalid UTF-8 at byte offset {offset} (byte 0x{byte:02x}); "
                     "convert the file to UTF-8 or pass --tokenizer byte")


_PTB_NOT_SEPARATED = re.compile(r"[^ \n][^ \n]")


class PtbCharDecoder:
    """Streaming decoder for PTB character files: 'a _ c a t \\n' -> 'a cat\\n'."""

    def __init__(self, path=None):
        self._path = path
        self._carry = ""
        self._line = 0

    def feed(self, text: str) -> str:
        """Decode the complete lines of carry + text; keep the unfinished last line."""
        text = self._carry + text
        cut = text.rfind("\n") + 1
        self._carry = text[cut:]
        return self._decode(text[:cut])

    def flush(self) -> str:
        """The last line if the file does not end with a newline (whitespace-only: none)."""
        rest, self._carry = self._carry, ""
        return self._decode(rest + "\n") if rest.strip() else ""

    def _decode(self, block: str) -> str:
        bad = _PTB_NOT_SEPARATED.search(block)
        if bad is not None:
            line = self._line + block.count("\n", 0, bad.start()) + 1
            raise DataError(f"{self._path}: line {line} is not in ptb-char format (characters "
                            f"{bad.group()!r} are not space-separated); drop --format ptb-char")
        self._line += block.count("\n")
        lines = block.split("\n")[:-1]
        return "".join(line.replace(" ", "").replace("_", " ") + "\n" for line in lines)


def sha256_of(files: Sequence[pathlib.Path]) -> str:
    """SHA-256 of the files' bytes as stored on disk, concatenated (no decompression)."""
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                h.update(chunk)
    return h.hexdigest()

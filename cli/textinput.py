"""Text the user hands a command: a FILE argument or `-` for standard input, read strictly.

Shared by `zlm score RUN [FILE | -]` and `zlm sample --prime-file FILE | --prime -`. Every
failure is one line: a missing file, a directory, invalid UTF-8, empty input.
"""

from __future__ import annotations

import sys
from pathlib import Path

from zlm.errors import DataError, UsageError


def read_stdin() -> str:
    """All of standard input as UTF-8 text, newlines as a file's ('' when empty or a terminal)."""
    stream = sys.stdin
    if stream is None or (hasattr(stream, "isatty") and stream.isatty()):
        return ""
    raw = stream.buffer.read() if hasattr(stream, "buffer") else stream.read()
    if not isinstance(raw, str):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"standard input is not UTF-8 text (byte {e.start}); convert it to "
                            "UTF-8") from None
    # Universal newlines, as a FILE is read (and as `zlm eval --file` reads it).
    return raw.replace("\r\n", "\n").replace("\r", "\n")


def read_text(source: str, flag: str) -> str:
    """The text of `source`: a UTF-8 file, or standard input for "-". Never empty.

    flag: how the user named it in error messages ("FILE", "--prime-file").
    """
    if source == "-":
        if sys.stdin is not None and hasattr(sys.stdin, "isatty") and sys.stdin.isatty():
            raise UsageError(f"{flag} -: standard input is a terminal; pipe text in or pass a file")
        text = read_stdin()
        if not text:
            raise UsageError(f"{flag} -: standard input is empty; pipe text in, e.g. "
                             "`cat file.txt | zlm ...`")
        return text
    path = Path(source)
    if not path.exists():
        raise UsageError(f"{flag} {path} does not exist; pass a UTF-8 text file or - for stdin")
    if not path.is_file():
        raise UsageError(f"{flag} {path} is not a file; pass a UTF-8 text file or - for stdin")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{flag} {path} is not UTF-8 text (byte {e.start}); convert it to UTF-8") from None
    except OSError as e:
        raise UsageError(f"{flag} {path} cannot be read ({e.strerror or e})") from None
    if not text:
        raise UsageError(f"{flag} {path} is empty; pass a file with some text")
    return text

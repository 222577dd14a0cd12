"""Replacing a directory only once its new version is whole (a leaf module anything may use).

`zlm prepare` builds a DATA_DIR and the benchmark's --record a run's record in
`building(target)`, a hidden temporary directory beside the target that `replace_directory`
swaps in when the block ends (`zlm export` calls `replace_directory` itself): an
interrupted run leaves the old directory (or nothing), never a half-written one. (Checkpoints have their own, stricter
protocol with manifests: `zlm.core.checkpoint`.) A process killed between its last write and
the swap leaves a whole directory under the hidden name; `temporary_of` tells such a leftover
apart, so a reader refuses it (`Dataset.open`) instead of taking it for the target.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_TEMPORARY = re.compile(r"^\.(?P<target>.+)\.(?:tmp|old)-\d+-[0-9a-f]{8}$")


def temporary_name(out: Path, kind: str = "tmp") -> Path:
    """The hidden directory beside `out` that this process builds it in ("tmp") or moves
    the previous version to while swapping ("old")."""
    return out.with_name(f".{out.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def temporary_of(path: Path) -> str | None:
    """The target's name if `path` is one of `temporary_name`'s directories, else None."""
    m = _TEMPORARY.match(Path(path).name)
    return m.group("target") if m else None


@contextmanager
def building(out: Path) -> Iterator[Path]:
    """A new empty hidden directory beside `out` to build in: it replaces `out` when the
    block ends, and is removed if the block raises. (mkdir, not mkdtemp: the result should
    get the usual umask permissions.)"""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(out)
    tmp.mkdir()
    try:
        yield tmp
        replace_directory(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_directory(tmp: Path, out: Path) -> None:
    """Move the finished directory `tmp` to `out`, replacing an old `out` only now."""
    old = None
    if out.exists():
        old = temporary_name(out, "old")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

"""Replacing a directory only once its new version is whole (a leaf module anything may use).

`zlm prepare` builds a DATA_DIR and the benchmark's --record a run's record in
`building(target)`, a hidden temporary directory beside the target that `replace_directory`
swaps in when the block ends (`zlm export` calls `replace_directory` itself): an
interrupted run leaves the old directory (or nothing), never a half-written one. (Checkpoints have their own, stricter
protocol with manifests: `zlm.core.checkpoint`.)
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def building(out: Path) -> Iterator[Path]:
    """A new empty hidden directory beside `out` to build in: it replaces `out` when the
    block ends, and is removed if the block raises. (mkdir, not mkdtemp: the result should
    get the usual umask permissions.)"""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
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
        old = out.with_name(f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

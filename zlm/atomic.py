"""Replacing a directory only once its new version is whole (a leaf module anything may use).

`zlm prepare` builds a DATA_DIR and `zlm export` an export directory under a hidden temporary
name beside the target, then `replace_directory` swaps it in: an interrupted run leaves the
old directory (or nothing), never a half-written one. (Checkpoints have their own, stricter
protocol with manifests: `zlm.core.checkpoint`.)
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path


def replace_directory(tmp: Path, out: Path) -> None:
    """Move the finished directory `tmp` to `out`, replacing an old `out` only now."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

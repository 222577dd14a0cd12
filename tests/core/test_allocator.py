"""The `zlm` command keeps freed memory in the process (zlm/core/allocator.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Allocates and frees a 256 MB block, then reports RssAnon (MB) with it freed.
PROBE = """
import sys
from zlm.core.allocator import keep_freed_memory
print(keep_freed_memory() if sys.argv[1] == "keep" else False)
import torch
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
x = torch.ones(64 * 1024 * 1024)  # 256 MB, touched
before_free = anon()
del x
print(before_free - anon())
"""


def _released_mb(mode: str, **env) -> tuple[str, float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "ZLM_MALLOC"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                         env={**clean, **env}, check=True).stdout.split()
    return out[0], float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_stay_in_the_process_only_when_asked():
    assert _released_mb("plain")[1] > 200  # glibc munmaps a freed 256 MB block at once
    flag, released = _released_mb("keep")
    assert flag == "True" and released < 16  # kept for the next window's buffers


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_users_malloc_settings_win():
    assert _released_mb("keep", MALLOC_TRIM_THRESHOLD_="0")[0] == "False"
    assert _released_mb("keep", ZLM_MALLOC="default")[0] == "False"

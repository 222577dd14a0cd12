"""Keep freed memory in the process instead of handing it back to the OS (glibc).

A training step allocates and frees the same large buffers every window (activations,
gradients, logits). glibc serves blocks above its mmap threshold with fresh mmap()s and
returns them with munmap(), and trims the heap top as it frees, so every window pays the
kernel to zero and map those pages again. Turning both off took about a fifth off
`zlm train`'s time with identical losses (measured, with the machine and command: docs/speed.md).

`keep_freed_memory()` sets that once for the `zlm` command (not for a library user's own
process). A user's MALLOC_MMAP_MAX_ / MALLOC_TRIM_THRESHOLD_ (or ZLM_MALLOC=default) wins.
The cost: a process keeps its peak heap until it exits.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
M_MMAP_MAX = -4
_USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> bool:
    """Turn off mmap for large blocks and heap trimming (glibc on Linux). True when set."""
    if not sys.platform.startswith("linux") or os.environ.get("ZLM_MALLOC") == "default":
        return False
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))

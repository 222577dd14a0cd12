"""`zlm sample` (being built)."""

from __future__ import annotations

from zlm.errors import ZlmError


def command() -> None:
    """Not built yet."""
    raise ZlmError("zlm sample is not built yet")

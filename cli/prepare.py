"""`zlm prepare` (being built)."""

from __future__ import annotations

from zlm.errors import ZlmError


def command() -> None:
    """Not built yet."""
    raise ZlmError("zlm prepare is not built yet")

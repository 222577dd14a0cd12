"""Bits per character, perplexity, and the run's metrics.jsonl log.

BPC = total negative log-likelihood in nats / characters of the evaluated text / ln 2
(docs/inference.md, the evaluation protocol). Characters are those of the original text, so char, byte and
subword models of the same text are comparable. Perplexity is per token unless named.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from zlm.errors import ZlmError

LN2 = math.log(2.0)


@dataclass(frozen=True)
class Score:
    """Summed log-likelihood over a text, and what it was summed over."""

    nats: float  # total negative log-likelihood, natural log
    tokens: int  # predicted tokens
    characters: int  # characters of the original text those tokens cover
    bytes: int  # UTF-8 bytes of that text

    @property
    def bpc(self) -> float:
        return self.nats / max(self.characters, 1) / LN2

    @property
    def bits_per_byte(self) -> float:
        return self.nats / max(self.bytes, 1) / LN2

    @property
    def perplexity(self) -> float:
        """Per token."""
        return math.exp(min(self.nats / max(self.tokens, 1), 700.0))

    @property
    def char_perplexity(self) -> float:
        return math.exp(min(self.nats / max(self.characters, 1), 700.0))


class MetricsLog:
    """Appends one JSON object per event to RUN_DIR/metrics.jsonl (flushed each line)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, event: str, **values) -> None:
        record = {"event": event, "time": round(time.time(), 3), **values}
        try:
            self._f.write(json.dumps(record, allow_nan=True) + "\n")
            self._f.flush()
        except OSError as e:
            raise ZlmError(f"cannot append to {self.path} ({e.strerror or e}); free disk space "
                           f"or make the run directory writable, then resume with --resume") from None

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict]:
    """All events of a metrics.jsonl; a torn last line (a crash mid-write) is skipped."""
    return parse_metrics(Path(path).read_text(encoding="utf-8"))


def parse_metrics(text: str) -> list[dict]:
    """The events of a metrics.jsonl's text (a torn last line skipped)."""
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out

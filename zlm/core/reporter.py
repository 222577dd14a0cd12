"""What the trainer tells the outside world while it runs, without knowing how it is shown.

`Reporter` is the interface (all methods optional no-ops); `PlainReporter` prints plain
lines. `ByteProgress` reports progress through a file (KB/s) for compress/decompress.
The rich live display lives in `zlm.core.rich_display`, the only library module that
imports rich.
"""

from __future__ import annotations

import sys
import time


class Reporter:
    """Receives training events. Subclass and override what you need."""

    def start(self, info: dict) -> None:
        """Once, before the first step: run dir, parameters, cell, runtime, data, plan."""

    def log(self, record: dict) -> None:
        """Every --log-every steps: step, epoch, train_bpc, chars_per_s, lr, elapsed, eta."""

    def eval(self, record: dict) -> None:
        """After each validation: step, valid_bpc, valid_ppl, best_bpc, train_slice_bpc and
        gap (valid - train slice, both in eval mode) when measured, and averaged (the steps
        in the weight average validated, 0 before averaging starts)."""

    def message(self, text: str) -> None:
        """A one-line notice (resume, fallback, skipped step, checkpoint saved...)."""

    def finish(self, summary: dict) -> None:
        """Once, at the end."""


def summary_line(summary: dict) -> str:
    """The end-of-run summary as "key value" pairs: BPC to 4 decimals, unset values left out."""
    return " ".join(f"{k} {v:.4f}" if isinstance(v, float) and k.endswith("bpc") else f"{k} {v}"
                    for k, v in summary.items() if v is not None)


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class PlainReporter(Reporter):
    """Plain lines on a stream (stdout by default): for logs, pipes and NO_COLOR."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout

    def _p(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def start(self, info: dict) -> None:
        for k, v in info.items():
            self._p(f"{k}: {v}")

    def log(self, r: dict) -> None:
        valid = f" valid_bpc {r['valid_bpc']:.4f}" if r.get("valid_bpc") is not None else ""
        self._p(
            f"step {r['step']} epoch {r['epoch']:.2f} train_bpc {r['train_bpc']:.4f}{valid} "
            f"chars/s {r['chars_per_s']:,.0f} lr {r['lr']:.3g} "
            f"elapsed {fmt_duration(r['elapsed'])} eta {fmt_duration(r.get('eta'))}"
        )

    def eval(self, r: dict) -> None:
        self._p(
            f"eval step {r['step']} valid_bpc {r['valid_bpc']:.4f} "
            + (f"(weights averaged over {r['averaged']} steps) " if r.get("averaged") else "")
            + f"valid_ppl {r['valid_ppl']:.3f} (per token) best_bpc {r['best_bpc']:.4f}"
            + (f" gap {r['gap']:+.4f} (valid - train slice {r['train_slice_bpc']:.4f})" if r.get("gap") is not None
               else "")
        )

    def message(self, text: str) -> None:
        self._p(text)

    def finish(self, summary: dict) -> None:
        self._p("done: " + summary_line(summary))


class ByteProgress:
    """Progress through a file of known size, with KB/s; plain lines on a stream (stderr).

    Used as a context manager; calling it with the fraction done (0..1) updates it. A line
    at most every `every` seconds, and one at the end."""

    def __init__(self, label: str, total_bytes: int, stream=None, every: float = 5.0):
        self.label, self.total, self.every = label, total_bytes, every
        self.stream = stream or sys.stderr
        self.t0 = self.last = 0.0
        self.done = self.printed = 0.0

    def __enter__(self) -> ByteProgress:
        self.t0 = self.last = time.perf_counter()
        return self

    def __call__(self, fraction: float) -> None:
        self.done = fraction
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            self._line(now)

    def _line(self, now: float) -> None:
        self.printed = self.done
        done = self.done * self.total
        rate = done / 1000 / max(now - self.t0, 1e-9)
        print(f"{self.label}: {self.done:4.0%} {done / 1000:,.1f} of {self.total / 1000:,.1f} KB "
              f"at {rate:,.1f} KB/s", file=self.stream, flush=True)

    def __exit__(self, *exc) -> None:
        if exc[0] is None and self.total and self.last > self.t0 and self.printed < 1:
            self._line(time.perf_counter())

"""The rich live display for training — the one library module that imports rich.

`make_byte_progress` gives compress/decompress a transfer bar (bytes, KB/s).
A `RichReporter` shows a status table (step, epoch, train BPC, last valid BPC and
perplexity, characters/s, learning rate, elapsed, ETA) under a progress bar, updated in
place. `make_reporter()` picks it on a terminal and plain lines otherwise (or NO_COLOR).
"""

from __future__ import annotations

import os
import sys

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from zlm.core.reporter import ByteProgress, PlainReporter, Reporter, fmt_duration, summary_line


def use_rich(stream=None) -> bool:
    stream = stream or sys.stdout
    return stream.isatty() and not os.environ.get("NO_COLOR")


def make_reporter() -> Reporter:
    return RichReporter() if use_rich() else PlainReporter()


def make_byte_progress(label: str, total_bytes: int):
    """A progress bar with KB/s on stderr's terminal, else plain `ByteProgress` lines."""
    return RichByteProgress(label, total_bytes) if use_rich(sys.stderr) else ByteProgress(
        label, total_bytes)


class RichByteProgress:
    """rich's transfer bar (bytes, KB/s, time left) on stderr; call it with the fraction done."""

    def __init__(self, label: str, total_bytes: int):
        self.total = total_bytes
        self.progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), TaskProgressColumn(),
                                 DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                                 console=Console(stderr=True), transient=False)
        self.task = self.progress.add_task(label, total=max(total_bytes, 1))

    def __enter__(self) -> RichByteProgress:
        self.progress.start()
        return self

    def __call__(self, fraction: float) -> None:
        self.progress.update(self.task, completed=fraction * max(self.total, 1))

    def __exit__(self, *exc) -> None:
        self.progress.stop()


class RichReporter(Reporter):
    """Live table and progress bar on the terminal."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console()
        self.progress = Progress(TextColumn("[bold]training"), BarColumn(), TaskProgressColumn(),
                                 TextColumn("{task.fields[eta]}"), console=self.console)
        self.task = self.progress.add_task("train", total=None, eta="")
        self.last: dict = {}
        self.last_eval: dict = {}
        self.live: Live | None = None

    def _table(self) -> Table:
        r, e = self.last, self.last_eval
        t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        for col in ("step", "epoch", "train BPC", "valid BPC", "gap", "valid ppl/token", "best BPC",
                    "chars/s", "lr", "elapsed", "ETA"):
            t.add_column(col, justify="right")
        if r or e:
            t.add_row(
                str(r.get("step", e.get("step", ""))), f"{r.get('epoch', 0):.2f}",
                f"{r['train_bpc']:.4f}" if "train_bpc" in r else "-",
                (f"{e['valid_bpc']:.4f}" + (" avg" if e.get("averaged") else "")) if e else "-",
                f"{e['gap']:+.4f}" if e.get("gap") is not None else "-",
                f"{e['valid_ppl']:.3f}" if e else "-",
                f"{e['best_bpc']:.4f}" if e else "-",
                f"{r['chars_per_s']:,.0f}" if "chars_per_s" in r else "-",
                f"{r['lr']:.3g}" if "lr" in r else "-",
                fmt_duration(r.get("elapsed")), fmt_duration(r.get("eta")),
            )
        return t

    def _render(self):
        return Group(self._table(), self.progress)

    def start(self, info: dict) -> None:
        for k, v in info.items():
            self.console.print(f"[bold]{k}[/]: {v}", highlight=False)
        self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
        self.live.start()

    def log(self, record: dict) -> None:
        self.last = record
        total = record.get("total_steps")
        self.progress.update(self.task, completed=record["step"], total=total,
                             eta=f"ETA {fmt_duration(record.get('eta'))}")
        if self.live:
            self.live.update(self._render())

    def eval(self, record: dict) -> None:
        self.last_eval = record
        if self.live:
            self.live.update(self._render())

    def message(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def finish(self, summary: dict) -> None:
        if self.live:
            self.live.update(self._render())
            self.live.stop()
        self.console.print("[bold green]done[/]: " + summary_line(summary), highlight=False)

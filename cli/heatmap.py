"""How `zlm score` shows surprisal: one colour scale for the terminal and the HTML page.

Owns the bins (bits per character -> colour), the rich rendering of a scored text with
its legend, the plain per-line rendering for pipes, and the self-contained HTML page
(`write_html`): inline CSS and JS, no network; every character is a span carrying its
bits (`data-bits`) and the model's top-k next tokens (`data-top`, JSON [[token, p], ...]);
hovering shows them, and `page.html#char=N` pins character N's box open (for screenshots).
"""

from __future__ import annotations

import contextlib
import html
import json
import math
import os
import secrets
from pathlib import Path

import numpy as np

from zlm.errors import UsageError
from zlm.inference.score import ScoredText

# Upper edges in bits; the last bin is open. Colours run from cool (expected) to hot.
EDGES = (0.5, 1.0, 2.0, 4.0, 8.0)
COLOURS = ("#1a9850", "#91cf60", "#d9ef8b", "#fee08b", "#fc8d59", "#d73027")
INK = ("#ffffff", "#000000", "#000000", "#000000", "#000000", "#ffffff")
CONTEXT = "#bbbbbb"  # a character that is context only (no bits)


def bins(bits: np.ndarray) -> np.ndarray:
    """(C,) bits -> (C,) colour bin in 0..len(COLOURS)-1, or -1 for NaN (context)."""
    b = np.searchsorted(np.asarray(EDGES), np.nan_to_num(bits, nan=0.0), side="right")
    return np.where(np.isnan(bits), -1, b)


def legend_labels() -> list[str]:
    lo = (0.0, *EDGES)
    return [f"{a:g}-{b:g}" for a, b in zip(lo, EDGES, strict=False)] + [f">={EDGES[-1]:g}"]


# ------------------------------------------------------------------------- terminal


def print_rich(scored: ScoredText) -> None:
    """The text with each character's background coloured by its bits, then a legend."""
    from rich.console import Console
    from rich.text import Text

    out = Text()
    b = bins(scored.bits)
    text = scored.text
    start = 0
    for i in range(1, len(text) + 1):  # one styled run per stretch of equal bins
        if i == len(text) or b[i] != b[start] or text[i - 1] == "\n":
            k = int(b[start])
            style = f"{INK[k]} on {COLOURS[k]}" if k >= 0 else f"black on {CONTEXT}"
            run = text[start:i]
            if run.endswith("\n"):  # colour the newline as a visible mark, then break
                out.append(run[:-1] + "\u21b5", style)
                out.append("\n")
            else:
                out.append(run, style)
            start = i
    console = Console(highlight=False)
    console.print(out, end="" if text.endswith("\n") else "\n", soft_wrap=True)
    key = Text("bits/char: ")
    for label, colour, ink in zip(legend_labels(), COLOURS, INK, strict=True):
        key.append(f" {label} ", f"{ink} on {colour}")
        key.append(" ")
    console.print(key)


def plain_lines(scored: ScoredText) -> list[str]:
    """One line per line of the text: `bits  BPC | line` (for pipes and NO_COLOR)."""
    rows, start = [], 0
    for line in scored.text.splitlines(keepends=True):
        seg = scored.bits[start : start + len(line)]
        total = float(np.nansum(seg))
        n = int(np.isfinite(seg).sum())
        bpc = total / n if n else math.nan
        rows.append(f"{total:9.2f} bits {bpc:6.3f} bpc | {line.rstrip(chr(10))}")
        start += len(line)
    return rows


# ---------------------------------------------------------------------------- HTML

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em; color: #222; }
#text { font: 15px/1.7 ui-monospace, Menlo, Consolas, monospace; white-space: pre-wrap;
        word-break: break-all; border: 1px solid #ddd; padding: 0.8em; border-radius: 6px; }
#text span { border-radius: 2px; cursor: default; }
#text span.nl::before { content: "\\21b5"; opacity: 0.45; }
#text span.on { outline: 2px solid #000; }
#tip { position: absolute; display: none; background: #fff; border: 1px solid #888;
       border-radius: 6px; padding: 0.5em 0.7em; box-shadow: 0 2px 8px rgba(0,0,0,.25);
       font: 13px/1.4 ui-monospace, Menlo, Consolas, monospace; pointer-events: none; }
#tip table { border-collapse: collapse; } #tip td { padding: 0 0.5em 0 0; }
.legend span { display: inline-block; padding: 0 0.6em; margin-right: 0.3em; border-radius: 3px; }
.meta { color: #555; margin: 0.6em 0; }
"""

_JS = """
const tip = document.getElementById('tip');
function show(el) {
  const top = JSON.parse(el.dataset.top), b = el.dataset.bits;
  const ch = el.textContent === '\\n' ? '\\u21b5' : el.textContent;
  let rows = top.map(([t, p]) => '<tr><td>' + JSON.stringify(t).replace(/</g, '&lt;') +
    '</td><td>' + (100 * p).toFixed(1) + '%</td></tr>').join('');
  tip.innerHTML = '<b>' + JSON.stringify(ch).replace(/</g, '&lt;') + '</b> ' +
    (b === '' ? 'context (not predicted)' : Number(b).toFixed(3) + ' bits') +
    (top.length ? '<div>model expected:</div><table>' + rows + '</table>' : '');
  const r = el.getBoundingClientRect();
  tip.style.left = (window.scrollX + r.left) + 'px';
  tip.style.top = (window.scrollY + r.bottom + 4) + 'px';
  tip.style.display = 'block';
}
document.querySelectorAll('#text span').forEach(el => {
  el.addEventListener('mouseenter', () => show(el));
  el.addEventListener('mouseleave', () => { tip.style.display = 'none'; });
});
const m = location.hash.match(/^#char=(\\d+)$/);
if (m) { const el = document.querySelectorAll('#text span')[Number(m[1])];
         if (el) { el.classList.add('on'); show(el); } }
"""


def _span(ch: str, bits: float, k: int, top: list) -> str:
    colour, ink = (COLOURS[k], INK[k]) if k >= 0 else (CONTEXT, "#000")
    cls = ' class="nl"' if ch == "\n" else ""
    data = "" if math.isnan(bits) else f"{bits:.4f}"
    return (f'<span{cls} style="background:{colour};color:{ink}" data-bits="{data}" '
            f'data-top="{html.escape(json.dumps(top, ensure_ascii=False), quote=True)}">'
            f"{html.escape(ch)}</span>")


def render_html(scored: ScoredText, title: str) -> str:
    """The whole page as a string."""
    b = bins(scored.bits)
    spans = []
    for i, ch in enumerate(scored.text):
        d = scored.char_dict(i)
        top = [[t["token"], round(t["p"], 4)] for t in d["top"]]
        spans.append(_span(ch, float(scored.bits[i]), int(b[i]), top))
    s = scored.score
    legend = "".join(f'<span style="background:{c};color:{ink}">{lab}</span>'
                     for lab, c, ink in zip(legend_labels(), COLOURS, INK, strict=True))
    meta = (f"{s.bpc:.4f} bits/character over {s.characters:,} characters "
            f"({s.nats / math.log(2):,.1f} bits in all); {scored.attribution}; "
            f"protocol: {scored.protocol}; checkpoint: {scored.checkpoint}")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
        f"<h2>zlm score: {html.escape(title)}</h2>\n"
        f"<div class=\"meta\">{html.escape(meta)}</div>\n"
        f"<div class=\"legend\">bits per character: {legend}</div>\n"
        f"<div id=\"text\">{''.join(spans)}</div>\n<div id=\"tip\"></div>\n"
        f"<script>{_JS}</script>\n</body></html>\n")


def check_html_target(out: Path) -> None:
    """A one-line UsageError unless `out` can be a new or replaced file."""
    out = Path(out)
    try:
        is_dir = out.is_dir()
    except OSError as e:  # e.g. a name too long for the file system
        raise UsageError(f"--html {out} cannot be written ({e.strerror or e}); choose another "
                         "name") from None
    if is_dir:
        raise UsageError(f"--html {out} is a directory; pass a file name such as score.html")
    if not out.parent.is_dir():
        raise UsageError(f"--html {out}: the folder {out.parent} does not exist; create it first")
    if not os.access(out.parent, os.W_OK):
        raise UsageError(f"--html {out}: the folder {out.parent} is not writable; choose another place")


def write_html(scored: ScoredText, out: Path, title: str) -> Path:
    """Write the page to `out` atomically: a temporary name beside it, then a rename."""
    out = Path(out)
    check_html_target(out)
    page = render_html(scored, title)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, out)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise UsageError(f"--html {out} cannot be written ({e.strerror or e}); choose a writable "
                         "place") from None
    return out

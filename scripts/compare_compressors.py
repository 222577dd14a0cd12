#!/usr/bin/env python3
"""Compare zlm compress (static and --adapt) with gzip -9, bzip2 -9, xz -9, xz -9e, zstd -19.

    python scripts/compare_compressors.py RUN FILE [FILE ...] [--json] [--no-adapt]
        [--streams S] [--dynamic-lr LR --dynamic-decay D --segment N]
    python scripts/compare_compressors.py RUN --inputs DIR [FILE ...]

Prints a Markdown table (or JSON lines): compressed bytes, bits per byte, compression
and decompression speed, and the model's size beside zlm's rows; then the sizes alone,
one row per file. Library code: zlm.tools.compressors.

--inputs DIR writes the six inputs of docs/compression.md's table into DIR and compares
them too: 20,000 random bytes (seed 0), the first 30,000 bytes of the `ls` binary, a
54-byte UTF-8 line (accents, CJK, an emoji) 200 times, the GPL-3 text (the system's
common-licenses copy, else the first LICENSE file of an installed Python package), an
empty file, and tiny Shakespeare's test split (the last 5% of
tests/corpora/tinyshakespeare/input.txt, as `zlm prepare` splits it).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import shutil
from pathlib import Path

import torch

from zlm.inference.dynamic import DEFAULT_DECAY, DEFAULT_LR, DEFAULT_SEGMENT, DynamicConfig
from zlm.tools.compressors import compare_compressors, markdown

ROOT = Path(__file__).resolve().parents[1]
LINE = "Crème brûlée — 東京の天気は雨 🌧 naïve\n".encode()  # 54 bytes


def _license() -> bytes:
    gpl = Path("/usr/share/common-licenses/GPL-3")
    if gpl.is_file():
        return gpl.read_bytes()
    for dist in importlib.metadata.distributions():
        for f in dist.files or ():
            if f.name.upper().startswith(("LICENSE", "COPYING")) and f.locate().is_file():
                return f.locate().read_bytes()
    raise SystemExit("--inputs: no license text found (no GPL-3, no package LICENSE file)")


def write_inputs(folder: Path) -> list[Path]:
    """The six inputs of docs/compression.md's table, written into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    text = (ROOT / "tests" / "corpora" / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    ls = Path(shutil.which("ls") or "/bin/ls")
    inputs = {
        "random-20000.bin": random.Random(0).randbytes(20_000),
        "ls-30000.bin": ls.read_bytes()[:30_000],
        "line-x200.txt": LINE * 200,
        "GPL-3.txt": _license(),
        "empty": b"",
        "tinyshakespeare-test.txt": text[int(len(text) * 0.95):].encode(),
    }
    for name, data in inputs.items():
        (folder / name).write_bytes(data)
    return [folder / name for name in inputs]


def sizes(rows) -> str:
    """File x compressor compressed bytes, one row per file."""
    names = list(dict.fromkeys(r.compressor for r in rows))
    files = list(dict.fromkeys(r.file for r in rows))
    got = {(r.file, r.compressor): r.compressed_bytes for r in rows}
    orig = {r.file: r.original_bytes for r in rows}
    out = ["| file | bytes | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for f in files:
        cells = [f"{got[f, n]:,}" if (f, n) in got else "" for n in names]
        out.append(f"| {Path(f).name} | {orig[f]:,} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("files", nargs="*")
    ap.add_argument("--inputs", type=Path, default=None, help="write the standard inputs here and add them")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-adapt", action="store_true")
    ap.add_argument("--streams", type=int, default=None)
    ap.add_argument("--dynamic-lr", type=float, default=DEFAULT_LR)
    ap.add_argument("--dynamic-decay", type=float, default=DEFAULT_DECAY)
    ap.add_argument("--segment", type=int, default=DEFAULT_SEGMENT)
    a = ap.parse_args()
    files = ([*write_inputs(a.inputs)] if a.inputs else []) + [Path(f) for f in a.files]
    if not files:
        ap.error("pass FILEs or --inputs DIR")
    adapt = None if a.no_adapt else DynamicConfig(a.dynamic_lr, a.dynamic_decay, a.segment)
    rows, notes = compare_compressors(a.run, files, adapt, a.streams)
    if a.json:
        for r in rows:
            print(json.dumps(r.to_dict()))
    else:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(markdown(rows, notes))
        print("\n" + sizes(rows))
        print(f"\n(torch {torch.__version__}, {os.cpu_count()} CPUs, load average {load:.2f})")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Compare zlm compress (static and --adapt) with gzip -9, bzip2 -9, xz -9, zstd -19.

    python scripts/compare_compressors.py RUN FILE [FILE ...] [--json] [--no-adapt]
        [--streams S] [--dynamic-lr LR --dynamic-decay D --segment N]

Prints a Markdown table (or JSON lines): compressed bytes, bits per byte, compression
and decompression speed, and the model's size beside zlm's rows. Library code:
zlm.tools.compressors.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from zlm.inference.dynamic import DEFAULT_DECAY, DEFAULT_LR, DEFAULT_SEGMENT, DynamicConfig
from zlm.tools.compressors import compare_compressors, markdown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-adapt", action="store_true")
    ap.add_argument("--streams", type=int, default=None)
    ap.add_argument("--dynamic-lr", type=float, default=DEFAULT_LR)
    ap.add_argument("--dynamic-decay", type=float, default=DEFAULT_DECAY)
    ap.add_argument("--segment", type=int, default=DEFAULT_SEGMENT)
    a = ap.parse_args()
    adapt = None if a.no_adapt else DynamicConfig(a.dynamic_lr, a.dynamic_decay, a.segment)
    rows, notes = compare_compressors(a.run, a.files, adapt, a.streams)
    if a.json:
        for r in rows:
            print(json.dumps(r.to_dict()))
    else:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(markdown(rows, notes))
        print(f"\n(torch {torch.__version__}, {os.cpu_count()} CPUs, load average {load:.2f})")


if __name__ == "__main__":
    main()

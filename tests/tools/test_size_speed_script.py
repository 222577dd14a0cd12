"""scripts/size-speed, each size's training speed against the defaults rule's estimate (docs/defaults-rule.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "size-speed"


def test_size_speed_prints_a_row_per_vocabulary_and_size_with_consistent_ratios():
    out = subprocess.run([sys.executable, str(SCRIPT), "--vocabs", "40,300", "--sizes", "128,256,512",
                          "--seconds", "0.05", "--precision", "fp32", "--bptt", "5", "--batch-size", "4"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [[c.strip().replace(",", "") for c in line.strip("|").split("|")]
            for line in out.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [(v, h) for v in ("40", "300") for h in ("128", "256", "512")]
    for _vocab, hidden, measured, one, r1, two, r2 in rows:
        measured, one, two = float(measured), float(one), float(two)
        assert measured > 0 and abs(float(r1) - measured / one) <= 0.006 + 0.01 * measured / one
        assert abs(float(r2) - measured / two) <= 0.006 + 0.01 * measured / two
        if hidden in ("128", "512"):  # the two readings: exact
            assert float(r2) == 1.0
        if hidden == "512":
            assert float(r1) == 1.0
    bad = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "256,512"], capture_output=True, text=True)
    assert bad.returncode != 0 and "must include the probed sizes 128 and 512" in bad.stderr

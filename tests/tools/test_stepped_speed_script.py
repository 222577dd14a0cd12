"""scripts/stepped-speed: scoring's LSTM pass through the C++ Decoder against the window path
and nn.LSTM (docs/speed.md, "Scoring one stream")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zlm.model.cells import cpu_ext

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "stepped-speed"


def test_stepped_speed_prints_a_row_per_stream_count_with_its_ratios():
    if cpu_ext.load_extension() is None:
        pytest.skip(f"no compiled Decoder: {cpu_ext.unavailable_reason()}")
    out = subprocess.run([sys.executable, str(SCRIPT), "--hidden", "32", "--streams", "1,12", "--bptt", "8",
                          "--windows", "2", "--rounds", "3"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert ("| streams | nn.LSTM chars/s | window chars/s | stepped chars/s | window / nn.LSTM | stepped / nn.LSTM |"
            in out.stdout)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| streams")]
    assert [r[0] for r in rows] == ["1", "12"]
    for row in rows:
        rates = [float(v.replace(",", "")) for v in row[1:4]]
        ratios = [float(v) for v in row[4:]]
        assert all(r > 0 for r in rates + ratios)

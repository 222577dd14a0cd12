"""scripts/stepped-speed: scoring's LSTM pass through the C++ Decoder against the window path
and nn.LSTM (docs/speed.md, "Scoring one stream")."""

from __future__ import annotations

import pytest

from conftest import run_script
from zlm.model.cells import cpu_ext


def test_stepped_speed_prints_a_row_per_stream_count_with_its_ratios():
    if cpu_ext.load_extension() is None:
        pytest.skip(f"no compiled Decoder: {cpu_ext.unavailable_reason()}")
    out = run_script("stepped-speed", "--hidden", 32, "--streams", "1,12", "--bptt", 8, "--windows", 2, "--rounds", 3)
    assert ("| precision | streams | nn.LSTM chars/s | window chars/s | stepped chars/s | window / nn.LSTM | "
            "stepped / nn.LSTM |" in out)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| precision")]
    bf16dot = cpu_ext.load_extension().decoder_kernel() == "avx512-bf16dot"
    assert [r[:2] for r in rows] == [["fp32", "1"], ["fp32", "12"], *([["bf16", "1"], ["bf16", "12"]] if bf16dot else [])]
    assert ("bf16: not measured, the Decoder has no bf16 dot products here" in out) == (not bf16dot)
    for row in rows:
        rates = [float(v.replace(",", "")) for v in row[2:5]]
        ratios = [float(v) for v in row[5:]]
        assert all(r > 0 for r in rates + ratios)

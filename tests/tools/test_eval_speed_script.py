"""scripts/eval-speed, scoring with the decoder and loss over blocks against whole windows (docs/speed.md)."""

from __future__ import annotations

from conftest import run_script


def test_eval_speed_prints_a_row_per_precision():
    out = run_script("eval-speed", "--hidden", "16", "--vocab", "700", "--tokens", "3000", "--streams", "4",
                     "--repeats", "1", timeout=120)
    rows = [line for line in out.splitlines() if line.startswith(("| fp32 |", "| bf16 |"))]
    assert [r.split("|")[1].strip() for r in rows] == ["fp32", "bf16"]
    for r in rows:
        blocks, whole, ratio = (float(c.strip().replace(",", "")) for c in r.strip("|").split("|")[1:])
        assert blocks > 0 and whole > 0 and abs(ratio - blocks / whole) <= 0.011
    assert "vocabulary 700" in out

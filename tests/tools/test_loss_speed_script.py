"""scripts/loss-speed, a CPU training step with the fused loss against F.cross_entropy's (docs/speed.md)."""

from __future__ import annotations

from conftest import run_script


def test_loss_speed_prints_a_row_per_precision_and_vocabulary():
    out = run_script("loss-speed", "--hidden", "16", "--vocabs", "40,700", "--bptt", "5", "--batch-size", "4",
                     "--steps", "2", "--repeats", "1", "--precision", "fp32", timeout=300)
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith(("| fp32 |", "| bf16 |"))]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("fp32", "40"), ("fp32", "700")]
    for r in rows:
        fused, ce, ratio = (float(c.strip()) for c in r[2:])
        assert fused > 0 and ce > 0 and abs(ratio - ce / fused) <= 0.011 + 0.02 * ratio  # rounded to 0.01 ms
    assert "fused loss from vocabulary 512" in out

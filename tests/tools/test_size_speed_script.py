"""scripts/size-speed, each size's training speed against the defaults rule's estimate (docs/defaults-rule.md)."""

from __future__ import annotations

from conftest import run_script, script_refusal


def test_size_speed_prints_a_row_per_vocabulary_and_size_with_consistent_ratios():
    out = run_script("size-speed", "--vocabs", "40,300", "--sizes", "128,256,512", "--seconds", "0.05",
                     "--precision", "fp32", "--bptt", "5", "--batch-size", "4", timeout=300)
    rows = [[c.strip().replace(",", "") for c in line.strip("|").split("|")]
            for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [(v, h) for v in ("40", "300") for h in ("128", "256", "512")]
    for _vocab, hidden, measured, one, r1, two, r2 in rows:
        measured, one, two = float(measured), float(one), float(two)
        assert measured > 0 and abs(float(r1) - measured / one) <= 0.006 + 0.01 * measured / one
        assert abs(float(r2) - measured / two) <= 0.006 + 0.01 * measured / two
        if hidden in ("128", "512"):  # the two readings: exact
            assert float(r2) == 1.0
        if hidden == "512":
            assert float(r1) == 1.0
    _, err = script_refusal("size-speed", "--sizes", "256,512")
    assert "must include the probed sizes 128 and 512" in err

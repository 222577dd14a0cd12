"""scripts/trainer-speed: the measurement behind docs/speed.md's zlm train vs nn.LSTM ratio."""

from __future__ import annotations

from conftest import run_script, script_refusal


def test_trainer_speed_script_alternates_rounds(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400)))
    out = run_script("trainer-speed", text, "--steps", "2", "--rounds", "2", "--preset", "cpu-small",
                     "--option", "hidden=16", "--option", "embed=8", "--option", "batch_size=4", "--option", "bptt=8",
                     "--option", "precision=fp32", timeout=300)
    assert "zlm train: 1x16, embed 8" in out and "batch 4, bptt 8, fp32" in out
    assert out.count("round ") == 2 and "median ratio" in out


def test_trainer_speed_script_refuses_a_malformed_option(tmp_path):
    _, err = script_refusal("trainer-speed", "x", "--option", "hidden", timeout=120)
    assert "NAME=VALUE" in err

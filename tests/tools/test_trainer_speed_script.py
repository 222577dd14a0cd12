"""scripts/trainer-speed: the measurement behind docs/speed.md's zlm train vs nn.LSTM ratio."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "trainer-speed"


def test_trainer_speed_script_alternates_rounds(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(400)))
    args = [sys.executable, str(SCRIPT), str(text), "--steps", "2", "--rounds", "2", "--preset", "cpu-small",
            "--option", "hidden=16", "--option", "embed=8", "--option", "batch_size=4", "--option", "bptt=8",
            "--option", "precision=fp32"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "zlm train: 1x16, embed 8" in out.stdout and "batch 4, bptt 8, fp32" in out.stdout
    assert out.stdout.count("round ") == 2 and "median ratio" in out.stdout


def test_trainer_speed_script_refuses_a_malformed_option(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "x", "--option", "hidden"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "NAME=VALUE" in out.stderr

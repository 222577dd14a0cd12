"""scripts/lstm-baseline, the plain nn.LSTM bar that scripts/gpu-check sets beside zlm train."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import TINY_SHAKESPEARE

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "lstm-baseline"


def test_lstm_baseline_trains_and_reports_its_speed(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(TINY_SHAKESPEARE.read_bytes()[:100_000])
    out = subprocess.run([sys.executable, str(SCRIPT), str(text), "--hidden", "32", "--batch", "4", "--bptt", "16",
                          "--steps", "60", "--warmup", "2", "--precision", "fp32", "--device", "cpu"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert row["chars_per_s"] > 0 and row["steps"] == 60
    assert row["train_bpc"] < 6.0  # 65 symbols: log2(65) = 6.02 bits untrained; it learns

"""scripts/lstm-baseline, the plain nn.LSTM bar that scripts/gpu-check sets beside zlm train."""

from __future__ import annotations

import json

from conftest import TINY_SHAKESPEARE, run_script


def test_lstm_baseline_trains_and_reports_its_speed(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(TINY_SHAKESPEARE.read_bytes()[:100_000])
    row = json.loads(run_script("lstm-baseline", text, "--hidden", "32", "--batch", "4", "--bptt", "16", "--steps", "60",
                                "--warmup", "2", "--precision", "fp32", "--device", "cpu", timeout=120))
    assert row["chars_per_s"] > 0 and row["steps"] == 60
    assert row["train_bpc"] < 6.0  # 65 symbols: log2(65) = 6.02 bits untrained; it learns

"""scripts/decoder-speed, the batched sampling step against torch.nn.LSTM (docs/kernels.md)."""

from __future__ import annotations

import pytest

from conftest import run_script
from zlm.core.precision import cpu_bf16_native
from zlm.model.cells import cpu_ext


def test_decoder_speed_prints_a_row_per_precision_and_batch():
    if cpu_ext.load_extension() is None:
        pytest.skip(f"no compiled step: {cpu_ext.unavailable_reason()}")
    out = run_script("decoder-speed", "--hidden", 24, "--vocab", 13, "--batches", "1,5", "--steps", 5,
                     "--repeats", 1, timeout=120)
    rows = [line for line in out.splitlines() if line.startswith("| fp32 |") or line.startswith("| bf16 |")]
    bf16 = [[" bf16 ", " 1 "], [" bf16 ", " 5 "]] if cpu_bf16_native() else []
    assert [r.split("|")[1:3] for r in rows] == [[" fp32 ", " 1 "], [" fp32 ", " 5 "], *bf16]
    assert ("bf16: not measured, this CPU has no native bf16" in out) == (not bf16)
    for r in rows:
        cells = [c.strip().replace(",", "") for c in r.strip("|").split("|")]
        assert float(cells[3]) > 0 and float(cells[5]) > 0 and float(cells[6]) > 0  # tokens/s and the ratio
    assert "Decoder product" in out

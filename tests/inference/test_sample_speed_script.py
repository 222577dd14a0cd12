"""scripts/sample-speed: the measurement behind the sampling speed in docs/speed.md runs."""

from __future__ import annotations

import pytest

from conftest import run_script


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_sample_speed_script_runs(kernel):
    out = run_script("sample-speed", "--hidden", "16", "--vocab", "20", "--length", "50", "--repeats", "1",
                     "--kernel", kernel, timeout=300)
    assert "repeat 1: 50 characters" in out and "median:" in out
    assert f"kernel {kernel}" in out

"""scripts/sample-speed: the measurement behind the sampling speed in docs/speed.md runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sample-speed"


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_sample_speed_script_runs(kernel):
    out = subprocess.run([sys.executable, str(SCRIPT), "--hidden", "16", "--vocab", "20", "--length", "50",
                          "--repeats", "1", "--kernel", kernel], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "repeat 1: 50 characters" in out.stdout and "median:" in out.stdout
    assert f"kernel {kernel}" in out.stdout

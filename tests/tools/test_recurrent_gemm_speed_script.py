"""scripts/recurrent-gemm-speed: MKL's packed GEMM against oneDNN's for the fp32 recurrent product (docs/kernels.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zlm.model.cells import cpu_ext

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "recurrent-gemm-speed"


def test_recurrent_gemm_speed_prints_both_tables():
    ext = cpu_ext.load_extension()
    if ext is None or not ext.mkl_packed_ready():
        pytest.skip("no MKL packed GEMM here")
    out = subprocess.run([sys.executable, str(SCRIPT), "--hidden", "8,16", "--batch-size", "4", "--bptt", "3",
                          "--calls", "5", "--repeats", "1", "--bench-repeats", "1"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.stdout.splitlines()
            if line.startswith("| ") and not line.startswith(("| product", "| H "))]
    products = [r for r in rows if r[0] in ("forward", "backward")]
    assert [(r[0], r[1]) for r in products] == [("forward", "8"), ("backward", "8"), ("forward", "16"),
                                                ("backward", "16")]
    for _, _, onednn, mkl, ratio in products:
        onednn, mkl, ratio = float(onednn), float(mkl), float(ratio)
        assert onednn > 0 and mkl > 0
        rounding = ratio * (0.05 / onednn + 0.05 / mkl) * 1.01  # the microseconds are printed to 0.1
        assert abs(ratio - onednn / mkl) <= 0.006 + rounding
    model = [r for r in rows if r[0] in ("8", "16")]
    assert [(r[0], r[1]) for r in model] == [(h, p) for h in ("8", "16") for p in ("train", "infer", "model")]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in model)

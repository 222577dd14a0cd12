"""scripts/recurrent-gemm-speed: MKL's packed GEMM (fp32) and AMX's micro-kernel (bf16) against oneDNN's packed
linear for the recurrent product (docs/kernels.md)."""

from __future__ import annotations

import pytest

from conftest import run_script
from zlm.model.cells import cpu_ext


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.cpu_feature("amx"))])
def test_recurrent_gemm_speed_prints_both_tables(precision):
    ext = cpu_ext.load_extension()
    if ext is None or not (ext.mkl_packed_ready() if precision == "fp32" else ext.amx_ready()):
        pytest.skip("no MKL packed GEMM (fp32) or AMX (bf16) here")
    out = run_script("recurrent-gemm-speed", "--precision", precision, "--hidden", "16,32", "--batch-size", "4",
                     "--bptt", "3", "--calls", "5", "--rounds", "2", "--window-calls", "1")
    label = "MKL" if precision == "fp32" else "AMX"
    assert f"| product | H | oneDNN us | {label} us | oneDNN / {label} |" in out
    assert f"| H | phase | oneDNN | {label} | {label} / oneDNN time |" in out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith(("| product", "| H "))]
    products = [r for r in rows if r[0] in ("forward", "backward")]
    assert [(r[0], r[1]) for r in products] == [("forward", "16"), ("backward", "16"), ("forward", "32"),
                                                ("backward", "32")]
    for _, _, onednn, other, ratio in products:
        onednn, other, ratio = float(onednn), float(other), float(ratio)
        assert onednn > 0 and other > 0
        rounding = ratio * (0.05 / onednn + 0.05 / other) * 1.01  # the microseconds are printed to 0.1
        assert abs(ratio - onednn / other) <= 0.006 + rounding
    model = [r for r in rows if r[0] in ("16", "32")]
    assert [(r[0], r[1]) for r in model] == [(h, p) for h in ("16", "32") for p in ("train", "infer", "model")]
    assert all(float(x) > 0 for r in model for x in r[2:])

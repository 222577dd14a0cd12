"""scripts/weight-grad-speed: the fp32 weight gradients from the C++ backward's transposed
copies against torch.mm on the window's buffers, in the whole model (docs/kernels.md)."""

from __future__ import annotations

import pytest

from conftest import run_script
from zlm.model.cells import compiled, cpu_ext


def test_weight_grad_speed_prints_its_table():
    ext = cpu_ext.load_extension()
    if ext is None:
        pytest.skip(f"no compiled cell here: {cpu_ext.unavailable_reason()}")
    out = run_script("weight-grad-speed", "--hidden", "16,32", "--batch-size", "4", "--bptt", "3", "--rounds", "2",
                     "--window-calls", "1")
    chosen = "transposed copies" if compiled.transposed_grads() else "views"
    assert f"zlm takes the {chosen} here" in out.splitlines()[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| H ")]
    assert [(r[0], r[1]) for r in rows] == [(h, p) for h in ("16", "32") for p in ("train", "model")]
    assert all(float(x) > 0 for r in rows for x in r[2:])

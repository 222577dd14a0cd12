"""Resolve once: `auto` is resolved when a run starts, stored in config.json, reused on resume."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from conftest import train_run
from zlm.core.config import TrainConfig
from zlm.core.metrics import read_metrics
from zlm.core.reporter import Reporter
from zlm.core.spec import PRODUCT_NAMES, Resolved
from zlm.data.dataset import Dataset
from zlm.errors import CheckpointError
from zlm.model.cells import choose_cell, cpu_ext, recurrent_product
from zlm.model.lm import ModelConfig
from zlm.training import resolve

CPU = torch.device("cpu")


def _cfgs(data: Dataset, **kw):
    mc = ModelConfig(vocab_size=data.vocab_size, hidden=16, embed=8, zoneout_cell=kw.pop("zc", 0.2))
    return mc, TrainConfig(**{"batch_size": 4, "bptt": 16, "max_steps": 2, "eval_every": 2, "eval_streams": 2,
                              "device": "cpu", **kw})


def test_a_fresh_run_stores_what_auto_became(tiny_data, tmp_path):
    data = Dataset.open(tiny_data)
    train_run(tmp_path / "run", data, *_cfgs(data))
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["train"]["precision"] == "auto" and config["train"]["cell"] == "auto"  # as given
    want = resolve.resolve_fresh(TrainConfig(device="cpu"), ModelConfig(vocab_size=5, hidden=16, zoneout_cell=0.2), CPU)
    assert config["resolved"] == want.to_dict()
    assert config["resolved"]["cell"] == "fused" and config["resolved"]["kernel"] in ("compiled", "python")
    ck = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    assert json.loads((ck / "config.json").read_text())["resolved"] == config["resolved"]


def test_resume_never_re_resolves_auto(tiny_data, tmp_path, monkeypatch):
    """The machine now says bf16 (as a CPU with native bf16 would); the resumed run keeps fp32."""
    data = Dataset.open(tiny_data)
    mc, tc = _cfgs(data)
    monkeypatch.setattr("zlm.core.precision.cpu_bf16_native", lambda flags=None: False)
    train_run(tmp_path / "run", data, mc, tc)  # started on a CPU without native bf16
    monkeypatch.setattr("zlm.core.precision.cpu_bf16_native", lambda flags=None: True)
    assert resolve.resolve_fresh(tc, mc, CPU).precision == "bf16"  # what a re-resolution would give
    shown = []

    class Shown(Reporter):
        def start(self, info):
            shown.append(info)

    train_run(tmp_path / "run", data, mc, TrainConfig(**{**tc.to_dict(), "max_steps": 4}), resume=True,
              reporter=Shown())
    starts = [e for e in read_metrics(tmp_path / "run" / "metrics.jsonl") if e["event"] == "start"]
    assert [s["runtime"] for s in starts] == ["cpu fp32", "cpu fp32"]
    assert shown[0]["runtime"] == "cpu fp32 (as this run was started)"  # why auto chose it is not stored
    assert json.loads((tmp_path / "run" / "config.json").read_text())["resolved"]["precision"] == "fp32"


def test_auto_runs_torchs_lstm_kernel_without_zoneout(tiny_data, tmp_path):
    assert choose_cell("auto", CPU, zoneout=(0.0, 0.0)).name == "plain"
    assert choose_cell("auto", CPU, zoneout=(0.0, 0.05)).name == "fused"
    data = Dataset.open(tiny_data)
    mc, tc = _cfgs(data, zc=0.0)
    mc = ModelConfig(**{**mc.to_dict(), "zoneout_hidden": 0.0})
    train_run(tmp_path / "run", data, mc, tc)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["resolved"]["cell"] == "plain" and config["resolved"]["kernel"] == "plain"
    start = [e for e in read_metrics(tmp_path / "run" / "metrics.jsonl") if e["event"] == "start"][0]
    assert start["cell"] == "plain"
    # The log names the machine its speed was measured on (CPU model and threads).
    assert start["machine"] == f"{cpu_ext.cpu_name()}, {torch.get_num_threads()} threads"


def test_a_run_records_its_recurrent_product_and_a_resume_elsewhere_says_it_differs():
    """The compiled cell's recurrent products (MKL, AMX, oneDNN) round differently in bf16:
    config.json records which ran, and a resume on a machine with another says so."""
    mc = ModelConfig(vocab_size=5, hidden=16, embed=8, zoneout_cell=0.2)
    for precision in ("fp32", "bf16"):
        fresh = resolve.resolve_fresh(TrainConfig(device="cpu", precision=precision), mc, CPU)
        assert fresh.kernel == "compiled"  # CI builds the C++ step
        assert fresh.product == recurrent_product("compiled", precision, 16) != ""
        assert Resolved(**fresh.to_dict()) == fresh and fresh.to_dict()["product"] == fresh.product
        ext = cpu_ext.load_extension()
        if precision == "bf16" and ext.amx_ready():
            assert fresh.product == "amx"
        heard = []
        resolve.cell_for(fresh, "auto", mc, CPU, heard.append)
        assert heard == []  # the same machine
        resolve.cell_for(replace(fresh, product=""), "auto", mc, CPU, heard.append)
        assert heard == []  # a config.json from before products were recorded
        other = "addmm" if fresh.product != "addmm" else "mkl"
        resolve.cell_for(replace(fresh, product=other), "auto", mc, CPU, heard.append)
        assert len(heard) == 1 and PRODUCT_NAMES[other] in heard[0] and PRODUCT_NAMES[fresh.product] in heard[0]
        assert "not bit for bit" not in heard[0] and "differ in the last bits" in heard[0]
    # Other kernels record none; an unknown product is refused in one line.
    assert recurrent_product("reference", "fp32", 16) == "" and recurrent_product("plain", "bf16", 16) == ""
    with pytest.raises(CheckpointError, match="unknown recurrent product 'tpu'"):
        Resolved("fp32", "fused", "compiled", product="tpu")
    assert "product" not in Resolved("fp32", "plain", "plain").to_dict()

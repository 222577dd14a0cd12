"""zlm.info: what a checkpoint holds, from JSON and safetensors headers only."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct

import pytest
import safetensors
import safetensors.torch

from conftest import shakespeare_text, train_run, write_char_dataset
from zlm.core.config import TrainConfig
from zlm.data.dataset import Dataset
from zlm.errors import CheckpointError
from zlm.inference.language_model import load
from zlm.model.lm import ModelConfig
from zlm.tools.info import describe


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("info")
    data = Dataset.open(write_char_dataset(root / "data", shakespeare_text(20_000)))
    train_run(root / "run", data, ModelConfig(vocab_size=data.vocab_size, hidden=16, embed=8, layers=2),
          TrainConfig(batch_size=4, bptt=20, max_steps=6, eval_every=3, log_every=100))
    return root / "run"


def _forbid_tensor_loading(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("zlm info must not load tensors")

    for mod in (safetensors, safetensors.torch):
        for name in ("safe_open", "load_file", "load"):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, boom)
    monkeypatch.setattr("zlm.core.checkpoint.load_file", boom)


def _garble_tensor_data(path):
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n :] = b"\xff" * (len(raw) - 8 - n)  # same size, nonsense where the tensors were
    path.write_bytes(bytes(raw))


def test_info_reads_headers_and_json_only(run, tmp_path, monkeypatch):
    lm = load(run)
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    _garble_tensor_data(copy / "best" / "model.safetensors")
    _forbid_tensor_loading(monkeypatch)
    info = describe(copy)
    assert info["checkpoint"] == str(copy / "best")
    assert info["parameters"] == lm.model.num_parameters()
    assert info["model"]["layers"] == 2 and info["model"]["hidden"] == 16
    assert info["tokenizer"]["kind"] == "char"
    assert info["tokenizer"]["vocab_size"] == lm.tokenizer.vocab_size
    trainer = json.loads((run / "best" / "trainer.json").read_text())
    assert info["step"] == trainer["step"]
    assert info["best_valid_bpc"] == pytest.approx(trainer["best_bpc"])
    assert info["mismatches"] == []
    names = {f["name"]: f["bytes"] for f in info["files"]}
    assert names["model.safetensors"] == (copy / "best" / "model.safetensors").stat().st_size
    assert {"config.json", "checkpoint.json", "tokenizer.json"} <= set(names)
    assert info["run"]["latest_step"] == 6 and len(info["run"]["checkpoints"]) == 2


def test_info_on_a_step_checkpoint_and_a_run_without_best(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "best")
    info = describe(copy)
    assert info["checkpoint"].endswith("step-00000006") and info["step"] == 6
    assert describe(copy / "checkpoints" / "step-00000003")["step"] == 3


def test_info_reports_config_and_tensor_disagreement(run, tmp_path):
    copy = tmp_path / "ck"
    shutil.copytree(run / "best", copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["model"]["hidden"] = 20
    (copy / "config.json").write_text(json.dumps(cfg))
    manifest = json.loads((copy / "checkpoint.json").read_text())
    manifest["files"]["config.json"] = {"bytes": (copy / "config.json").stat().st_size,
                                        "sha256": hashlib.sha256((copy / "config.json").read_bytes()).hexdigest()}
    (copy / "checkpoint.json").write_text(json.dumps(manifest))  # consistent again
    info = describe(copy)
    assert any("layers.0.weight_hh" in m for m in info["mismatches"])


def test_info_errors(run, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        describe(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        describe(tmp_path / "empty")

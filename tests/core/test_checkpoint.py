"""zlm.core.checkpoint: atomic directories, manifests, JSON reading contracts, weight checks."""

from __future__ import annotations

import json

import pytest
import torch

from zlm.core import checkpoint as ckpt
from zlm.errors import CheckpointError


def _write(run, step: int):
    final = run / "checkpoints" / f"step-{step:08d}"
    tmp = ckpt.temp_directory(final)
    ckpt.write_tensors(tmp / "model.safetensors", {"w": torch.full((2, 2), float(step))})
    ckpt.write_json(tmp / "config.json", {"step": step})
    return ckpt.finish_directory(tmp, final, step)


def test_latest_complete_and_prune(tmp_path):
    run = tmp_path / "run"
    for s in (1, 2, 3, 4):
        _write(run, s)
    ckpt.prune(run, 2)
    (run / "checkpoints" / "step-00000009").mkdir()  # no manifest: incomplete, never chosen
    assert ckpt.latest_complete(run).name == "step-00000004"
    assert [p.name for p in ckpt.step_dirs(run) if (p / "checkpoint.json").exists()] == \
        ["step-00000003", "step-00000004"]
    tensors, _ = ckpt.read_tensors(ckpt.latest_complete(run) / "model.safetensors")
    assert torch.equal(tensors["w"], torch.full((2, 2), 4.0))


def test_read_json_contracts(tmp_path):
    good, bad, lst = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    good.write_text(json.dumps({"x": 1}))
    bad.write_text("{not json")
    lst.write_text("[1, 2]")
    assert ckpt.read_json(good, "thing") == {"x": 1} == ckpt.read_json_or_none(good)
    for p in (bad, lst, tmp_path / "missing.json"):
        with pytest.raises(CheckpointError, match="damaged"):
            ckpt.read_json(p, "thing")
        assert ckpt.read_json_or_none(p) is None


def test_check_weights_names_the_mismatch():
    own = {"a": torch.zeros(2, 3), "b": torch.zeros(3)}
    ckpt.check_weights(own, {"a": torch.ones(2, 3), "b": torch.ones(3)}, "ck")
    with pytest.raises(CheckpointError, match="missing"):
        ckpt.check_weights(own, {"a": torch.ones(2, 3)}, "ck")
    with pytest.raises(CheckpointError, match="tensor b"):
        ckpt.check_weights(own, {"a": torch.ones(2, 3), "b": torch.ones(4)}, "ck")

"""zlm.inference.load: a checkpoint comes back as it was saved, without initialising first."""

from __future__ import annotations

import pytest
import torch

from conftest import train_run
from zlm.core import checkpoint as ckpt
from zlm.core.config import TrainConfig
from zlm.data.dataset import Dataset
from zlm.inference.load import load_model
from zlm.model.lm import ModelConfig, ZoneoutLM


def test_load_model_returns_the_saved_weights_without_running_the_initialisers(tiny_data, tmp_path, monkeypatch):
    data = Dataset.open(tiny_data)
    mc = ModelConfig(vocab_size=data.vocab_size, hidden=16, embed=8, layers=2, zoneout_cell=0.2)
    train_run(tmp_path / "run", data, mc, TrainConfig(batch_size=4, bptt=16, max_steps=2, eval_every=2,
                                                      eval_streams=2, device="cpu", precision="fp32"))
    saved = ckpt.load(tmp_path / "run").model

    def refuse(*a, **k):  # the orthogonal initialiser: a QR per gate, 1.3 s at H 2048
        raise AssertionError("load_model initialised weights it loads next")

    monkeypatch.setattr(torch.nn.init, "orthogonal_", refuse)
    lm = load_model(tmp_path / "run", device="cpu")
    got = lm.model.state_dict()
    assert set(got) == set(saved)
    for k, v in saved.items():
        assert torch.equal(got[k], v), k
    # A model built for training still initialises (and refuses here, so the patch is live).
    with pytest.raises(AssertionError, match="initialised"):
        ZoneoutLM(mc)

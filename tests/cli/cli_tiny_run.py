"""A tiny trained RUN_DIR for the CLI tests of tests/cli (char and byte tokenizers)."""

from __future__ import annotations

import pathlib

from conftest import shakespeare_text, train_run, write_char_dataset
from zlm.core.config import TrainConfig
from zlm.data.dataset import Dataset
from zlm.model.lm import ModelConfig


def train_tiny(root: pathlib.Path, text: str | None = None, layers: int = 1) -> pathlib.Path:
    """RUN_DIR of a 1 x 32 char model trained for 10 steps on ~30k characters (~1 s)."""
    data = Dataset.open(write_char_dataset(root / "data", text or shakespeare_text(30_000)))
    train_run(root / "run", data, ModelConfig(vocab_size=data.vocab_size, hidden=32, embed=8,
                                          layers=layers),
          TrainConfig(batch_size=4, bptt=20, max_steps=10, eval_every=10, log_every=100))
    return root / "run"

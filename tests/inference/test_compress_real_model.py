"""Slow: a trained 1x256 model codes 1 MB of tiny Shakespeare exactly, static and adaptive;
a repeated line costs less than twice xz -9e's 168 bytes, random bytes are stored.

Run with `python -m pytest -m slow tests/inference/test_compress_real_model.py`. Set
ZLM_COMPRESS_RUN=RUN_DIR to use an already trained model instead of training one here.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from conftest import TINY_SHAKESPEARE, need_corpus, train_run, write_char_dataset
from zlm.core.config import TrainConfig
from zlm.data.dataset import Dataset
from zlm.inference.compress import compress_bytes, decompress_bytes, load_for_coding
from zlm.inference.dynamic import DynamicConfig
from zlm.model.lm import ModelConfig


@pytest.mark.slow
def test_one_megabyte_roundtrip_with_a_trained_model(tmp_path):
    text = need_corpus(TINY_SHAKESPEARE).read_text(encoding="utf-8")
    run = os.environ.get("ZLM_COMPRESS_RUN")
    if run is None:
        data = Dataset.open(write_char_dataset(tmp_path / "data", text))
        train_run(tmp_path / "run", data, ModelConfig(vocab_size=data.vocab_size, hidden=256, embed=64),
              TrainConfig(batch_size=32, bptt=100, max_steps=150, eval_every=150, log_every=1000,
                          reset_prob=0.02))  # as cpu-small: 64 cold-start streams need it
        run = tmp_path / "run"
    lm = load_for_coding(Path(run))
    raw = text.encode("utf-8")[:1_000_000]
    for adapt in (None, DynamicConfig()):
        blob, r = compress_bytes(lm, raw, adapt)
        assert r.streams == 64
        assert r.compressed_bytes - r.header_bytes <= r.model_bits / 8 * 1.005 + 5
        assert r.compressed_bytes < 0.45 * len(raw)  # a trained model: well under 3.6 bits/byte
        back, _ = decompress_bytes(lm, blob)
        assert back == raw
    line = "Crème brûlée — 東京の天気は雨 🌧 naïve\n".encode() * 200  # xz -9e: 168 bytes
    noise = random.Random(0).randbytes(20_000)
    for data, most in ((line, 2 * 168), (noise, len(noise) + 40)):
        blob, r = compress_bytes(lm, data)
        assert len(blob) <= most, (len(blob), most)
        assert decompress_bytes(lm, blob)[0] == data

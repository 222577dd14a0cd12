"""Memory bounds: training and evaluating from memory-mapped splits far larger than what
the process may hold. Measured as anonymous resident memory (RssAnon: what the process
owns, excluding the reclaimable page cache behind the memory map)."""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time

import numpy as np
import torch

from conftest import train_run
from zlm.core.config import TrainConfig
from zlm.core.eval_protocol import EvalProtocol, evaluate_predictions
from zlm.core.precision import resolve_runtime
from zlm.data.dataset import Dataset
from zlm.data.tokenizers import CharTokenizer
from zlm.model.lm import ModelConfig, ZoneoutLM

MB = 1024 * 1024


def _rss_anon_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _sparse_dataset(root, train_tokens: int, valid_tokens: int):
    """A DATA_DIR whose splits are sparse files of zeros: huge on paper, free on disk."""
    root.mkdir()
    tok = CharTokenizer("ab")
    tok.save(root)
    splits = {}
    for name, n in (("train", train_tokens), ("valid", valid_tokens), ("test", 1000)):
        with open(root / f"{name}.bin", "wb") as f:
            f.truncate(n)
        splits[name] = {"file": f"{name}.bin", "tokens": n, "characters": n, "bytes": n}
    meta = {"format": "zlm-dataset", "version": 1, "zlm_version": "test",
            "tokenizer": {"kind": "char", "vocab_size": 2, "file": "tokenizer.json"},
            "dtype": "uint8", "unit": "character", "splits": splits,
            "source": {"name": "sparse", "paths": [], "sha256": ""}, "unknown": "error"}
    (root / "dataset.json").write_text(json.dumps(meta))
    return Dataset.open(root)


def _trim() -> None:
    """Hand freed heap memory back to the OS (glibc), so RssAnon counts live memory only."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _peak_and_retained_mb(fn, *args):
    """(peak, retained) growth of anonymous memory over fn(*args), sampled every 2 ms, and its result."""
    _trim()
    before = _rss_anon_mb()
    peak, done = [before], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon_mb())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = fn(*args)
    finally:
        done.set()
        watcher.join()
    _trim()
    return peak[0] - before, _rss_anon_mb() - before, result


def test_evaluating_a_split_larger_than_the_budget_stays_bounded(tmp_path):
    """Evaluation holds one window (streams x bptt tokens) at a time: its peak memory does not
    grow with the length of the split, and nothing of the split is kept afterwards. (What
    RssAnon shows right after a call depends on when glibc trims its heap: it read anything
    from 3 to 261 MB for the same call, hence the trim and the peak.)"""
    torch.manual_seed(0)
    model = ZoneoutLM(ModelConfig(vocab_size=2, hidden=4, embed=2))
    runtime = resolve_runtime("cpu", "fp32")
    protocol = EvalProtocol(streams=8192, bptt=1024)  # 8M-token windows
    peaks = []
    for mb in (24, 72):
        tokens = _sparse_dataset(tmp_path / f"d{mb}", 10_000, mb * MB).tokens("valid")
        peak, retained, (nats, count) = _peak_and_retained_mb(evaluate_predictions, model, tokens, runtime, protocol)
        assert count == len(tokens) - 1 and np.isfinite(nats)
        assert retained < 64, f"{retained:.0f} MB still held after evaluating a {mb} MB split"
        peaks.append(peak)
    # A whole-split index and window would be 16 bytes per token: 768 MB more for the
    # second split's 48M more tokens. The sampled peak of one call varies by ~100 MB from
    # run to run (905-1030 MB measured for the same 24 MB split), hence the margin.
    assert peaks[1] - peaks[0] < 250, f"peak memory grew with the split: {peaks[0]:.0f} -> {peaks[1]:.0f} MB"


def test_training_from_a_huge_memory_mapped_split_stays_bounded(tmp_path):
    """Training reads its windows from the memory map: its peak anonymous memory does not
    grow with the split. Compared between the same run on a 2 MB and on a 2 GB training
    split, both after a first run that pays the one-time costs (thread pools, the cell,
    allocator caches), each with glibc's heap trimmed around it (`_peak_and_retained_mb`):
    a raw RssAnon delta over one run mostly measures those and when glibc trims."""
    mc = ModelConfig(vocab_size=2, hidden=16, embed=4)
    tc = TrainConfig(batch_size=8, bptt=16, max_steps=5, eval_every=5, log_every=1, eval_streams=4)
    peaks, retained = {}, {}
    for name, train_mb in (("warm-up", 2), ("small", 2), ("huge", 2048)):
        data = _sparse_dataset(tmp_path / name, train_mb * MB, 50_000)
        peaks[name], retained[name], _ = _peak_and_retained_mb(train_run, tmp_path / f"run-{name}", data, mc, tc)
    assert os.path.getsize(data.path / "train.bin") == 2048 * MB
    # A copy of the split would be 2048 MB (uint8 tokens) or 16 GB (int64 ids).
    grown = peaks["huge"] - peaks["small"]
    assert grown < 100, f"peak memory grew by {grown:.0f} MB from a 2 MB to a 2 GB training split"
    assert retained["huge"] - retained["small"] < 64, retained

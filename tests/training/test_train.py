"""Training: exact resume, guards, signals, run directories, a falling loss."""

from __future__ import annotations

import collections
import json
import math
import os
import signal

import pytest
import torch

from conftest import train_run
from zlm.core.config import TrainConfig
from zlm.core.metrics import read_metrics
from zlm.core.reporter import Reporter
from zlm.data.dataset import Dataset
from zlm.errors import DataError, NonFiniteError, UsageError
from zlm.model.lm import ModelConfig


class Recorder(Reporter):
    def __init__(self):
        self.messages = []

    def message(self, text):
        self.messages.append(text)


def _cfgs(data, **train_kw):
    mc = ModelConfig(vocab_size=data.vocab_size, hidden=32, embed=8, zoneout_cell=0.5,
                     zoneout_hidden=0.1, dropout=0.1)
    kw = dict(batch_size=4, bptt=20, eval_every=5, log_every=1, seed=7, eval_streams=4)
    kw.update(train_kw)
    return mc, TrainConfig(**kw)


def _losses(run_dir):
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl") if r["event"] == "step"]


@pytest.mark.parametrize("cell", ["reference", "auto"])
@pytest.mark.parametrize("state", ["carry", "reset", "carry+resets"])
def test_resume_is_bit_identical(tiny_data, tmp_path, cell, state):
    data = Dataset.open(tiny_data)
    kw = dict(state="carry", reset_prob=0.3) if state == "carry+resets" else dict(state=state)
    mc, tc = _cfgs(data, max_steps=14, cell=cell, **kw)
    train_run(tmp_path / "a", data, mc, tc)
    mc, half = _cfgs(data, max_steps=7, cell=cell, **kw)
    train_run(tmp_path / "b", data, mc, half)
    rec = Recorder()
    train_run(tmp_path / "b", data, mc, tc, resume=True, reporter=rec)
    assert any("resumed from" in m for m in rec.messages)
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert [s for s, _ in b] == list(range(1, 15))
    assert a == b  # bit-identical floats, not approximately equal
    from safetensors.torch import load_file

    ma = load_file(str(tmp_path / "a" / "checkpoints" / "step-00000014" / "model.safetensors"))
    mb = load_file(str(tmp_path / "b" / "checkpoints" / "step-00000014" / "model.safetensors"))
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_resume_is_bit_identical_with_the_fused_loss(tmp_path):
    """A vocabulary large enough for the fused training loss (each character of tiny
    Shakespeare in one of ten variants, about 650 tokens): resume still reproduces the
    uninterrupted run bit for bit."""
    from conftest import shakespeare_text, write_char_dataset
    from zlm.model.lm import FUSED_NLL_MIN_VOCAB

    text = "".join(chr(0x4E00 + ord(c) * 10 + i % 10) for i, c in enumerate(shakespeare_text(30_000)))
    data = Dataset.open(write_char_dataset(tmp_path / "data", text))
    assert data.vocab_size >= FUSED_NLL_MIN_VOCAB
    mc, tc = _cfgs(data, max_steps=10, state="carry", reset_prob=0.3)
    train_run(tmp_path / "a", data, mc, tc)
    train_run(tmp_path / "b", data, *_cfgs(data, max_steps=5, state="carry", reset_prob=0.3))
    train_run(tmp_path / "b", data, mc, tc, resume=True)
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    from safetensors.torch import load_file

    ma = load_file(str(tmp_path / "a" / "checkpoints" / "step-00000010" / "model.safetensors"))
    mb = load_file(str(tmp_path / "b" / "checkpoints" / "step-00000010" / "model.safetensors"))
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_sigterm_saves_and_resume_continues_exactly(tiny_data, tmp_path):
    data = Dataset.open(tiny_data)
    mc, tc = _cfgs(data, max_steps=12, eval_every=100)
    train_run(tmp_path / "a", data, mc, tc)

    def kill_at_5(step, loss):
        if step == 4:  # during the 5th step: the step completes, then the loop stops
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    summary = train_run(tmp_path / "b", data, mc, tc, fault=kill_at_5)
    assert summary["interrupted"] == "SIGTERM" and summary["step"] == 5
    assert (tmp_path / "b" / "checkpoints" / "step-00000005" / "checkpoint.json").exists()
    train_run(tmp_path / "b", data, mc, tc, resume=True)
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")


def test_non_empty_run_dir_is_refused_and_resume_without_checkpoint_starts_fresh(tiny_data, tmp_path):
    data = Dataset.open(tiny_data)
    mc, tc = _cfgs(data, max_steps=2)
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="--resume"):
        train_run(run, data, mc, tc)
    rec = Recorder()
    train_run(run, data, mc, tc, resume=True, reporter=rec)
    assert any("starting fresh" in m for m in rec.messages)
    assert (run / "notes.txt").read_text() == "mine"


def test_nonfinite_losses_skip_updates_then_stop(tiny_data, tmp_path):
    data = Dataset.open(tiny_data)
    mc, tc = _cfgs(data, max_steps=50, eval_every=3, max_nonfinite=3)

    def nan_after_4(step, loss):
        return loss * float("nan") if step >= 4 else loss

    with pytest.raises(NonFiniteError, match=r"last good checkpoint is \S+step-0000000[36]") as e:
        train_run(tmp_path / "run", data, mc, tc, fault=nan_after_4)
    assert e.value.exit_code == 3
    last_good = e.value.args[0].split("checkpoint is ")[1].split(";")[0]
    events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert sum(r["event"] == "nonfinite" for r in events) == 3
    # The last good checkpoint is intact and its weights are finite.
    from zlm.core import checkpoint as ckpt

    loaded = ckpt.load(last_good)
    assert all(torch.isfinite(t).all() for t in loaded.model.values())
    best = json.loads((tmp_path / "run" / "best" / "trainer.json").read_text())
    assert math.isfinite(best["valid_bpc"])


def test_single_nonfinite_step_is_not_applied(tiny_data, tmp_path):
    data = Dataset.open(tiny_data)
    mc, tc = _cfgs(data, max_steps=3, eval_every=100)

    def nan_at_1(step, loss):
        return loss * float("inf") if step == 1 else loss

    summary = train_run(tmp_path / "run", data, mc, tc, fault=nan_at_1)
    assert summary["step"] == 3
    events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in events if r["event"] == "nonfinite"] == [2]
    assert [r["step"] for r in events if r["event"] == "step"] == [1, 3]


def test_corpus_too_small_is_a_clear_error(tmp_path):
    from conftest import train_run, write_char_dataset

    data = Dataset.open(write_char_dataset(tmp_path / "d", "abcdefghij" * 30))
    mc, tc = _cfgs(data, batch_size=32, bptt=100, max_steps=1)
    with pytest.raises(DataError, match="--batch-size"):
        train_run(tmp_path / "run", data, mc, tc)
    assert not (tmp_path / "run" / "checkpoints").exists()


def _bigram_bpc(train: str, valid: str) -> float:
    """Bits per character on `valid` of a bigram model fitted to `train` (counts + 0.5): what
    the frequencies of character pairs alone give."""
    vocab = len(set(train) | set(valid))
    first = collections.Counter(train[:-1])
    pairs = collections.Counter(zip(train, train[1:], strict=False))
    bits = sum(-math.log2((pairs[a, b] + 0.5) / (first[a] + 0.5 * vocab))
               for a, b in zip(valid, valid[1:], strict=False))
    return bits / (len(valid) - 1)


def test_loss_falls_and_checkpoints_hold_only_safetensors_and_json(tiny_data, tmp_path):
    data = Dataset.open(tiny_data)
    mc = ModelConfig(vocab_size=data.vocab_size, hidden=64, embed=16, zoneout_cell=0.0, zoneout_hidden=0.0)
    tc = TrainConfig(batch_size=16, bptt=32, max_steps=240, eval_every=120, log_every=20, lr=2e-2, seed=1)
    summary = train_run(tmp_path / "run", data, mc, tc)
    train_bpc = [r["train_bpc"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
                 if r["event"] == "train"]
    # From ~log2(V) = 5.9 to below what character pairs alone give: the model must use more
    # context than the previous character. The bigram model of the train split scores 3.49
    # BPC on valid; this run reaches 2.95-2.96 valid and 3.04-3.06 train BPC (last window)
    # with seeds 1-3, so the bar keeps a 0.4-0.5 BPC margin (the seeds differ by 0.03 at most).
    # (At 120 steps it reached only 3.25-3.35, too close to the bar to tell learning apart.)
    bigram = _bigram_bpc(*(data.tokenizer.decode(data.tokens(s)) for s in ("train", "valid")))
    assert 3.4 < bigram < 3.6, bigram
    assert train_bpc[0] > 4.5 and train_bpc[-1] < bigram
    assert summary["best_valid_bpc"] < bigram
    for d in list((tmp_path / "run" / "checkpoints").iterdir()) + [tmp_path / "run" / "best"]:
        suffixes = {p.suffix for p in d.iterdir()}
        assert suffixes <= {".safetensors", ".json"}, suffixes


def test_reset_some_zeroes_the_drawn_streams_only():
    from zlm.training.trainer import reset_some

    h, c = torch.randn(2, 64, 5), torch.randn(2, 64, 5)
    h2, c2 = reset_some((h, c), 0.25, (7, 0, 3))
    zero = (h2 == 0).all(dim=(0, 2))
    assert 5 <= int(zero.sum()) <= 30  # about a quarter of 64 streams
    assert torch.equal(zero, (c2 == 0).all(dim=(0, 2)))
    assert torch.equal(h2[:, ~zero], h[:, ~zero]) and torch.equal(c2[:, ~zero], c[:, ~zero])
    again = reset_some((h, c), 0.25, (7, 0, 3))  # the same (seed, rank, step): the same draw
    assert torch.equal(again[0], h2)
    other = reset_some((h, c), 0.25, (7, 0, 4))
    assert not torch.equal(other[0], h2)
    assert reset_some((h, c), 0.0, (7, 0, 3))[0] is h


def test_reset_prob_must_be_a_probability():
    with pytest.raises(UsageError, match="--reset-prob must be in"):
        TrainConfig(reset_prob=1.0)
    with pytest.raises(UsageError, match="--reset-prob must be in"):
        TrainConfig(reset_prob=-0.1)

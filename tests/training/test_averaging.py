"""--average: the running mean of the weights over the end of a run, what validation scores
and best/ keeps; saved in checkpoints and resumed exactly."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from conftest import train_run
from zlm.core.config import TrainConfig
from zlm.core.metrics import read_metrics
from zlm.data.dataset import Dataset
from zlm.errors import UsageError
from zlm.model.lm import ModelConfig
from zlm.training.averaging import WeightAverage


def test_the_mean_and_the_swap():
    p = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    avg = WeightAverage(0.25, [("a", p[0]), ("b", p[1])])
    assert not avg.wanted(0.7) and avg.wanted(0.75) and not avg.wanted(None)
    assert not WeightAverage(0.0, []).wanted(1.0)
    seen = []
    for k in range(1, 6):
        with torch.no_grad():
            p[0].fill_(k)
            p[1].copy_(torch.full((2, 2), 10.0 * k))
        avg.add()
        seen.append(k)
    assert avg.count == 5
    torch.testing.assert_close(avg.mean[0], torch.full((3,), 3.0))  # mean of 1..5
    torch.testing.assert_close(avg.mean[1], torch.full((2, 2), 30.0))
    with avg.applied() as on:
        assert on and torch.equal(p[0].detach(), torch.full((3,), 3.0))
    assert torch.equal(p[0].detach(), torch.full((3,), 5.0))  # the live weights are back
    again = WeightAverage(0.25, [("a", p[0]), ("b", p[1])])
    with again.applied() as on:  # nothing averaged yet: nothing changes
        assert not on and torch.equal(p[0].detach(), torch.full((3,), 5.0))
    again.load(avg.tensors(), avg.count)
    assert again.count == 5 and all(torch.equal(x, y) for x, y in zip(again.mean, avg.mean, strict=True))
    with pytest.raises(UsageError, match="--average"):
        TrainConfig(average=1.0)


def _cfgs(data, **train_kw):
    mc = ModelConfig(vocab_size=data.vocab_size, hidden=32, embed=8, zoneout_cell=0.3, zoneout_hidden=0.1)
    kw = dict(batch_size=4, bptt=20, eval_every=4, log_every=1, seed=7, eval_streams=4, max_steps=12,
              average=0.5, keep_last=20)
    kw.update(train_kw)
    return mc, TrainConfig(**kw)


def test_validation_scores_the_mean_of_the_last_steps(tiny_data, tmp_path):
    data = Dataset.open(tiny_data)
    mc, tc = _cfgs(data, eval_every=1)
    train_run(tmp_path / "run", data, mc, tc)
    events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    (start,) = [e for e in events if e["event"] == "average"]
    assert start["step"] == 6  # 6 of 12 steps: the last half
    evals = {e["step"]: e for e in events if e["event"] == "eval"}
    assert [evals[s]["averaged"] for s in range(1, 13)] == [0] * 5 + list(range(1, 8))
    # The mean kept at step 12 is the mean of the live weights of steps 6..12.
    ck = tmp_path / "run" / "checkpoints"
    live = [load_file(str(ck / f"step-{s:08d}" / "model.safetensors")) for s in range(6, 13)]
    mean = load_file(str(ck / "step-00000012" / "average.safetensors"))
    for name, m in mean.items():
        torch.testing.assert_close(m, torch.stack([w[name] for w in live]).mean(0), rtol=1e-5, atol=1e-6)
    # best/ holds what validation scored: the mean, when an averaged evaluation was best.
    best_step = min(evals.values(), key=lambda e: e["valid_bpc"])["step"]
    best = load_file(str(tmp_path / "run" / "best" / "model.safetensors"))
    if best_step >= 6:
        expect = torch.stack([w["decoder.bias"] for w in live[: best_step - 5]]).mean(0)
        torch.testing.assert_close(best["decoder.bias"], expect, rtol=1e-5, atol=1e-6)


def test_averaging_resumes_exactly(tiny_data, tmp_path):
    data = Dataset.open(tiny_data)
    mc, tc = _cfgs(data)
    train_run(tmp_path / "a", data, mc, tc)

    def kill_at_9(step, loss):
        if step == 8:  # during the 9th step: averaging began at step 6
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    summary = train_run(tmp_path / "b", data, mc, tc, fault=kill_at_9)
    assert summary["interrupted"] == "SIGTERM" and summary["step"] == 9
    assert (tmp_path / "b" / "checkpoints" / "step-00000009" / "average.safetensors").is_file()
    train_run(tmp_path / "b", data, mc, tc, resume=True)

    def evals(run):
        return [(e["step"], e["valid_bpc"], e["averaged"]) for e in read_metrics(run / "metrics.jsonl")
                if e["event"] == "eval"]

    assert evals(tmp_path / "a") == evals(tmp_path / "b")  # bit-identical, the averaged ones too
    a = load_file(str(tmp_path / "a" / "best" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "best" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)

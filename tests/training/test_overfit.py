"""--on-overfit cool-down: the overfitting test, the guard's cool-down and state, and a run
that reacts (back to best/, half the lr to 0 over half an interval, stop), resumed exactly
mid-cool-down."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import train_run
from zlm.cli import app
from zlm.core.config import TrainConfig
from zlm.core.metrics import LN2, Score, read_metrics
from zlm.core.reporter import Reporter
from zlm.data.dataset import Dataset
from zlm.errors import UsageError
from zlm.model.lm import ModelConfig
from zlm.training import trainer as trainer_mod
from zlm.training.schedule import MIN_RISE, OverfitGuard, drifting, first_overfit, overfitting


def test_overfitting_needs_two_rises_by_enough_while_the_train_slice_falls():
    assert overfitting([(3.0, 2.9), (3.1, 2.8), (3.3, 2.7)])
    assert not overfitting([(3.1, 2.8), (3.3, 2.7)])  # two validations: one rise
    assert not overfitting([(3.0, 2.9), (3.3, 2.8), (3.1, 2.7)])  # rose, then fell
    assert not overfitting([(3.0, 2.9), (3.1, 2.95), (3.3, 3.0)])  # the train slice rose too: not overfitting
    small = 3.0 * MIN_RISE * 0.9  # two rises smaller in all than MIN_RISE of 3.0: noise
    assert not overfitting([(3.0, 2.9), (3.0 + small / 2, 2.8), (3.0 + small, 2.7)])
    assert not overfitting([(3.0, None), (3.1, None), (3.3, None)])  # no train slice measured
    assert first_overfit([(3.0, 2.9), (2.9, 2.8), (3.0, 2.7), (3.2, 2.6), (3.5, 2.5)]) == 3
    assert first_overfit([(3.0, 2.9), (2.9, 2.8), (2.8, 2.7)]) is None


# A small text validated once a pass: valid drifts up from its best a fraction of a percent a
# pass, down at every other validation, so it never rises twice in a row (the shape of a
# 200,000-character tiny Shakespeare at 75 passes), while the train slice keeps falling.
DRIFT = [(2.30, 2.10), (2.24, 2.00), (2.246, 1.95), (2.244, 1.90), (2.259, 1.85), (2.255, 1.80),
         (2.266, 1.75), (2.263, 1.70), (2.268, 1.65), (2.264, 1.60)]


def test_drifting_needs_two_validations_above_the_best_while_the_train_slice_falls():
    best = (2.24, 2.00)
    assert drifting([(2.266, 1.75), (2.268, 1.65)], best)  # both 1% or more above 2.24
    assert not drifting([(2.266, 1.75), (2.262, 1.70)], best)  # 2.262 < 2.24 x 1.01
    assert not drifting([(2.266, 1.75)], best)  # one validation
    assert not drifting([(2.266, 2.05), (2.268, 2.01)], best)  # the train slice is not below its best's
    assert not drifting([(2.266, 1.75), (2.268, None)], best)  # no train slice measured
    assert not drifting([(2.266, 1.75), (2.268, 1.65)], (2.24, None))
    assert not drifting([(2.266, 1.75), (2.268, 1.65)], None)
    # never twice up in a row: the rising test misses it, drifting sees it at the 8th validation
    assert not any(overfitting(DRIFT[max(0, k - 2):k + 1]) for k in range(len(DRIFT)))
    assert first_overfit(DRIFT) == 7
    guard = OverfitGuard("cool-down")
    assert [guard.observe(v, t) for v, t in DRIFT[:8]] == [False] * 7 + [True]
    assert guard.reason == "drifted" and guard.best == (2.24, 2.00)
    # a new best resets the reference: the same drift 1% above a lower best is not yet one
    assert first_overfit([*DRIFT[:7], (2.20, 1.62), (2.218, 1.60), (2.221, 1.58)]) is None


# locales (glibc's locale definitions, 4 MB) at 2.9 passes on 2 AVX2 cores, seed 1: one bad
# validation (0.946 after a best of 0.840) and the next climbing back (0.855, averaged
# weights), both 1% above the best while the train slice fell. The guard used to react there
# and stop the run at 0.815; the same plan without the guard kept improving to 0.789.
CLIMB_BACK = [(1.1267, 1.2135), (1.0367, 1.0495), (1.0037, 1.0213), (0.9241, 0.8736), (0.8396, 0.8656),
              (0.9458, 0.8440), (0.8552, 0.7452)]


def test_a_run_climbing_back_from_one_bad_validation_is_not_drifting():
    best = (0.8396, 0.8656)
    assert not drifting(CLIMB_BACK[-2:], best)  # 0.855 is 1% or more below 0.946: climbing back
    assert drifting([(0.9458, 0.8440), (0.9400, 0.7452)], best)  # less than 1% back: still drifting
    assert drifting([(0.9458, 0.8440), (0.9500, 0.7452)], best)
    assert first_overfit(CLIMB_BACK) is None
    assert first_overfit([*CLIMB_BACK, (0.8600, 0.7300)]) == 7  # it stays above its best: now it drifts


def test_the_guard_keeps_the_best_across_a_resume():
    guard = OverfitGuard("cool-down")
    for v, t in DRIFT[:6]:
        assert not guard.observe(v, t)
    again = OverfitGuard("cool-down")
    again.load_state_dict(guard.state_dict())
    assert again.best == guard.best == (2.24, 2.00) and again.history == guard.history
    assert [again.observe(v, t) for v, t in DRIFT[6:8]] == [False, True]
    old = guard.state_dict()
    del old["best"]  # a checkpoint written before the guard watched drifting: it watches from there on
    older = OverfitGuard("cool-down")
    older.load_state_dict(old)
    assert older.best is None
    assert [older.observe(v, t) for v, t in DRIFT[6:8]] == [False, False]


def test_the_guard_reacts_once_cools_linearly_and_keeps_its_state():
    guard = OverfitGuard("cool-down")
    assert [guard.observe(v, t) for v, t in [(3.0, 2.9), (3.1, 2.8)]] == [False, False]
    assert not guard.observe(math.inf, 2.7)  # a diverged validation is not watched
    assert guard.observe(3.3, 2.7)
    assert guard.lr(15, 2e-3) == 2e-3 and not guard.finished(15)
    cool = guard.react(15, 10, 2e-3, best_step=5)  # half of 10 steps from half of 2e-3
    assert (cool.at, cool.until, cool.lr) == (15, 20, 1e-3)
    assert [guard.lr(s, 9.0) for s in range(15, 21)] == pytest.approx([1e-3, 8e-4, 6e-4, 4e-4, 2e-4, 0.0])
    assert guard.finished(20) and not guard.finished(19)
    assert not guard.observe(3.5, 2.6)  # once per run
    again = OverfitGuard("cool-down")
    again.load_state_dict(guard.state_dict())
    assert again.cool == cool and again.history == guard.history
    fresh = OverfitGuard("cool-down")
    fresh.load_state_dict(None)  # a checkpoint written before the guard existed
    assert fresh.history == [] and fresh.cool is None
    watching = OverfitGuard("continue")  # records, never reacts
    assert not any(watching.observe(v, t) for v, t in [(3.0, 2.9), (3.1, 2.8), (3.3, 2.7)])
    with pytest.raises(UsageError, match="--on-overfit continue or cool-down"):
        TrainConfig(on_overfit="stop")


VALID = {10: 3.0, 20: 3.1, 30: 3.3, 35: 3.05}  # step -> scripted valid BPC: rises at 20 and 30
TRAIN = {10: 2.9, 20: 2.8, 30: 2.7, 35: 2.65}  # and the train slice falls


@pytest.fixture
def scripted(monkeypatch):
    """Validation scores VALID/TRAIN at their steps (the real scores at other steps), so a
    tiny run overfits on cue."""
    real_eval, real_slice, real_validate = trainer_mod.evaluate_tokens, trainer_mod.Trainer._train_slice_bpc, \
        trainer_mod.Trainer.validate
    now = {}

    def validate(self):
        now["step"] = self.state.step
        return real_validate(self)

    def evaluate(*args, **kwargs):
        score = real_eval(*args, **kwargs)
        if now["step"] not in VALID:
            return score
        return Score(nats=VALID[now["step"]] * score.characters * LN2, tokens=score.tokens,
                     characters=score.characters, bytes=score.bytes)

    def train_slice(self):
        return TRAIN.get(self.state.step) or real_slice(self)

    monkeypatch.setattr(trainer_mod.Trainer, "validate", validate)
    monkeypatch.setattr(trainer_mod, "evaluate_tokens", evaluate)
    monkeypatch.setattr(trainer_mod.Trainer, "_train_slice_bpc", train_slice)


def _cfgs(data, **train_kw):
    mc = ModelConfig(vocab_size=data.vocab_size, hidden=32, embed=8, zoneout_cell=0.3, zoneout_hidden=0.1)
    kw = dict(batch_size=4, bptt=20, eval_every=10, log_every=1, seed=7, eval_streams=4, max_steps=60,
              lr=2e-3, keep_last=20, on_overfit="cool-down")
    kw.update(train_kw)
    return mc, TrainConfig(**kw)


class Recorder(Reporter):
    def __init__(self):
        self.messages = []

    def message(self, text):
        self.messages.append(text)


def test_a_run_that_overfits_goes_back_to_best_cools_down_and_stops(tiny_data, tmp_path, scripted):
    data = Dataset.open(tiny_data)
    rec = Recorder()
    summary = train_run(tmp_path / "run", data, *_cfgs(data), reporter=rec)
    (said,) = [m for m in rec.messages if m.startswith("overfitting")]
    assert "(3.000 -> 3.100 -> 3.300)" in said and "back to best/ (step 10, 3.000)" in said
    assert "lr cooled from 0.001 (0.5 x the schedule's) to 0 over 5 steps, then the run stops" in said
    assert summary["step"] == 35 and summary["overfit_at"] == 30  # 60 planned
    events = read_metrics(tmp_path / "run" / "metrics.jsonl")
    (overfit,) = [e for e in events if e["event"] == "overfit"]
    assert (overfit["step"], overfit["best_step"], overfit["until"]) == (30, 10, 35)
    assert overfit["valid"] == pytest.approx([3.0, 3.1, 3.3]) and overfit["train_slice"] == [2.9, 2.8, 2.7]
    lrs = {e["step"]: e["lr"] for e in events if e["event"] == "step"}
    assert [lrs[s] for s in range(21, 31)] == [2e-3] * 10
    assert [lrs[s] for s in range(31, 36)] == pytest.approx([1e-3, 8e-4, 6e-4, 4e-4, 2e-4])
    assert [e["step"] for e in events if e["event"] == "eval"] == [10, 20, 30, 35]  # the last at the end
    ck = tmp_path / "run" / "checkpoints"
    at_best, after = (load_file(str(ck / f"step-{s:08d}" / "model.safetensors")) for s in (10, 30))
    assert all(torch.equal(at_best[k], after[k]) for k in at_best)  # the weights of step 10 back at 30
    best = load_file(str(tmp_path / "run" / "best" / "model.safetensors"))
    assert all(torch.equal(at_best[k], best[k]) for k in best)  # 3.05 at step 35 is not better than 3.0

    shown = CliRunner().invoke(app, ["info", str(tmp_path / "run")])
    assert shown.exit_code == 0, shown.output
    assert "overfitting: seen at step 30: back to step 10's weights (best/), lr cooled from 0.001 to 0 until " \
           "step 35, then stopped" in shown.output

    summary = train_run(tmp_path / "on", data, *_cfgs(data, on_overfit="continue"))
    assert summary["step"] == 60 and "overfit_at" not in summary
    assert not [e for e in read_metrics(tmp_path / "on" / "metrics.jsonl") if e["event"] == "overfit"]


def test_a_run_that_drifts_reacts_too(tiny_data, tmp_path, scripted, monkeypatch):
    """Valid up then down, both 1% or more above the best: never two rises in a row."""
    monkeypatch.setitem(VALID, 20, 3.05)
    monkeypatch.setitem(VALID, 30, 3.04)
    data = Dataset.open(tiny_data)
    rec = Recorder()
    summary = train_run(tmp_path / "run", data, *_cfgs(data), reporter=rec)
    (said,) = [m for m in rec.messages if m.startswith("overfitting")]
    assert ("valid BPC stayed 1% or more above its best, 3.000, at the last 2 validations (3.050, 3.040) "
            "while the train slice's fell below its 2.900 there (to 2.700); back to best/ (step 10, 3.000)") in said
    assert summary["step"] == 35 and summary["overfit_at"] == 30
    (overfit,) = [e for e in read_metrics(tmp_path / "run" / "metrics.jsonl") if e["event"] == "overfit"]
    assert overfit["reason"] == "drifted" and overfit["best_step"] == 10


def test_a_cool_down_resumes_exactly(tiny_data, tmp_path, scripted):
    data = Dataset.open(tiny_data)
    mc, tc = _cfgs(data)
    train_run(tmp_path / "a", data, mc, tc)

    def kill_at_32(step, loss):
        if step == 31:  # during the 32nd step: two steps into the cool-down
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    summary = train_run(tmp_path / "b", data, mc, tc, fault=kill_at_32)
    assert summary["interrupted"] == "SIGTERM" and summary["step"] == 32
    summary = train_run(tmp_path / "b", data, mc, tc, resume=True)
    assert summary["step"] == 35 and summary["overfit_at"] == 30

    def log(run, kind, *fields):
        return [tuple(e[f] for f in fields) for e in read_metrics(run / "metrics.jsonl") if e["event"] == kind]

    a, b = tmp_path / "a", tmp_path / "b"
    assert log(a, "step", "step", "loss", "lr") == log(b, "step", "step", "loss", "lr")  # bit-identical
    assert log(a, "eval", "step", "valid_bpc") == log(b, "eval", "step", "valid_bpc")

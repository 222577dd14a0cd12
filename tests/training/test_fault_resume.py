"""Faults around training: SIGTERM mid-epoch with the batches checked, checkpoint rotation
across resumes, non-finite validation scores, and NaN gradients with a finite loss."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal

import pytest
import torch
from typer.testing import CliRunner

import zlm.training.trainer
from conftest import shakespeare_text, train_run, write_char_dataset
from zlm.cli import app
from zlm.core import checkpoint as ckpt
from zlm.core.config import TrainConfig
from zlm.core.metrics import read_metrics
from zlm.data.dataset import Dataset
from zlm.errors import NonFiniteError
from zlm.model.lm import ModelConfig


class RecordingStreams:
    """Wraps the real batch source: records each step's inputs and the state after it."""

    def __init__(self, inner, log: list):
        self._inner, self.log = inner, log

    def next(self):
        batch = self._inner.next()
        self.log.append((batch.inputs.clone(), bool(batch.reset), self._inner.state_dict()))
        return batch

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.fixture
def recorded(monkeypatch):
    """A list that collects (inputs, reset, stream state) for every training step."""
    log: list = []
    real = zlm.training.trainer.make_streams
    monkeypatch.setattr(zlm.training.trainer, "make_streams",
                        lambda *a, **k: RecordingStreams(real(*a, **k), log))
    return log


@pytest.fixture
def small_data(tmp_path):
    """~3k characters: an epoch is a dozen steps, so runs cross epoch boundaries."""
    return Dataset.open(write_char_dataset(tmp_path / "data", shakespeare_text(3000)))


def _cfgs(data, **kw):
    mc = ModelConfig(vocab_size=data.vocab_size, hidden=24, embed=8, zoneout_cell=0.5,
                     zoneout_hidden=0.1, dropout=0.1)
    base = dict(batch_size=8, bptt=30, eval_every=100, log_every=1, seed=5, eval_streams=2)
    base.update(kw)
    return mc, TrainConfig(**base)


def _events(run, kind):
    return [r for r in read_metrics(run / "metrics.jsonl") if r["event"] == kind]


def _trainer(path):
    return json.loads((path / "trainer.json").read_text())


# (a) SIGTERM mid-epoch: the resumed run sees exactly the batches of an uninterrupted one --

@pytest.mark.parametrize("state", ["carry", "reset"])
@pytest.mark.parametrize("kill_step", [3, 7])
def test_sigterm_mid_epoch_resume_sees_the_same_batches(small_data, tmp_path, recorded, state, kill_step):
    mc, tc = _cfgs(small_data, max_steps=30, state=state)
    train_run(tmp_path / "a", small_data, mc, tc)
    full = list(recorded)
    recorded.clear()
    assert len(full) == 30

    def term(step, loss):
        if step == kill_step - 1:  # during step kill_step: it completes, then the loop stops
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    summary = train_run(tmp_path / "b", small_data, mc, tc, fault=term)
    assert summary["interrupted"] == "SIGTERM" and summary["step"] == kill_step
    saved = tmp_path / "b" / "checkpoints" / f"step-{kill_step:08d}"
    # The saved stream position is the one after the last step that ran, mid-epoch.
    assert _trainer(saved)["streams"] == [full[kill_step - 1][2]]
    ckpt.verify(saved)
    assert not float(_trainer(saved)["epoch"]).is_integer()  # mid-epoch
    train_run(tmp_path / "b", small_data, mc, tc, resume=True)
    seen = list(recorded)
    assert len(seen) == 30
    for step, (a, b) in enumerate(zip(full, seen, strict=True), start=1):
        assert torch.equal(a[0], b[0]), f"step {step}: different inputs"
        assert a[1] == b[1] and a[2] == b[2], f"step {step}: different stream state"
    epochs = {s[2]["epoch"] for s in full}
    assert len(epochs) >= 2, "the run should cross an epoch boundary"
    assert [(r["step"], r["loss"]) for r in _events(tmp_path / "a", "step")] == \
        [(r["step"], r["loss"]) for r in _events(tmp_path / "b", "step")]
    end_a = _trainer(tmp_path / "a" / "checkpoints" / "step-00000030")
    end_b = _trainer(tmp_path / "b" / "checkpoints" / "step-00000030")
    assert end_a["streams"] == end_b["streams"] and end_a["epoch"] == end_b["epoch"]


# (b) keep-last-K and best/ across two resumes ---------------------------------------------

def _check_rotation(run, keep):
    saved = sorted({r["step"] for r in _events(run, "checkpoint")})
    dirs = ckpt.step_dirs(run)
    assert [int(p.name.split("-")[1]) for p in dirs] == saved[-keep:]
    for p in dirs:
        ckpt.verify(p)
    leftovers = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == []
    evals = [(r["valid_bpc"], r["step"]) for r in _events(run, "eval") if math.isfinite(r["valid_bpc"])]
    best_bpc, best_step = min(evals, key=lambda e: (e[0], e[1]))
    best = _trainer(run / "best")
    assert best["valid_bpc"] == best_bpc and best["step"] == best_step
    assert _trainer(dirs[-1])["best_bpc"] == best_bpc
    ckpt.verify(run / "best")


def test_keep_last_and_best_rotation_across_two_resumes(small_data, tmp_path):
    run, keep = tmp_path / "run", 2
    mc, tc = _cfgs(small_data, max_steps=9, eval_every=3, keep_last=keep, lr=3e-2)
    train_run(run, small_data, mc, tc)
    _check_rotation(run, keep)

    def term_at_13(step, loss):  # an off-cycle checkpoint (step 13) joins the rotation
        if step == 12:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    mc, tc = _cfgs(small_data, max_steps=15, eval_every=3, keep_last=keep, lr=3e-2)
    assert train_run(run, small_data, mc, tc, resume=True, fault=term_at_13)["step"] == 13
    _check_rotation(run, keep)
    assert [p.name for p in ckpt.step_dirs(run)] == ["step-00000012", "step-00000013"]
    mc, tc = _cfgs(small_data, max_steps=22, eval_every=3, keep_last=keep, lr=3e-2)
    train_run(run, small_data, mc, tc, resume=True)
    _check_rotation(run, keep)
    assert [p.name for p in ckpt.step_dirs(run)] == ["step-00000021", "step-00000022"]
    assert len(_events(run, "eval")) == 8  # 3, 6, 9, 12, 15, 18, 21, 22


# (c) a NaN or inf validation score never becomes best ------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("which", [1, 2])  # the first eval (no best yet) or a later one
def test_non_finite_validation_never_becomes_best(small_data, tmp_path, monkeypatch, bad, which):
    real = zlm.training.trainer.evaluate_tokens
    calls = []  # validations (the trainer also scores a train slice for the gap: not counted)
    valid_tokens = small_data.split_info("valid").tokens

    def evaluate_tokens(model, tokens, *a, **k):
        score = real(model, tokens, *a, **k)
        if len(tokens) != valid_tokens:
            return score
        calls.append(score)
        return dataclasses.replace(score, nats=bad) if len(calls) == which else score

    monkeypatch.setattr(zlm.training.trainer, "evaluate_tokens", evaluate_tokens)
    run = tmp_path / "run"
    mc, tc = _cfgs(small_data, max_steps=6, eval_every=2)
    before = None

    def snapshot(step, loss):
        nonlocal before
        if step == 2 * which - 1 and (run / "best").exists():  # just before the bad eval
            before = ((run / "best" / "trainer.json").read_text(),
                      (run / "best" / "model.safetensors").read_bytes())
        if step == 2 * which:  # just after it: best/ is untouched, best_bpc too
            bad_ckpt = _trainer(run / "checkpoints" / f"step-{2 * which:08d}")
            assert not math.isfinite(bad_ckpt["valid_bpc"]) or bad_ckpt["valid_bpc"] < 0
            if which == 1:
                assert not (run / "best").exists() and bad_ckpt["best_bpc"] == math.inf
            else:
                assert bad_ckpt["best_bpc"] == calls[0].bpc
                assert ((run / "best" / "trainer.json").read_text(),
                        (run / "best" / "model.safetensors").read_bytes()) == before
        return loss

    train_run(run, small_data, mc, tc, fault=snapshot)
    assert len(calls) == 3
    finite = [c.bpc for i, c in enumerate(calls, start=1) if i != which]
    best = _trainer(run / "best")
    assert best["valid_bpc"] == min(finite) and math.isfinite(best["best_bpc"])
    assert _trainer(ckpt.step_dirs(run)[-1])["best_bpc"] == min(finite)
    # The bad eval is logged as it was, and the next resume starts from a sane best.
    evals = _events(run, "eval")
    assert sum(not math.isfinite(e["valid_bpc"]) for e in evals) == 1
    assert all(math.isfinite(e["best_bpc"]) or e["step"] <= 2 * which for e in evals)


# (d) NaN in a gradient while the loss stays finite ----------------------------------------

def _nan_gradient(loss):
    """loss + sqrt(0 * loss): the same value, but d/dloss = inf * 0 = NaN for every parameter."""
    return loss + torch.sqrt(loss * 0.0)


def test_single_nan_gradient_is_skipped_and_logged(small_data, tmp_path):
    run = tmp_path / "run"
    mc, tc = _cfgs(small_data, max_steps=8, eval_every=4)

    def fault(step, loss):
        return _nan_gradient(loss) if step in (2, 5) else loss

    train_run(run, small_data, mc, tc, fault=fault)
    bad = _events(run, "nonfinite")
    assert [r["step"] for r in bad] == [3, 6]
    assert all(math.isfinite(r["loss"]) and not math.isfinite(r["grad_norm"]) for r in bad)
    assert [r["step"] for r in _events(run, "step")] == [1, 2, 4, 5, 7, 8]
    for path in ckpt.step_dirs(run):
        tensors, _ = ckpt.read_tensors(path / "model.safetensors")
        assert all(torch.isfinite(t).all() for t in tensors.values())
        opt, _ = ckpt.read_tensors(path / "optimizer.safetensors")
        assert all(torch.isfinite(t).all() for t in opt.values() if t.is_floating_point())


def test_skipped_nan_gradient_leaves_weights_unchanged(small_data, tmp_path):
    """A skipped step changes no weight and no optimizer moment: the step-1 checkpoint of a
    run whose step 2 had a NaN gradient equals its step-2 checkpoint."""
    run = tmp_path / "run"
    mc, tc = _cfgs(small_data, max_steps=2, eval_every=1, keep_last=5)
    train_run(run, small_data, mc, tc, fault=lambda s, loss: _nan_gradient(loss) if s == 1 else loss)
    a = ckpt.read_tensors(run / "checkpoints" / "step-00000001" / "model.safetensors")[0]
    b = ckpt.read_tensors(run / "checkpoints" / "step-00000002" / "model.safetensors")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa = ckpt.read_tensors(run / "checkpoints" / "step-00000001" / "optimizer.safetensors")[0]
    ob = ckpt.read_tensors(run / "checkpoints" / "step-00000002" / "optimizer.safetensors")[0]
    assert all(torch.equal(oa[k], ob[k]) for k in oa)


def test_nan_gradients_in_a_row_stop_with_exit_code_3(small_data, tmp_path):
    run = tmp_path / "run"
    mc, tc = _cfgs(small_data, max_steps=40, eval_every=3, max_nonfinite=4)

    def fault(step, loss):
        return _nan_gradient(loss) if step >= 7 else loss

    with pytest.raises(NonFiniteError) as e:
        train_run(run, small_data, mc, tc, fault=fault)
    msg = str(e.value)
    assert e.value.exit_code == NonFiniteError.exit_code == 3
    assert "\n" not in msg and "4 non-finite losses in a row at step 11" in msg
    last_good = msg.split("checkpoint is ")[1].split(";")[0]
    # The newest checkpoint, written on schedule at step 9 mid-streak, is still good: the
    # skipped steps left step 7's weights in place, all finite.
    assert last_good.endswith("step-00000009")
    ckpt.verify(last_good)
    assert [r["step"] for r in _events(run, "nonfinite")] == [8, 9, 10, 11]
    tensors, _ = ckpt.read_tensors(run / "checkpoints" / "step-00000009" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in tensors.values())
    # And the run resumes from there (without the fault) and finishes.
    mc, tc = _cfgs(small_data, max_steps=12, eval_every=3, max_nonfinite=4)
    assert train_run(run, small_data, mc, tc, resume=True)["step"] == 12


def _cli_train_tiny(tmp_path, lr: str, max_steps: int, eval_every: int, *extra: str):
    """`zlm train` of a 16-unit model on 20,000 characters with --lr LR and no clipping."""
    text = tmp_path / "corpus.txt"
    text.write_text(shakespeare_text(20_000), encoding="utf-8")
    run = tmp_path / "run"
    args = ["train", str(text), "--out", str(run), "--hidden", "16", "--embed", "8",
            "--batch-size", "4", "--bptt", "20", "--max-steps", str(max_steps),
            "--eval-every", str(eval_every), "--lr", lr, "--clip", "0", *extra]
    return run, CliRunner().invoke(app, args)


def test_cli_train_diverging_run_exits_3_with_one_line(tmp_path):
    _, r = _cli_train_tiny(tmp_path, "1e37", max_steps=40, eval_every=3)
    assert r.exit_code == 3, r.output
    lines = r.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], r.stderr
    assert "non-finite losses in a row" in errors[0] and "--resume" in errors[0]
    assert "Traceback" not in r.output


def test_cli_run_whose_validation_is_never_finite_exits_3(tmp_path, monkeypatch):
    """A run whose every validation is NaN while training stays finite used to end with exit
    0 and best BPC inf. Now it says so and exits 3; its checkpoints are still written and
    verify. An lr like 1e30 makes such a run, but whether training or validation overflows
    first there depends on the CPU's kernels (AMX, AVX-512 BF16 or neither round
    differently), so here validation is made NaN directly: the real evaluation runs and its
    sum is replaced."""
    real = zlm.training.trainer.evaluate_tokens
    monkeypatch.setattr(zlm.training.trainer, "evaluate_tokens",
                        lambda *a, **k: dataclasses.replace(real(*a, **k), nats=math.nan))
    run, r = _cli_train_tiny(tmp_path, "1e-3", 20, 10)
    assert r.exit_code == 3, r.output
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: validation BPC was never finite"), r.stderr
    assert "--lr" in lines[-1] and "Traceback" not in r.output
    assert "warning: validation BPC at step 10 is nan; best/ keeps nothing yet" in r.output
    assert not (run / "best").exists()
    ckpt.verify(run / "checkpoints" / "step-00000020")


@pytest.mark.parametrize("lr", ["1e38", "nan", "inf"])
def test_cli_learning_rate_that_cannot_work_is_a_usage_error(tmp_path, lr):
    """1e38 used to crash inside Adam (RuntimeError: overflow) and nan used to be accepted."""
    text = tmp_path / "corpus.txt"
    text.write_text(shakespeare_text(20_000), encoding="utf-8")
    r = CliRunner().invoke(app, ["train", str(text), "--out", str(tmp_path / "run"), "--hidden", "16",
                                 "--max-steps", "2", "--lr", lr])
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines()[-1].startswith("error: --lr must be > 0")

"""Distributed training on CPU: 2 gloo ranks under torch's elastic agent (the --nproc machinery).

With zoneout and dropout off, in fp32 (bf16 would round batch B and 2B differently), 2 ranks
with batch B must train exactly like one process with batch 2B (same losses, same weights), with and without ZeRO; validation must give
the 1-process BPC of the same weights; checkpoints must resume across ZeRO and world
sizes; a dead or hung rank must end the job with an error, not a hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta

import numpy as np
import pytest
import torch

from conftest import train_run
from zlm.core import checkpoint as ckpt
from zlm.core.config import TrainConfig
from zlm.core.eval_protocol import EvalProtocol, evaluate_tokens
from zlm.core.metrics import read_metrics
from zlm.core.precision import resolve_runtime
from zlm.data.dataset import Dataset
from zlm.data.streams import CarryStreams
from zlm.errors import CheckpointError
from zlm.model.lm import ModelConfig, ZoneoutLM
from zlm.training.launch import WorkersFailed, run_local

pytestmark = pytest.mark.distributed

STEPS, B = 20, 2  # steps of every run; streams per rank (the 1-process runs use 2 * B)


def _cfgs(data: Dataset, **kw) -> tuple[ModelConfig, TrainConfig]:
    mc = ModelConfig(vocab_size=data.vocab_size, hidden=24, embed=8, zoneout_cell=0.0,
                     zoneout_hidden=0.0, dropout=0.0)
    base = dict(batch_size=B, bptt=16, max_steps=STEPS, eval_every=10, log_every=5, seed=3,
                eval_streams=5, cell="reference", lr=1e-2, precision="fp32")
    base.update(kw)
    return mc, TrainConfig(**base)


def _losses(run_dir) -> dict[int, float]:
    """step -> logged loss; a step logged twice (before and after a restart) keeps the last."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["event"] == "step"}


def _weights(run_dir, step=STEPS) -> dict[str, torch.Tensor]:
    return ckpt.load(run_dir / "checkpoints" / f"step-{step:08d}").model


def _assert_close_losses(got: dict, want: dict, tol=1e-5) -> None:
    assert sorted(got) == sorted(want)
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst < tol, worst


def _assert_close_weights(a: dict, b: dict, tol=1e-5) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < tol, worst


# Worker bodies: module level, so the spawned workers can import them by name.

def _parity_worker(data_dir: str, root: str) -> None:
    """Every rank: a DDP run, a ZeRO run, and a ZeRO run stopped at step 10 then resumed."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # all four runs; setup() reuses it
    data, root = Dataset.open(data_dir), __import__("pathlib").Path(root)
    mc, tc = _cfgs(data)
    train_run(root / "ddp", data, mc, tc)
    train_run(root / "zero", data, mc, replace(tc, zero=True))
    train_run(root / "zero-resumed", data, mc, replace(tc, zero=True, max_steps=STEPS // 2))
    train_run(root / "zero-resumed", data, mc, replace(tc, zero=True), resume=True)
    dist.destroy_process_group()


def _faulty_worker(data_dir: str, run_dir: str, how: str, max_steps: int) -> None:
    """Rank 1 dies (kill) or stops answering (hang) during step 13 of the first attempt."""
    from zlm.training.distributed import restart_count

    data = Dataset.open(data_dir)
    mc, tc = _cfgs(data, max_steps=max_steps, eval_every=5)

    def fault(step, loss):
        if step == 12 and int(os.environ["RANK"]) == 1 and restart_count() == 0:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # hung, but the agent can still stop it
            time.sleep(3600)  # longer than the test's time limit: only the agent ends it
        return loss

    train_run(__import__("pathlib").Path(run_dir), data, mc, tc, fault=fault)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-rank runs (one launch) and the 1-process reference with batch 2B."""
    from conftest import shakespeare_text, train_run, write_char_dataset

    root = tmp_path_factory.mktemp("dist")
    data_dir = write_char_dataset(root / "data", shakespeare_text(40_000))
    run_local(_parity_worker, (str(data_dir), str(root)), nproc=2)
    data = Dataset.open(data_dir)
    mc, tc = _cfgs(data, batch_size=2 * B)
    train_run(root / "single", data, mc, tc)
    return root, data_dir


def test_two_ranks_train_like_one_process_with_twice_the_batch(runs):
    root, _ = runs
    _assert_close_losses(_losses(root / "ddp"), _losses(root / "single"))
    _assert_close_weights(_weights(root / "ddp"), _weights(root / "single"))
    events = read_metrics(root / "ddp" / "metrics.jsonl")
    assert [r["world_size"] for r in events if r["event"] == "start"] == [2]  # rank 0 alone writes
    assert json.loads((root / "ddp" / "config.json").read_text())["world_size"] == 2


def test_zero_trains_like_one_process_and_checkpoints_the_full_optimizer(runs):
    root, _ = runs
    _assert_close_losses(_losses(root / "zero"), _losses(root / "single"))
    _assert_close_weights(_weights(root / "zero"), _weights(root / "single"))
    opt_zero, _ = ckpt.read_tensors(root / "zero" / "checkpoints" / f"step-{STEPS:08d}" / "optimizer.safetensors")
    opt_one, _ = ckpt.read_tensors(root / "single" / "checkpoints" / f"step-{STEPS:08d}" / "optimizer.safetensors")
    assert opt_zero.keys() == opt_one.keys()  # every parameter's state, consolidated from both shards
    _assert_close_weights(opt_zero, opt_one, tol=1e-4)


def test_rank_streams_are_disjoint_and_cover_the_split(runs, tiny_data):
    root, _ = runs
    trainer = json.loads((root / "ddp" / "checkpoints" / f"step-{STEPS:08d}" / "trainer.json").read_text())
    starts = [s["starts"] for s in trainer["streams"]]
    single = json.loads((root / "single" / "checkpoints" / f"step-{STEPS:08d}" / "trainer.json").read_text())
    assert len(starts) == 2 and not set(starts[0]) & set(starts[1])
    assert starts[0] + starts[1] == single["streams"][0]["starts"]
    tokens = Dataset.open(tiny_data).tokens("train")
    for world, batch in [(2, 3), (3, 2), (4, 5)]:
        per_rank = [CarryStreams(tokens, batch, 20, r, world).starts for r in range(world)]
        union = np.concatenate(per_rank)
        assert len(set(union.tolist())) == world * batch
        np.testing.assert_array_equal(union, CarryStreams(tokens, world * batch, 20).starts)


def test_validation_bpc_of_two_ranks_equals_one_process(runs):
    root, data_dir = runs
    data = Dataset.open(data_dir)
    mc, tc = _cfgs(data)
    logged = {r["step"]: r["valid_bpc"] for r in read_metrics(root / "ddp" / "metrics.jsonl") if r["event"] == "eval"}
    assert sorted(logged) == [10, 20]
    model = ZoneoutLM(mc)
    runtime = resolve_runtime("cpu", "fp32")
    info = data.split_info("valid")
    for step in logged:
        model.load_state_dict(_weights(root / "ddp", step))
        score = evaluate_tokens(model, data.tokens("valid"), data.tokenizer, info.characters, info.bytes,
                            runtime, EvalProtocol(tc.eval_streams))
        assert abs(score.bpc - logged[step]) < 1e-6, (step, score.bpc, logged[step])


def test_zero_run_resumes_exactly_and_across_world_sizes(runs, tmp_path):
    root, data_dir = runs
    # Stopped at step 10 and resumed on 2 ranks: the same losses as the uninterrupted run
    # (bit for bit); the weights agree to a few float32 ulps (DDP is rebuilt on resume).
    assert _losses(root / "zero-resumed") == _losses(root / "zero")
    _assert_close_weights(_weights(root / "zero-resumed"), _weights(root / "zero"), tol=1e-6)
    # Its step-10 checkpoint continues on 1 process (batch 2B, plain Adam) like the reference.
    data = Dataset.open(data_dir)
    one = tmp_path / "one"
    (one / "checkpoints").mkdir(parents=True)
    src = root / "zero-resumed" / "checkpoints" / f"step-{STEPS // 2:08d}"
    __import__("shutil").copytree(src, one / "checkpoints" / src.name)
    mc, tc = _cfgs(data, batch_size=2 * B)
    messages = []
    train_run(one, data, mc, tc, resume=True, reporter=_Quiet(messages))
    assert any("drawn afresh" in m for m in messages)
    want = {s: v for s, v in _losses(root / "single").items() if s > STEPS // 2}
    _assert_close_losses(_losses(one), want)
    _assert_close_weights(_weights(one), _weights(root / "single"))
    # A different total number of streams cannot carry the hidden state: refused in one line.
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    __import__("shutil").copytree(src, other / "checkpoints" / src.name)
    mc, tc = _cfgs(data, batch_size=3)
    with pytest.raises(CheckpointError, match=r"carries 4 training streams .* pass --batch-size 4") as e:
        train_run(other, data, mc, tc, resume=True)
    assert "\n" not in str(e.value)


@pytest.mark.timeout(240)  # the hang guard: a job that does not end fails here (it takes ~15 s)
@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_dead_or_hung_rank_ends_the_job_with_a_loadable_checkpoint(tmp_path, monkeypatch, how):
    from conftest import shakespeare_text, write_char_dataset

    data_dir = write_char_dataset(tmp_path / "data", shakespeare_text(40_000))
    monkeypatch.setenv("ZLM_DIST_TIMEOUT", "8")
    tmp = tmp_path / "tmp"  # this process's temp folder: the launch leaves nothing in it
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    # A hung rank sleeps past the time limit: the job ending at all (rank 0's collective
    # times out after ZLM_DIST_TIMEOUT, then the agent stops rank 1) is the check.
    with pytest.raises(WorkersFailed) as e:
        run_local(_faulty_worker, (str(data_dir), str(tmp_path / "run"), how, 40), nproc=2, shutdown_timeout=5)
    assert sorted(f.name for f in tmp.iterdir()) == []  # no pytorch-errorfile-*.pickle, no zlm-launch-*
    assert tempfile.tempdir == str(tmp)
    assert e.value.exit_code != 0
    assert ("rank 1 was killed by SIGKILL" if how == "kill" else "rank 0 exited with code 1") in str(e.value)
    latest = ckpt.latest_complete(tmp_path / "run")
    assert latest is not None and latest.name == "step-00000010"
    assert all(torch.isfinite(t).all() for t in ckpt.load(latest).model.values())


def test_elastic_restart_resumes_from_the_latest_checkpoint(runs, tmp_path):
    root, data_dir = runs
    run = tmp_path / "run"
    run_local(_faulty_worker, (str(data_dir), str(run), "kill", STEPS), nproc=2, max_restarts=1)
    starts = [r for r in read_metrics(run / "metrics.jsonl") if r["event"] == "start"]
    assert [r["resumed_from"] is not None for r in starts] == [False, True]
    assert starts[1]["step"] == 10
    _assert_close_losses(_losses(run), _losses(root / "single"))
    _assert_close_weights(_weights(run), _weights(root / "single"))


def test_cli_nproc_trains_with_one_printing_rank(tmp_path):
    from conftest import shakespeare_text

    text = tmp_path / "input.txt"
    text.write_text(shakespeare_text(30_000), encoding="utf-8")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "zlm", "train", str(text), "--out", str(run), "--nproc", "2", "--zero",
           "--max-steps", "6", "--hidden", "16", "--embed", "8", "--batch-size", "2", "--bptt", "10",
           "--eval-every", "6", "--log-every", "3"]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, NO_COLOR="1", ZLM_DIST_TIMEOUT="60", TMPDIR=str(tmp))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("processes: 2 processes (gloo, DistributedDataParallel); ZeRO-1") == 1, p.stdout
    left = [f.name for f in tmp.iterdir() if f.name.startswith(("torchelastic_", "zlm-launch-"))]
    assert left == []  # the launcher's error-file folder is gone with the job
    assert p.stdout.count("eval step 6") == 1
    assert (run / "checkpoints" / "step-00000006" / "checkpoint.json").exists()
    # A second launch into the same directory without --resume is refused before any worker starts.
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "--resume" in p.stderr and "launching" not in p.stdout


class _Quiet:
    """A Reporter that only keeps messages."""

    def __init__(self, messages):
        self.messages = messages

    def __getattr__(self, name):
        return lambda *a, **k: None

    def message(self, text):
        self.messages.append(text)

"""Fault injection around checkpoints: SIGKILL mid-save, full disk, read-only disk, corruption.

The promises: the newest complete checkpoint always loads; an incomplete one is
never mistaken for complete; --resume falls back past a bad one and names it; no
temporary files survive the next save; a failing writer stops training with one line and
leaves existing checkpoints untouched.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import train_run
from zlm.core import checkpoint as ckpt
from zlm.core.config import TrainConfig
from zlm.core.reporter import Reporter
from zlm.data.dataset import Dataset
from zlm.data.streams import CarryStreams
from zlm.errors import ZlmError
from zlm.model.lm import ModelConfig, ZoneoutLM
from zlm.training.distributed import Parallel
from zlm.training.schedule import LRSchedule, ScheduleConfig
from zlm.training.state import Checkpointer, RNGState, TrainState


def _saver(data: Dataset):
    """A closure that saves a realistic training checkpoint at a given step."""
    torch.manual_seed(0)
    model = ZoneoutLM(ModelConfig(vocab_size=data.vocab_size, hidden=256, embed=32))  # ~4 MB
    opt = torch.optim.Adam(model.parameters())
    model(torch.zeros(3, 2, dtype=torch.long))[0].sum().backward()
    opt.step()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    streams = CarryStreams(data.tokens("train"), 2, 10)
    sched = LRSchedule(ScheduleConfig(), 1e-3, None)
    state = model.initial_state(2)
    config = {"model": model.config.to_dict()}

    def save(run_dir: Path, step: int) -> Path:
        parts = {"model": model, "optimizer": opt, "scaler": scaler, "streams": streams, "schedule": sched,
                 "train_state": TrainState(step=step, best_bpc=2.0), "rng": RNGState(torch.device("cpu"))}
        return Checkpointer(run_dir, config, data, Parallel(), keep_last=3).save(parts, state)

    return save


def test_sigkill_during_checkpoint_writes(tiny_data, tmp_path):
    """25 SIGKILLs at random moments of a process that does nothing but save checkpoints."""
    data = Dataset.open(tiny_data)
    save = _saver(data)
    run = tmp_path / "run"
    rng = random.Random(1234)
    step, kills, seen_complete = 0, 25, set()
    for _ in range(kills):
        pid = os.fork()
        if pid == 0:  # child: save forever, from the next step on
            # The collector must not finalize what the parent left behind: objects of threads
            # that do not exist after fork (an earlier test's process group) crash it.
            gc.freeze()
            try:
                s = step
                while True:
                    s += 1
                    save(run, s)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        # Every step-* directory is complete: rename is the commit point.
        for d in ckpt.step_dirs(run):
            ckpt.verify(d)
            seen_complete.add(d.name)
        latest = ckpt.latest_complete(run)
        if latest is not None:
            loaded = ckpt.load(latest)
            assert "decoder.weight" in loaded.model
            step = int(latest.name.split("-")[1])
    assert len(seen_complete) >= 5, "the child never got far enough to test anything"
    save(run, step + 1)  # the next save cleans every leftover of the killed writers
    leftovers = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_resume_skips_a_corrupt_newest_checkpoint_and_names_it(tiny_data, tmp_path):
    data = Dataset.open(tiny_data)
    mc = ModelConfig(vocab_size=data.vocab_size, hidden=16, embed=8)
    tc = TrainConfig(batch_size=4, bptt=10, max_steps=4, eval_every=2, log_every=1)
    train_run(tmp_path / "run", data, mc, tc)
    bad = tmp_path / "run" / "checkpoints" / "step-00000004" / "model.safetensors"
    bad.write_bytes(bad.read_bytes()[:100])

    class Rec(Reporter):
        def __init__(self):
            self.lines = []

        def message(self, text):
            self.lines.append(text)

    rec = Rec()
    train_run(tmp_path / "run", data, mc, TrainConfig(**{**tc.to_dict(), "max_steps": 6}), resume=True,
          reporter=rec)
    assert any("skipping step-00000004" in m and "truncated" in m for m in rec.lines), rec.lines
    assert any("resumed from" in m and "step-00000002" in m for m in rec.lines)


def _digests(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "metrics.jsonl"}


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs mount (real ENOSPC / EROFS), or skip where mounting is not allowed."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _train_small(run, data, steps, resume=False):
    mc = ModelConfig(vocab_size=data.vocab_size, hidden=64, embed=8)
    tc = TrainConfig(batch_size=4, bptt=10, max_steps=steps, eval_every=2, log_every=1, keep_last=5)
    return train_run(run, data, mc, tc, resume=resume)


def test_disk_full_stops_training_with_one_line_and_keeps_checkpoints(tiny_data, tmpfs):
    data = Dataset.open(tiny_data)
    run = tmpfs / "run"
    _train_small(run, data, 2)
    before = _digests(run)
    free = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
    (tmpfs / "filler").write_bytes(b"\0" * (free - 64 * 1024))  # leave 64 KB: too little
    with pytest.raises(ZlmError, match="No space left on device") as e:
        _train_small(run, data, 6, resume=True)
    assert "\n" not in str(e.value)
    after = _digests(run)
    # Nothing touched; config.json may be rewritten (atomically) for the new --max-steps.
    assert {k: v for k, v in after.items() if k in before and k != "config.json"} == {
        k: v for k, v in before.items() if k != "config.json"}
    json.loads((run / "config.json").read_text())
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    (tmpfs / "filler").unlink()
    _train_small(run, data, 6, resume=True)  # and it resumes once there is room again


def test_read_only_run_directory_is_one_line_error(tiny_data, tmpfs):
    data = Dataset.open(tiny_data)
    run = tmpfs / "run"
    _train_small(run, data, 2)
    before = _digests(run)
    r = subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot remount read-only here")
    try:
        with pytest.raises(ZlmError, match="Read-only file system"):
            _train_small(run, data, 4, resume=True)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], capture_output=True)
    assert _digests(run) == before

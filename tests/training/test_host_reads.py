"""The training step reads nothing back to the host: loss, gradient norm and the finite
flag stay on the device and are read once per --log-every steps (on a GPU every read is a
sync that idles the device). Counted on the CPU by patching every read-back point."""

from __future__ import annotations

import contextlib

import torch

from conftest import shakespeare_text, write_char_dataset
from zlm.core.config import Options
from zlm.training.plan import plan
from zlm.training.trainer import Trainer

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy")


@contextlib.contextmanager
def counting_reads():
    """Count calls of every Tensor method that copies a value to the host."""
    counts = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name):
        def read(self, *a, **k):
            counts["n"] += 1
            return originals[name](self, *a, **k)
        return read

    for name in READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def _trainer(tmp_path, **kw) -> Trainer:
    data = write_char_dataset(tmp_path / "data", shakespeare_text(30_000))
    options = Options(hidden=16, embed=8, batch_size=4, bptt=12, max_steps=100, eval_every=100, eval_streams=2,
                      log_every=5, device="cpu", precision="fp32", reset_prob=0.3, **kw)
    return Trainer(plan(data, options, out=tmp_path / "run", preset="cpu-small"))


def test_a_step_reads_nothing_and_the_log_reads_once_per_log_every(tmp_path):
    tr = _trainer(tmp_path)
    from zlm.training.trainer import _Meter

    meter = _Meter(tr.state)
    tr.log = tr.run.open(tr.config)
    for k in range(1, 21):
        batch = tr.streams.next()
        with counting_reads() as steps:
            result = tr.train_step(batch)
        assert steps["n"] == 0, f"step {k} read {steps['n']} value(s) back to the host"
        with counting_reads() as logging:
            tr._record(result, meter)
        assert logging["n"] == (1 if k % 5 == 0 else 0), f"step {k}: {logging['n']} reads while logging"
    tr.log.close()
    assert tr.state.step == 20 and meter.tokens == 0  # the last line took the window's tokens


def test_the_count_sees_a_read(tmp_path):
    """A guard that cannot fail is no guard: a step that calls .item() is counted."""
    with counting_reads() as c:
        torch.ones(()).item()
        float(torch.ones(()))
    assert c["n"] == 2


def test_a_non_finite_step_is_skipped_on_the_device(tmp_path):
    """A NaN loss: the update is skipped (weights and optimizer state unchanged) without a
    host read, the carried state restarts from zero, and the flush counts it."""
    tr = _trainer(tmp_path)
    tr.step_fn.fault = lambda step, loss: loss * float("nan") if step == 3 else loss
    from zlm.training.trainer import _Meter

    meter = _Meter(tr.state)
    tr.log = tr.run.open(tr.config)
    for _ in range(3):
        tr._record(tr.train_step(tr.streams.next()), meter)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    steps_before = [s["step"].clone() for s in tr.optimizer.state.values()]
    with counting_reads() as c:
        tr._record(tr.train_step(tr.streams.next()), meter)  # step 4 runs the fault hook at state.step 3
    assert c["n"] == 0
    after = tr.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(a, s["step"]) for a, s in zip(steps_before, tr.optimizer.state.values(), strict=True))
    assert all(torch.count_nonzero(t) == 0 for t in tr.carried)
    tr._flush(meter)
    assert tr.state.nonfinite == 1
    tr._record(tr.train_step(tr.streams.next()), meter)
    tr._flush(meter)
    assert tr.state.nonfinite == 0 and any(not torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    tr.log.close()


def test_state_resets_are_drawn_on_the_device_from_the_key():
    """--reset-prob: the same (seed, rank, step) zeroes the same streams, about prob of them,
    and the draw reads nothing back."""
    from zlm.training.trainer import reset_some

    state = (torch.ones(1, 4000, 3), torch.ones(1, 4000, 3))
    with counting_reads() as c:
        h, _ = reset_some(state, 0.25, (1234, 0, 7))
    assert c["n"] == 0
    zeroed = (h[0, :, 0] == 0).float().mean().item()
    assert abs(zeroed - 0.25) < 0.03
    assert torch.equal(reset_some(state, 0.25, (1234, 0, 7))[0], h)
    assert not torch.equal(reset_some(state, 0.25, (1234, 0, 8))[0], h)
    assert not torch.equal(reset_some(state, 0.25, (1234, 1, 7))[0], h)

"""Learning-rate schedules (zlm.schedule): values at known points, by hand."""

from __future__ import annotations

import math

import pytest

from zlm.errors import UsageError
from zlm.training.schedule import LRSchedule, ScheduleConfig


def test_constant_with_warmup():
    s = LRSchedule(ScheduleConfig(warmup=4), 1e-3, None)
    assert [s.lr(k) for k in range(5)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert s.lr(10_000) == 1e-3


def test_cosine_by_steps():
    s = LRSchedule(ScheduleConfig("cosine", min_lr_ratio=0.1), 1.0, 100)
    assert s.lr(0) == pytest.approx(1.0)
    assert s.lr(50) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s.lr(100) == pytest.approx(0.1)
    assert s.lr(500) == pytest.approx(0.1)  # stays at the floor past the end


def test_cosine_by_time_budget_alone():
    """--time-budget without a step count: the decay follows the training time spent."""
    s = LRSchedule(ScheduleConfig("cosine", min_lr_ratio=0.0), 2.0, None, time_budget=600.0)
    assert s.lr(123, elapsed=0.0) == pytest.approx(2.0)
    assert s.lr(123, elapsed=300.0) == pytest.approx(1.0)
    assert s.lr(9, elapsed=450.0) == pytest.approx(2.0 * 0.5 * (1 + math.cos(0.75 * math.pi)))
    assert s.lr(123, elapsed=600.0) == pytest.approx(0.0, abs=1e-12)


def test_cosine_with_both_limits_follows_the_one_further_along():
    s = LRSchedule(ScheduleConfig("cosine", min_lr_ratio=0.0), 1.0, 100, time_budget=100.0)
    assert s.progress(10, elapsed=50.0) == pytest.approx(0.5)  # time is ahead
    assert s.progress(80, elapsed=50.0) == pytest.approx(0.8)  # steps are ahead


def test_cosine_time_decay_waits_for_warmup():
    s = LRSchedule(ScheduleConfig("cosine", warmup=10, min_lr_ratio=0.0), 1.0, None, time_budget=60.0)
    assert s.lr(4, elapsed=30.0) == pytest.approx(0.5)  # warming up: (4 + 1) / 10, no decay yet
    assert s.lr(10, elapsed=30.0) == pytest.approx(0.5)  # warm; half the time spent


def test_cosine_needs_a_length():
    with pytest.raises(UsageError, match="--max-steps, --epochs or --time-budget"):
        LRSchedule(ScheduleConfig("cosine"), 1.0, None)


def test_plateau_halves_after_patience_and_round_trips():
    s = LRSchedule(ScheduleConfig("plateau", factor=0.5, patience=2), 1.0, None)
    for bpc in (3.0, 2.5, 2.6, 2.55):  # two validations without improvement -> halve
        s.observe(bpc)
    assert s.lr(0) == 0.5
    s.observe(float("nan"))  # ignored
    t = LRSchedule(ScheduleConfig("plateau", factor=0.5, patience=2), 1.0, None)
    t.load_state_dict(s.state_dict())
    assert t.lr(0) == 0.5 and t.best == 2.5


def test_bad_schedule_names_the_flag():
    with pytest.raises(UsageError, match="--schedule constant, cosine or plateau"):
        ScheduleConfig("linear")

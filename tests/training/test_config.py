"""zlm.core.config and presets: typed presets, Options -> configs, checks naming flags."""

from __future__ import annotations

import pytest

from zlm.core.config import Options, ScheduleConfig, TrainConfig, parse_duration
from zlm.errors import UsageError
from zlm.model.lm import ModelConfig
from zlm.training.presets import DEFAULT_PRESET, PRESETS, get_preset


def test_presets_are_typed_and_valid():
    for p in PRESETS.values():
        assert isinstance(p.model, ModelConfig) and isinstance(p.train, TrainConfig)
        assert p.model.vocab_size == 0  # from the data
    assert get_preset(None).name == DEFAULT_PRESET
    with pytest.raises(UsageError, match="unknown preset"):
        get_preset("nope")


def test_options_route_each_value_to_its_config():
    p = get_preset("cpu-small")
    model, train = Options(hidden=64, lr=1e-3, schedule="cosine", warmup=10, time_budget=60.0,
                           embed=None).apply(p.model, p.train, 65)
    assert model.vocab_size == 65 and model.hidden == 64 and model.embed == p.model.embed
    assert train.lr == 1e-3 and train.time_budget == 60.0 and train.reset_prob == p.train.reset_prob
    assert train.schedule == ScheduleConfig(kind="cosine", warmup=10)
    with pytest.raises(UsageError, match="unknown option"):
        Options.from_dict({"no_such_option": 1})
    with pytest.raises(UsageError, match="--hidden must be >= 1"):  # checked by the config it sets
        Options(hidden=0).apply(p.model, p.train, 65)


def test_options_cover_every_config_field_and_round_trip_two_configs():
    from dataclasses import fields

    names = {f.name for f in fields(Options)}
    model_fields = {f.name for f in fields(ModelConfig)} - {"vocab_size"}
    train_fields = {f.name for f in fields(TrainConfig)} - {"schedule"}
    schedule_fields = {f.name for f in fields(ScheduleConfig)} - {"kind"}
    assert names == model_fields | train_fields | schedule_fields | {"schedule"}
    mc = ModelConfig(vocab_size=40, hidden=24, embed=8, zoneout_cell=0.3, dropout=0.1)
    tc = TrainConfig(batch_size=4, lr=1e-3, schedule=ScheduleConfig(kind="plateau", factor=0.25, patience=3),
                     max_steps=9, zero=False)
    assert Options.of(mc, tc).apply(ModelConfig(), TrainConfig(), 40) == (mc, tc)


def test_later_options_win_and_none_is_not_given():
    a, b = Options(hidden=64, lr=1e-3), Options(lr=5e-3, embed=None)
    assert (a | b) == Options(hidden=64, lr=5e-3)
    assert (a | b).given() == {"hidden": 64, "lr": 5e-3}


@pytest.mark.parametrize("bad, needle", [
    (dict(lr=0), "--lr"), (dict(batch_size=0), "--batch-size"), (dict(reset_prob=1.0), "--reset-prob"),
    (dict(optimizer="lion"), "--optimizer adam, adamw or sgd"), (dict(device="tpu"), "--device auto"),
    (dict(precision="fp8"), "--precision auto"), (dict(cell="magic"), "--cell auto, fused, reference or plain"),
    (dict(cuda_graphs="yes"), "--cuda-graphs auto, on or off"), (dict(state="x"), "--state carry or reset"),
    (dict(max_steps=-1), "--max-steps"),
])
def test_every_option_is_checked_once_with_its_flag(bad, needle):
    with pytest.raises(UsageError, match=needle):
        TrainConfig(**bad)


def test_config_round_trips_through_json_dicts():
    t = TrainConfig(schedule=ScheduleConfig(kind="plateau", patience=3), max_steps=9)
    assert TrainConfig(**t.to_dict()) == t


def test_parse_duration():
    assert parse_duration("90s") == 90 and parse_duration("10m") == 600 and parse_duration("1h30m") == 5400
    assert parse_duration("600") == 600
    with pytest.raises(UsageError, match="cannot read duration"):
        parse_duration("soon")

"""From a preset plus explicit options to the resolved (ModelConfig, TrainConfig).

Also parses human durations for --time-budget ("90s", "10m", "1h30m", "600").
"""

from __future__ import annotations

import re

from zlm.errors import UsageError
from zlm.model.lm import ModelConfig
from zlm.training.presets import DEFAULT_PRESET, get_preset
from zlm.training.schedule import ScheduleConfig
from zlm.training.trainer import TrainConfig

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?$")


def parse_duration(text: str) -> float:
    """'90s' | '10m' | '1h30m' | '600' -> seconds."""
    m = _DURATION.match(text.strip()) if text else None
    if not text or not m or not any(m.groups()):
        raise UsageError(f"cannot read duration {text!r}; write e.g. 90s, 10m or 1h30m")
    h, mi, s = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mi * 60 + s


MODEL_KEYS = ("hidden", "layers", "embed", "zoneout_cell", "zoneout_hidden", "dropout")
SCHEDULE_KEYS = ("kind", "warmup", "min_lr_ratio", "factor", "patience")


def resolve(vocab_size: int, preset: str | None, overrides: dict) -> tuple[ModelConfig, TrainConfig, str]:
    """Preset values, then every non-None override. Returns the configs and the preset used."""
    name = preset or DEFAULT_PRESET
    p = get_preset(name)
    model = dict(p["model"])
    train = dict(p["train"])
    schedule = dict(train.pop("schedule", {}))
    for k, v in overrides.items():
        if v is None:
            continue
        if k in MODEL_KEYS:
            model[k] = v
        elif k == "schedule":
            schedule["kind"] = v
        elif k == "warmup":
            schedule["warmup"] = v
        else:
            train[k] = v
    return (ModelConfig(vocab_size=vocab_size, **model),
            TrainConfig(schedule=ScheduleConfig(**schedule), **train), name)

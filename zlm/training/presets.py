"""Named configurations: `--preset NAME` gives the model and training configs to start from.

A preset is typed (`ModelConfig`, `TrainConfig`); options given explicitly on the command
line replace its values (`zlm.core.config.Options.apply`). The model's vocabulary size
comes from the data, so presets leave it at 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from zlm.core.config import ScheduleConfig, TrainConfig
from zlm.errors import UsageError
from zlm.model.config import ModelConfig


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    model: ModelConfig
    train: TrainConfig


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset(
        "cpu-small", "learns visibly within minutes on 2 CPU cores",
        ModelConfig(hidden=512, layers=1, embed=64, zoneout_cell=0.1, zoneout_hidden=0.05, dropout=0.0),
        TrainConfig(batch_size=32, bptt=100, lr=3e-3, optimizer="adam", clip=1.0, eval_every=300,
                    reset_prob=0.02, schedule=ScheduleConfig(kind="constant")),
    ),
    Preset(
        "zoneout-ptb-char", "Krueger et al. 2016 Char-PTB: 1 x 1000 units, z_c 0.5, z_h 0.05 (1.27 test BPC)",
        ModelConfig(hidden=1000, layers=1, embed=128, zoneout_cell=0.5, zoneout_hidden=0.05, dropout=0.0),
        TrainConfig(batch_size=32, bptt=100, lr=2e-3, optimizer="adam", clip=1.0, state="reset", epochs=50,
                    eval_every=1000, schedule=ScheduleConfig(kind="plateau", factor=0.5, patience=1)),
    ),
)}

DEFAULT_PRESET = "cpu-small"


def get_preset(name: str | None) -> Preset:
    """The preset called `name` (None: the default one)."""
    name = name or DEFAULT_PRESET
    if name not in PRESETS:
        raise UsageError(f"unknown preset {name!r}; pass --preset {' or '.join(PRESETS)}")
    return PRESETS[name]

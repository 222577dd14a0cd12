"""Named configurations: `--preset NAME` fills model and training options.

Options given explicitly on the command line override the preset's values.
"""

from __future__ import annotations

from zlm.errors import UsageError

PRESETS: dict[str, dict] = {
    "cpu-small": {
        "description": "learns visibly within minutes on 2 CPU cores",
        "model": {"hidden": 512, "layers": 1, "embed": 64, "zoneout_cell": 0.1, "zoneout_hidden": 0.05,
                  "dropout": 0.0},
        "train": {"batch_size": 32, "bptt": 100, "lr": 3e-3, "optimizer": "adam", "clip": 1.0,
                  "eval_every": 300, "reset_prob": 0.02, "schedule": {"kind": "constant"}},
    },
    "zoneout-ptb-char": {
        "description": "Krueger et al. 2016 Char-PTB: 1 x 1000 units, z_c 0.5, z_h 0.05 (1.27 test BPC)",
        "model": {"hidden": 1000, "layers": 1, "embed": 128, "zoneout_cell": 0.5, "zoneout_hidden": 0.05,
                  "dropout": 0.0},
        "train": {"batch_size": 32, "bptt": 100, "lr": 2e-3, "optimizer": "adam", "clip": 1.0,
                  "state": "reset", "epochs": 50, "eval_every": 1000,
                  "schedule": {"kind": "plateau", "factor": 0.5, "patience": 1}},
    },
}

DEFAULT_PRESET = "cpu-small"


def get_preset(name: str) -> dict:
    if name not in PRESETS:
        raise UsageError(f"unknown preset {name!r}; pass --preset {' or '.join(PRESETS)}")
    return PRESETS[name]

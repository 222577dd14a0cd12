"""Training configuration: `TrainConfig`, and options -> (ModelConfig, TrainConfig).

Every field is typed, documented where it is declared and checked once, in
`__post_init__`, with the command-line flag in the message. `configure` is the one place
where a preset and the options a user gave become the resolved configs: it replaces the
preset's values with every option that is not None (`dataclasses.replace`), routing each
option to the config that declares a field of that name. config.json stores the result.

Also parses human durations for --time-budget ("90s", "10m", "1h30m", "600").
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from zlm.core.precision import DEVICES, PRECISIONS
from zlm.errors import UsageError
from zlm.model.cells import CELL_NAMES
from zlm.model.lm import ModelConfig
from zlm.training.graphs import GRAPH_MODES
from zlm.training.schedule import ScheduleConfig

OPTIMIZERS = ("adam", "adamw", "sgd")
STATE_PROTOCOLS = ("carry", "reset")
_MAX_LR = 3.4e37  # float32 max / 10: a larger lr overflows inside Adam's first step


@dataclass(frozen=True)
class TrainConfig:
    """How to train (stored in config.json under "train")."""

    batch_size: int = 32  # streams per rank
    bptt: int = 100  # truncated backprop window, tokens
    lr: float = 2e-3
    optimizer: str = "adam"  # adam | adamw | sgd (momentum 0.9)
    weight_decay: float = 0.0
    clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    epochs: float | None = None  # stop after this many passes over the training split
    max_steps: int | None = None  # stop after this many optimizer steps
    time_budget: float | None = None  # stop after this many seconds of training (total)
    eval_every: int = 500  # validate (and checkpoint) every N steps, and at the end
    eval_streams: int = 16  # parallel streams for validation (EvalProtocol)
    state: str = "carry"  # carry: TBPTT streams, state carried | reset: paper's shuffled chunks
    reset_prob: float = 0.0  # carry: chance a stream's state is zeroed before a window
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    cell: str = "auto"  # auto | fused | reference
    cuda_graphs: str = "auto"  # auto | on | off: replay training windows from CUDA graphs
    keep_last: int = 3  # step checkpoints kept (plus best/)
    log_every: int = 10  # steps between log lines
    max_nonfinite: int = 5  # non-finite losses in a row before training stops
    zero: bool = False  # shard optimizer state (ZeroRedundancyOptimizer) under DDP

    def __post_init__(self):
        if isinstance(self.schedule, dict):  # read back from config.json
            object.__setattr__(self, "schedule", ScheduleConfig(**self.schedule))
        for name in ("batch_size", "bptt", "eval_every", "eval_streams", "keep_last", "log_every",
                     "max_nonfinite"):
            if getattr(self, name) < 1:
                raise UsageError(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.lr <= _MAX_LR:  # (also refuses nan)
            raise UsageError(f"--lr must be > 0 and at most {_MAX_LR:.1e} (Adam's first step, "
                             f"10 x lr, must fit in float32), got {self.lr}")
        if self.clip < 0:
            raise UsageError(f"--clip must be >= 0 (0 turns clipping off), got {self.clip}")
        if not 0.0 <= self.reset_prob < 1.0:
            raise UsageError(f"--reset-prob must be in [0, 1), got {self.reset_prob}")
        for name in ("epochs", "max_steps", "time_budget"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise UsageError(f"{_flag(name)} must be > 0, got {v}")
        for name, what, allowed in _CHOICES:
            if getattr(self, name) not in allowed:
                raise UsageError(f"unknown {what} {getattr(self, name)!r}; pass "
                                 f"{_flag(name)} {', '.join(allowed[:-1])} or {allowed[-1]}")

    def to_dict(self) -> dict:
        return asdict(self)


_CHOICES = (("optimizer", "optimizer", OPTIMIZERS), ("state", "state protocol", STATE_PROTOCOLS),
            ("device", "device", DEVICES), ("precision", "precision", PRECISIONS), ("cell", "cell", CELL_NAMES),
            ("cuda_graphs", "--cuda-graphs", GRAPH_MODES))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# Options named differently from the ScheduleConfig field they set.
SCHEDULE_OPTIONS = {"schedule": "kind", "warmup": "warmup"}


def configure(model: ModelConfig, train: TrainConfig, vocab_size: int,
              options: dict[str, Any]) -> tuple[ModelConfig, TrainConfig]:
    """A preset's configs with every option that is not None replacing its value.

    options: {field name: value}; each goes to the config that has a field of that name
    (`--schedule` and `--warmup` to train.schedule). An unknown name is a programming
    error (KeyError), not a user's.
    """
    groups: dict[str, dict] = {"model": {"vocab_size": vocab_size}, "train": {}, "schedule": {}}
    model_fields = {f.name for f in fields(ModelConfig)}
    train_fields = {f.name for f in fields(TrainConfig)} - {"schedule"}
    for name, value in options.items():
        if value is None:
            continue
        if name in SCHEDULE_OPTIONS:
            groups["schedule"][SCHEDULE_OPTIONS[name]] = value
        elif name in model_fields:
            groups["model"][name] = value
        elif name in train_fields:
            groups["train"][name] = value
        else:
            raise KeyError(f"{name} is no field of ModelConfig, TrainConfig or ScheduleConfig")
    schedule = replace(train.schedule, **groups["schedule"])
    return replace(model, **groups["model"]), replace(train, schedule=schedule, **groups["train"])


_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?$")


def parse_duration(text: str) -> float:
    """'90s' | '10m' | '1h30m' | '600' -> seconds."""
    m = _DURATION.match(text.strip()) if text else None
    if not text or not m or not any(m.groups()):
        raise UsageError(f"cannot read duration {text!r}; write e.g. 90s, 10m or 1h30m")
    h, mi, s = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mi * 60 + s

"""How to train, typed: `TrainConfig`, `ScheduleConfig`, and `Options` - what a user gave.

Every field is typed, documented where it is declared and checked once, in
`__post_init__`, with the command-line flag in the message. `Options` holds every
`zlm train` setting as given (None = not given); `Options.apply` is the one place where
a preset's configs and the given options become the configs a run trains with.

Nothing here imports torch: `zlm --help` and `zlm info` read these without it.
Also parses human durations for --time-budget ("90s", "10m", "1h30m", "600").
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields, replace

from zlm.errors import UsageError
from zlm.model.config import CELL_NAMES, ModelConfig

OPTIMIZERS = ("adam", "adamw", "sgd")
STATE_PROTOCOLS = ("carry", "reset")
SCHEDULES = ("constant", "cosine", "plateau")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
GRAPH_MODES = ("auto", "on", "off")
OVERFIT_MODES = ("continue", "cool-down")  # --on-overfit (zlm.training.schedule)
_MAX_LR = 3.4e37  # float32 max / 10: a larger lr overflows inside Adam's first step


@dataclass(frozen=True)
class ScheduleConfig:
    """The learning-rate schedule (stored in config.json under train.schedule)."""

    kind: str = "constant"  # constant | cosine | plateau
    warmup: int = 0  # linear warmup steps from 0 to lr (all kinds)
    min_lr_ratio: float = 0.1  # cosine: final lr = lr * min_lr_ratio
    factor: float = 0.5  # plateau: multiply lr by this when valid BPC stops improving
    patience: int = 1  # plateau: validations without improvement before reducing

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise UsageError(f"unknown schedule {self.kind!r}; pass --schedule constant, cosine or plateau")
        if self.warmup < 0 or not 0 <= self.min_lr_ratio <= 1 or not 0 < self.factor <= 1:
            raise UsageError("schedule: need --warmup >= 0, min_lr_ratio in [0, 1], factor in (0, 1]")


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
    eval_tokens: int = 0  # validation scores a sample of this many valid tokens spread over the split (0: all)
    state: str = "carry"  # carry: TBPTT streams, state carried | reset: paper's shuffled chunks
    reset_prob: float = 0.0  # carry: chance a stream's state is zeroed before a window
    average: float = 0.0  # the last share of a run whose weights are averaged (0: off); needs a run length
    on_overfit: str = "continue"  # continue | cool-down: back to best/, lr to 0 over half an interval, stop
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    cell: str = "auto"  # auto | fused | reference | plain
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
                raise UsageError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.lr <= _MAX_LR:  # (also refuses nan)
            raise UsageError(f"--lr must be > 0 and at most {_MAX_LR:.1e} (Adam's first step, "
                             f"10 x lr, must fit in float32), got {self.lr}")
        if self.clip < 0:
            raise UsageError(f"--clip must be >= 0 (0 turns clipping off), got {self.clip}")
        if self.eval_tokens < 0:
            raise UsageError(f"--eval-tokens must be >= 0 (0: the whole valid split), got {self.eval_tokens}")
        if not 0.0 <= self.reset_prob < 1.0:
            raise UsageError(f"--reset-prob must be in [0, 1), got {self.reset_prob}")
        if not 0.0 <= self.average < 1.0:
            raise UsageError(f"--average must be in [0, 1) (the last share of the run averaged; 0 = off), "
                             f"got {self.average}")
        for name in ("epochs", "max_steps", "time_budget"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise UsageError(f"{flag(name)} must be > 0, got {v}")
        for name, what, allowed in _CHOICES:
            if getattr(self, name) not in allowed:
                raise UsageError(f"unknown {what} {getattr(self, name)!r}; pass "
                                 f"{flag(name)} {', '.join(allowed[:-1])} or {allowed[-1]}")

    def scored_valid_tokens(self, valid_tokens: int) -> int:
        """Valid tokens each validation scores: the --eval-tokens sample when it is smaller
        than the split's `valid_tokens`, else all of them."""
        return self.eval_tokens if 0 < self.eval_tokens < valid_tokens else valid_tokens

    def to_dict(self) -> dict:
        return asdict(self)


_CHOICES = (("optimizer", "optimizer", OPTIMIZERS), ("state", "state protocol", STATE_PROTOCOLS),
            ("device", "device", DEVICES), ("precision", "precision", PRECISIONS), ("cell", "cell", CELL_NAMES),
            ("cuda_graphs", "--cuda-graphs", GRAPH_MODES), ("on_overfit", "--on-overfit", OVERFIT_MODES))


def flag(name: str) -> str:
    """An option's field name as its command-line flag: max_steps -> --max-steps."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Options:
    """Every setting of a run as a user gave it; None = not given (a preset or the rule decides).

    Each field sets the field of the same name in `ModelConfig` or `TrainConfig`, except
    `schedule` (train.schedule.kind) and `warmup`, `min_lr_ratio`, `factor`, `patience`
    (train.schedule's fields).
    """

    # the model
    hidden: int | None = None
    layers: int | None = None
    embed: int | None = None
    zoneout_cell: float | None = None
    zoneout_hidden: float | None = None
    dropout: float | None = None
    # training
    batch_size: int | None = None
    bptt: int | None = None
    lr: float | None = None
    optimizer: str | None = None
    weight_decay: float | None = None
    clip: float | None = None
    schedule: str | None = None
    warmup: int | None = None
    min_lr_ratio: float | None = None
    factor: float | None = None
    patience: int | None = None
    epochs: float | None = None
    max_steps: int | None = None
    time_budget: float | None = None  # seconds
    eval_every: int | None = None
    eval_streams: int | None = None
    eval_tokens: int | None = None
    state: str | None = None
    reset_prob: float | None = None
    average: float | None = None
    on_overfit: str | None = None
    seed: int | None = None
    device: str | None = None
    precision: str | None = None
    cell: str | None = None
    cuda_graphs: str | None = None
    keep_last: int | None = None
    log_every: int | None = None
    max_nonfinite: int | None = None
    zero: bool | None = None

    def given(self) -> dict:
        """{field: value} of the options that were given (config.json stores this)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def __or__(self, later: Options) -> Options:
        """These options with every option given in `later` replacing its value."""
        return replace(self, **later.given())

    def model_options(self) -> dict:
        """The given options that shape the model."""
        return {k: v for k, v in self.given().items() if k in _MODEL_FIELDS}

    def apply(self, model: ModelConfig, train: TrainConfig, vocab_size: int) -> tuple[ModelConfig, TrainConfig]:
        """`model` and `train` with every given option replacing its value (checked by their
        `__post_init__`), and the vocabulary size of the data."""
        given = self.given()
        schedule = replace(train.schedule, **{_SCHEDULE_FIELDS[k]: v for k, v in given.items()
                                              if k in _SCHEDULE_FIELDS})
        train_kw = {k: v for k, v in given.items() if k in _TRAIN_FIELDS}
        return (replace(model, vocab_size=vocab_size, **self.model_options()),
                replace(train, schedule=schedule, **train_kw))

    @classmethod
    def of(cls, model: ModelConfig, train: TrainConfig) -> Options:
        """Every field of two configs as given options (a library caller's whole configuration)."""
        m, t = model.to_dict(), train.to_dict()
        s = t.pop("schedule")
        m.pop("vocab_size")
        return cls(**m, **t, **{opt: s[f] for opt, f in _SCHEDULE_FIELDS.items()})

    @classmethod
    def from_dict(cls, d: dict) -> Options:
        try:
            return cls(**d)
        except TypeError as e:
            raise UsageError(f"unknown option in {sorted(d)} ({e})") from None


_SCHEDULE_FIELDS = {"schedule": "kind", "warmup": "warmup", "min_lr_ratio": "min_lr_ratio",
                    "factor": "factor", "patience": "patience"}
_MODEL_FIELDS = {f.name for f in fields(ModelConfig)} - {"vocab_size"}
_TRAIN_FIELDS = {f.name for f in fields(TrainConfig)} - {"schedule"}


_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?$")


def parse_duration(text: str) -> float:
    """'90s' | '10m' | '1h30m' | '600' -> seconds."""
    m = _DURATION.match(text.strip()) if text else None
    if not text or not m or not any(m.groups()):
        raise UsageError(f"cannot read duration {text!r}; write e.g. 90s, 10m or 1h30m")
    h, mi, s = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mi * 60 + s


def fields_of_options() -> set[str]:
    """The names of every `Options` field."""
    return {f.name for f in fields(Options)}

"""The run specification: everything a run is, frozen and typed; config.json is its serialisation.

`zlm.training.plan.plan` makes a `RunSpec` from a source and the options a user gave; the
Trainer is built from it and nothing else; every checkpoint and best/ carry it as
config.json, and `read_spec` is the one loader (`zlm train --resume`, `zlm eval`,
`zlm sample`, `zlm info`, `zlm compare`, the plots).

    config.json = {"format": 1, "zlm_version": ..., "preset": "cpu-small",
                   "model": ModelConfig, "train": TrainConfig,
                   "resolved": {"precision", "cell", "kernel",      what "auto" became
                                "product"},                         (the CPU cell's recurrent product)
                   "defaults_rule": DefaultsRule | absent,          what the rule chose
                   "parent": {"path", "model_sha256"} | absent,     --init-from's model
                   "data": {"path", "tokenizer", "unit"}, "world_size": N}

A config.json of another format (or none: written before formats were numbered) is
refused with one line; there is no silent migration. Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from zlm.core.config import Options, TrainConfig
from zlm.errors import CheckpointError, UsageError
from zlm.model.config import KERNELS, ModelConfig
from zlm.version import __version__

FORMAT = 1  # config.json's format number; a run of any other is refused
REGIME_NAMES = ("regularised", "between", "data-rich", "open")
# Resolved.product's values ("": not recorded), and what `zlm info` calls them
PRODUCT_NAMES = {"mkl": "MKL's packed GEMM", "amx": "AMX's micro-kernel", "onednn": "oneDNN's packed linear",
                 "addmm": "torch.addmm"}


@dataclass(frozen=True)
class Resolved:
    """The concrete settings a run trains with (config.json "resolved")."""

    precision: str  # fp32 | bf16 | fp16
    cell: str  # fused | reference | plain (what --cell asked for, resolved)
    kernel: str  # compiled | python | triton | reference | plain (the code that runs)
    why: str = field(default="", compare=False)  # one line for the start display (not stored)
    # what ran the compiled CPU cell's recurrent products (mkl | amx | onednn | addmm;
    # `zlm.model.cells.recurrent_product`), "" for other kernels and runs that did not record it
    product: str = ""

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise CheckpointError(f"config.json names an unknown cell kernel {self.kernel!r}; use another checkpoint")
        if self.product and self.product not in PRODUCT_NAMES:
            raise CheckpointError(f"config.json names an unknown recurrent product {self.product!r}; "
                                  "use another checkpoint")

    def to_dict(self) -> dict:
        d = {"precision": self.precision, "cell": self.cell, "kernel": self.kernel}
        return d | {"product": self.product} if self.product else d


@dataclass(frozen=True)
class DefaultsRule:
    """The defaults rule's decision for one run (config.json "defaults_rule";
    `zlm.training.defaults.decide` makes it)."""

    regime: str  # regularised | between | data-rich | open
    expected_epochs: float | None  # passes over the train split the run should make
    tokens_per_s: float | None  # the speed probe's measurement (None: not needed or not taken)
    settings: Options = field(default_factory=Options)  # what the rule chose
    line: str = ""  # what `zlm train` prints at start
    small_hidden: int | None = None  # the probe's second size (`defaults.small_probe`; None: not taken)
    small_tokens_per_s: float | None = None  # and its measurement

    def to_dict(self) -> dict:
        return {**asdict(self), "settings": self.settings.given()}

    @classmethod
    def from_dict(cls, d: dict) -> DefaultsRule:
        try:
            rule = cls(**{**d, "settings": Options(**d.get("settings", {}))})
        except TypeError as e:
            raise CheckpointError(f"config.json has a damaged 'defaults_rule' block ({e}); "
                                  "start a new run") from None
        if rule.regime not in REGIME_NAMES:
            raise CheckpointError(f"config.json names an unknown defaults regime {rule.regime!r}; start a new run")
        return rule


@dataclass(frozen=True)
class DataRef:
    """The prepared data a run trains on (config.json "data")."""

    path: str  # the DATA_DIR, absolute
    tokenizer: dict  # dataset.json's tokenizer block: {"kind", "vocab_size", "file"}
    unit: str  # character | byte: what BPC counts


@dataclass(frozen=True)
class ParentRef:
    """The model a fine-tuning run started from (`zlm train --init-from`; config.json "parent")."""

    path: str  # the checkpoint directory whose weights were loaded, absolute
    model_sha256: str  # of its model.safetensors


@dataclass(frozen=True)
class RunSpec:
    """One run, fully decided: the model, how it trains, on what, and what was resolved."""

    model: ModelConfig
    train: TrainConfig
    resolved: Resolved
    data: DataRef
    preset: str = "cpu-small"
    rule: DefaultsRule | None = None  # None: --preset given, or a library caller's own configs
    world_size: int = 1
    parent: ParentRef | None = None  # the model this run was initialised from (--init-from)
    zlm_version: str = __version__
    format: int = FORMAT

    def to_dict(self) -> dict:
        d = {"format": self.format, "zlm_version": self.zlm_version, "preset": self.preset,
             "model": self.model.to_dict(), "train": self.train.to_dict(), "resolved": self.resolved.to_dict(),
             "data": asdict(self.data), "world_size": self.world_size}
        if self.rule is not None:
            d["defaults_rule"] = self.rule.to_dict()
        if self.parent is not None:
            d["parent"] = asdict(self.parent)
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> RunSpec:
        """A spec from config.json's object; a CheckpointError names what is wrong."""
        if not isinstance(d, dict):
            raise CheckpointError(f"{where} is not a JSON object; use another checkpoint")
        fmt = d.get("format")
        if fmt != FORMAT:
            said = "has no format number (written before zlm numbered them)" if fmt is None else f"is format {fmt!r}"
            raise CheckpointError(f"{where} {said}; this zlm {__version__} reads format {FORMAT} only: "
                                  "train the run again with this version")
        try:
            return cls(model=ModelConfig(**d["model"]), train=TrainConfig(**d["train"]),
                       resolved=Resolved(**d["resolved"]), data=DataRef(**d["data"]),
                       preset=d["preset"], world_size=int(d["world_size"]), zlm_version=d["zlm_version"],
                       rule=DefaultsRule.from_dict(d["defaults_rule"]) if "defaults_rule" in d else None,
                       parent=ParentRef(**d["parent"]) if "parent" in d else None)
        except (KeyError, TypeError, ValueError, UsageError) as e:
            raise CheckpointError(f"{where} is damaged ({type(e).__name__}: {e}); use another checkpoint") from None


def read_config(directory: Path) -> dict:
    """DIR/config.json as a dict (the raw object: `read_spec` checks and types it)."""
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a zlm run or checkpoint directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is unreadable ({e}); use another checkpoint") from None


def read_spec(directory: Path) -> RunSpec:
    """The RunSpec stored in DIR/config.json (a RUN_DIR, a checkpoint or best/)."""
    return RunSpec.from_dict(read_config(directory), str(Path(directory) / "config.json"))

"""Loading a checkpoint into a ready model, tokenizer and runtime (`load_model`).

What `zlm eval`, `zlm sample`, `zlm score`, `zlm compress` and the Python API
(`zlm.inference.language_model`) share. Loading verifies the manifest (sizes and
SHA-256), reads the run's spec (`zlm.core.spec`), builds the model from it
and loads the tensors strictly, so a checkpoint whose config and tensors disagree is a
one-line `CheckpointError` even when its manifest was rewritten to match. The model is
left in eval mode: zoneout uses its expectation, dropout is off.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from zlm.core import checkpoint as ckpt
from zlm.core.checkpoint import check_weights, load_weights
from zlm.core.precision import Runtime, resolve_runtime
from zlm.core.spec import RunSpec
from zlm.data.tokenizers import Tokenizer, load_tokenizer
from zlm.errors import CheckpointError, ZlmError
from zlm.model.cells import CellChoice, choose_cell
from zlm.model.lm import ModelConfig, ZoneoutLM


@dataclass
class LoadedModel:
    """A loaded checkpoint: model (eval mode, on runtime.device), tokenizer, and provenance.

    What evaluation, sampling and scoring take; `zlm.inference.language_model.LanguageModel` adds the
    user-facing methods."""

    model: ZoneoutLM
    tokenizer: Tokenizer
    runtime: Runtime
    path: Path  # the checkpoint directory actually loaded (e.g. RUN_DIR/best)
    spec: RunSpec  # config.json: the run's spec
    cell: CellChoice

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    @property
    def data_path(self) -> Path | None:
        """The DATA_DIR the model was trained on, as recorded in config.json.

        A run directory that was moved (or copied to another machine) no longer finds the
        absolute path it recorded; then RUN_DIR/data, beside best/ or checkpoints/, is used.
        """
        p = self.spec.data.path
        recorded = Path(p) if p else None
        if recorded is not None and (recorded / "dataset.json").is_file():
            return recorded
        for run_dir in (self.path.parent, self.path.parent.parent):
            if (run_dir / "data" / "dataset.json").is_file():
                return run_dir / "data"
        return recorded

    def __repr__(self) -> str:
        c = self.model_config
        return (f"{type(self).__name__}({str(self.path)!r}, {self.tokenizer.kind} vocab {c.vocab_size}, "
                f"{c.layers}x{c.hidden}, {self.runtime.describe()}, cell {self.cell.name})")


def load_model(path, device: str = "auto", precision: str = "fp32", cell: str = "auto",
               cls: type[LoadedModel] | None = None) -> LoadedModel:
    """Load a RUN_DIR (its best/, else latest complete checkpoint) or a checkpoint directory.

    precision: fp32 by default, so evaluation is exact; "auto"/"bf16"/"fp16" autocast the
    evaluation forward pass. cell: auto | fused | reference (all give the same numbers).
    cls: the class to return (a subclass of LoadedModel).
    """
    runtime = resolve_runtime(device, precision)
    loaded = ckpt.load(path)  # resolves, verifies the manifest deeply, reads the tensors
    spec = RunSpec.from_dict(loaded.config, f"{loaded.path}/config.json")
    model_cfg = spec.model
    meta = ckpt.read_json(loaded.path / "dataset.json", "dataset description")
    tok_meta = meta.get("tokenizer") or spec.data.tokenizer
    if not isinstance(tok_meta, dict):
        raise CheckpointError(f"{loaded.path}/dataset.json names no tokenizer; use another checkpoint")
    try:
        tokenizer = load_tokenizer(loaded.path, tok_meta)
    except ZlmError as e:
        raise CheckpointError(f"{loaded.path}: its tokenizer does not load ({e})") from None
    if tokenizer.vocab_size != model_cfg.vocab_size:
        raise CheckpointError(
            f"{loaded.path}: the tokenizer has {tokenizer.vocab_size} entries but the model "
            f"{model_cfg.vocab_size}; the checkpoint is inconsistent: use another one")
    choice = choose_cell(cell, runtime.device, zoneout=(model_cfg.zoneout_cell, model_cfg.zoneout_hidden))
    if model_cfg.layers > len(loaded.model):  # each layer has tensors: a damaged config.json
        raise CheckpointError(f"{loaded.path}/config.json says {model_cfg.layers} layers but the "
                              "weights hold fewer; the checkpoint is damaged: use another one")
    try:  # shapes only, from the config: a damaged config.json must not allocate (a model
        # built on the meta device would import torch._dynamo, slowly, for its initialisers)
        own = {k: torch.empty(s, device="meta") for k, s in model_cfg.parameter_shapes().items()}
    except (RuntimeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{loaded.path}/config.json describes an impossible model "
                              f"({str(e).splitlines()[0]}); use another checkpoint") from None
    check_weights(own, loaded.model, loaded.path)
    model = ZoneoutLM(model_cfg, choice.fn, init=False)  # every weight is loaded next (check_weights)
    load_weights(model, loaded.model, loaded.path)
    model.to(runtime.device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return (cls or LoadedModel)(model, tokenizer, runtime, loaded.path, spec, choice)

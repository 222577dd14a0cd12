"""`zlm train --init-from RUN_OR_CHECKPOINT`: start a new run from a trained model's weights.

The parent's shape (hidden, layers, embed) and tokenizer carry over; the new text is
prepared with that tokenizer (`PrepareConfig.base`), so a char vocabulary may grow by the
new text's characters. Rows are matched by token: for a char vocabulary by character
(ids follow sorted order, so an added character can move others), otherwise one to one.
A new character's embedding is the mean of the parent's rows, its decoder row is zero
with a bias 20 nats under the parent's lowest, so until it is trained the old characters'
predictions are what the parent's were (the new rows take less than e^-20 of the mass).
Optimizer and schedule start fresh; only the weights are taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from zlm.core import checkpoint as ckpt
from zlm.core.config import Options, flag
from zlm.core.spec import ParentRef, RunSpec, read_spec
from zlm.data.tokenizers import CharTokenizer, Tokenizer, load_tokenizer
from zlm.errors import CheckpointError, UsageError

SHAPE = ("hidden", "layers", "embed")
NEW_ROW_MARGIN = 20.0  # nats under the parent's lowest decoder bias


@dataclass(frozen=True)
class Parent:
    """A trained model to start from: its checkpoint directory, spec and model digest."""

    path: Path
    spec: RunSpec

    @property
    def ref(self) -> ParentRef:
        manifest = ckpt.verify(self.path, deep=False)
        return ParentRef(str(self.path.resolve()), manifest["files"]["model.safetensors"]["sha256"])

    def shape(self) -> Options:
        m = self.spec.model
        return Options(hidden=m.hidden, layers=m.layers, embed=m.embed)

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.path, self.spec.data.tokenizer)


def find_parent(path: str | Path) -> Parent:
    """A RUN_DIR (its best/, else the latest complete checkpoint) or a checkpoint directory."""
    where = ckpt.resolve(Path(path))
    return Parent(where, read_spec(where))


def check_shape(parent: Parent, options: Options) -> None:
    """A shape option that differs from the parent's is refused (one line)."""
    for name in SHAPE:
        given, theirs = getattr(options, name), getattr(parent.spec.model, name)
        if given is not None and given != theirs:
            raise UsageError(f"{flag(name)} {given} differs from the {theirs} of the model in --init-from "
                             f"{parent.path}; a fine-tuned model keeps its parent's shape: leave {flag(name)} out")


def load_parent_weights(model, ref: ParentRef, tokenizer: Tokenizer) -> None:
    """Copy the weights of the parent `ref` records into `model` (built with `tokenizer`'s
    vocabulary); refused when the parent's model is no longer the one the run was planned on."""
    parent = find_parent(ref.path)
    if parent.ref.model_sha256 != ref.model_sha256:
        raise CheckpointError(f"{ref.path}/model.safetensors has changed since this run was planned (SHA-256 "
                              f"{parent.ref.model_sha256[:12]}, recorded {ref.model_sha256[:12]}); start a new run")
    loaded = ckpt.load(parent.path)
    rows = _row_map(parent.tokenizer(), tokenizer)  # (V_new,) parent row or -1
    own = model.state_dict()
    with torch.no_grad():
        for name, target in own.items():
            src = loaded.model.get(name)
            if src is None:
                raise CheckpointError(f"{parent.path} lacks {name}; pass another --init-from")
            if name in ("embedding.weight", "decoder.weight", "decoder.bias"):
                src = _remap(name, src, rows)
            if tuple(src.shape) != tuple(target.shape):
                raise CheckpointError(f"{parent.path}: {name} is {tuple(src.shape)}, this model needs "
                                      f"{tuple(target.shape)}; pass another --init-from")
            target.copy_(src)


def _row_map(old: Tokenizer, new: Tokenizer) -> torch.Tensor:
    if isinstance(old, CharTokenizer) and isinstance(new, CharTokenizer):
        index = {c: i for i, c in enumerate(old.chars)}
        return torch.tensor([index.get(c, -1) for c in new.chars], dtype=torch.long)
    if old.vocab_size != new.vocab_size:
        raise CheckpointError("the data's tokenizer differs from the --init-from model's; prepare the text "
                              "with that model's tokenizer (pass the raw text to zlm train)")
    return torch.arange(new.vocab_size)


def _remap(name: str, src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of the new vocabulary from the parent's; new tokens get neutral rows."""
    known = rows >= 0
    out = src[rows.clamp(min=0)].clone()  # (V_new, ...)
    if name == "embedding.weight":
        out[~known] = src.mean(0)
    elif name == "decoder.weight":
        out[~known] = 0.0
    else:  # decoder.bias
        out[~known] = src.min() - NEW_ROW_MARGIN
    return out

"""`zlm export`: a trained model as a single-step function other runtimes can run.

Owns `ExportConfig` -> `export_run` -> `ExportResult`, the step module (`SingleStep`) and
the two writers. The exported function is the eval-mode model (zoneout uses its
expectation, dropout is off) for one timestep of B streams:

    tokens (B,) int64, h (L, B, H) fp32, c (L, B, H) fp32  ->  logits (B, V), h', c'

B is dynamic; start from h = c = 0 and feed the newline token (`context_id` in
zlm-export.json) before a prime, as `zlm sample` does. OUT is a directory holding

    model.onnx | model.pt2     the step function (ONNX opset 18+ / torch.export program)
    tokenizer.json | .model    the tokenizer, as zlm saves it
    zlm-export.json            shapes, input and output names, vocabulary, context id

ONNX goes through `torch.onnx.export` (its default exporter needs `onnx` and
`onnxscript`: `pip install 'zlm[export]'`); torch-export through `torch.export.export`
and `torch.export.save` (.pt2; load it with `torch.export.load(path).module()`). The
directory is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from zlm.atomic import replace_directory, temporary_name
from zlm.data.tokenizers import context_ids
from zlm.errors import UsageError, ZlmError
from zlm.inference.load import load_model
from zlm.model.lm import ZoneoutLM
from zlm.version import __version__

FORMATS = {"onnx": "model.onnx", "torch-export": "model.pt2"}
INPUTS = ("tokens", "h", "c")
OUTPUTS = ("logits", "h_out", "c_out")
MAX_BATCH = 65536  # the dynamic batch dimension's upper bound


@dataclass(frozen=True)
class ExportConfig:
    """What `zlm export` writes, and where."""

    format: str  # onnx | torch-export (--format)
    out: Path  # the directory to create (-o); must not exist unless force
    force: bool = False  # replace an existing OUT (--force)

    def __post_init__(self):
        if self.format not in FORMATS:
            raise UsageError(f"--format {self.format} is not a format; use onnx or torch-export")


@dataclass(frozen=True)
class ExportResult:
    out: Path
    model_file: Path
    meta: dict


class SingleStep(nn.Module):
    """One eval-mode timestep of a `ZoneoutLM` for B streams."""

    def __init__(self, model: ZoneoutLM):
        super().__init__()
        self.model = model.eval()

    def forward(self, tokens: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """tokens (B,) int64, h, c (L, B, H) -> logits (B, V), h, c (L, B, H)."""
        logits, (h, c) = self.model(tokens[None, :], (h, c))  # (1, B, V)
        return logits[0], h, c


def _example(model: ZoneoutLM, batch: int = 2) -> tuple[Tensor, Tensor, Tensor]:
    cfg = model.config
    z = torch.zeros(cfg.layers, batch, cfg.hidden)
    return torch.zeros(batch, dtype=torch.long), z, z.clone()


def _dynamic_shapes() -> dict:
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    return {"tokens": {0: batch}, "h": {1: batch}, "c": {1: batch}}


@contextlib.contextmanager
def _quiet():
    """The exporters' warnings and progress lines (e.g. torchvision ops skipped) stay quiet."""
    log = logging.getLogger("torch.onnx")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def _write_torch_export(step: SingleStep, path: Path) -> None:
    program = torch.export.export(step, _example(step.model), dynamic_shapes=_dynamic_shapes())
    torch.export.save(program, path)


def _write_onnx(step: SingleStep, path: Path) -> None:
    missing = [m for m in ("onnx", "onnxscript") if not _importable(m)]
    if missing:
        raise ZlmError(f"--format onnx needs {' and '.join(missing)}: pip install 'zlm[export]'")
    torch.onnx.export(step, _example(step.model), str(path), dynamic_shapes=_dynamic_shapes(),
                      input_names=list(INPUTS), output_names=list(OUTPUTS),
                      external_data=False, verbose=False)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def check_target(out: Path, force: bool) -> None:
    """A one-line UsageError unless OUT can be created (or, with force, replaced)."""
    out = Path(out)
    if out.exists() and not force:
        raise UsageError(f"-o {out} already exists; remove it, choose another name or pass --force")
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {out} is a file; --force replaces only an export directory")
    parent = out.parent
    if not parent.is_dir():
        raise UsageError(f"-o {out}: the folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"-o {out}: the folder {parent} is not writable; choose another place")


def _meta(lm, fmt: str, tokenizer_file: str) -> dict:
    cfg = lm.model_config
    ctx = context_ids(lm.tokenizer)
    return {
        "format": fmt, "file": FORMATS[fmt], "zlm_version": __version__,
        "torch_version": torch.__version__, "checkpoint": str(lm.path),
        "inputs": {"tokens": ["batch"], "h": [cfg.layers, "batch", cfg.hidden],
                   "c": [cfg.layers, "batch", cfg.hidden]},
        "outputs": {"logits": ["batch", cfg.vocab_size], "h_out": [cfg.layers, "batch", cfg.hidden],
                    "c_out": [cfg.layers, "batch", cfg.hidden]},
        "dtype": {"tokens": "int64", "state": "float32", "logits": "float32"},
        "layers": cfg.layers, "hidden": cfg.hidden, "vocab_size": cfg.vocab_size,
        "tokenizer": {**lm.tokenizer.meta(), "file": tokenizer_file},
        "context_id": None if ctx is None else int(ctx[-1]),
        "model": cfg.to_dict(),
    }


def export_run(path, config: ExportConfig) -> ExportResult:
    """`zlm export`: load a RUN_DIR or checkpoint on the CPU in fp32 and write OUT."""
    out = Path(config.out)
    check_target(out, config.force)
    lm = load_model(path, "cpu", "fp32", "reference")  # the readable cell traces cleanly
    step = SingleStep(lm.model)
    tmp = temporary_name(out)
    try:
        tmp.mkdir()
        model_file = tmp / FORMATS[config.format]
        with _quiet(), torch.no_grad():
            if config.format == "onnx":
                _write_onnx(step, model_file)
            else:
                _write_torch_export(step, model_file)
        tok_file = lm.tokenizer.save(tmp).name
        meta = _meta(lm, config.format, tok_file)
        (tmp / "zlm-export.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        replace_directory(tmp, out)
    except OSError as e:
        raise UsageError(f"-o {out} cannot be written ({e.strerror or e}); choose a writable "
                         "place with free space") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(out, out / FORMATS[config.format], meta)

"""Everything a training run needs to continue exactly: `TrainState` and `Checkpointer`.

A training checkpoint (layout in `zlm.core.checkpoint`) holds the model, the optimizer (its
tensors flattened into safetensors), the carried hidden state of every rank
(state.safetensors), and trainer.json: the `TrainState` counters (step, epoch, elapsed
time, best and last valid BPC, non-finite count), every rank's stream positions, the
schedule state, the GradScaler state, every rank's RNG states (base64 of torch's byte
tensors), the world size and the total number of streams.

The `Checkpointer` takes the stateful parts as one mapping (each part has `state_dict()` /
`load_state_dict()`): model, optimizer, scaler, streams, schedule, train_state, rng; and
the weight average (`zlm.training.averaging`), written to average.safetensors with its
count in trainer.json once averaging has started; and the overfitting guard
(`zlm.training.schedule`: its recent validations and cool-down, trainer.json's "overfit").
"""

from __future__ import annotations

import base64
import errno
import json
import math
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zlm.core import checkpoint as ckpt
from zlm.core.checkpoint import load_weights
from zlm.data.dataset import Dataset
from zlm.errors import CheckpointError, ZlmError


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


@dataclass
class TrainState:
    """The trainer's counters; saved in trainer.json (all but last_good)."""

    step: int = 0  # optimizer steps taken (skipped non-finite steps count)
    epoch: float = 0.0  # passes over the training split, fractional
    elapsed: float = 0.0  # seconds of training, summed over resumes
    best_bpc: float = math.inf  # best valid BPC so far (what best/ holds)
    valid_bpc: float | None = None  # the last valid BPC
    train_slice_bpc: float | None = None  # the last eval-mode BPC of a fixed train slice (the gap's other side)
    nonfinite: int = 0  # non-finite losses in a row
    last_good: str | None = None  # newest checkpoint written or resumed from (not saved)

    def state_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "elapsed": self.elapsed,
                "best_bpc": self.best_bpc, "nonfinite": self.nonfinite, "valid_bpc": self.valid_bpc,
                "train_slice_bpc": self.train_slice_bpc}

    def load_state_dict(self, d: dict) -> None:
        self.step, self.elapsed = d["step"], d["elapsed"]
        self.best_bpc, self.nonfinite = d["best_bpc"], d["nonfinite"]
        self.epoch, self.valid_bpc = d.get("epoch", 0.0), d.get("valid_bpc")
        self.train_slice_bpc = d.get("train_slice_bpc")


class RNGState:
    """The torch (and CUDA) generator of one device as a stateful part."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict:
        state = {"torch": _b64(torch.get_rng_state())}
        if self.device.type == "cuda":
            state["cuda"] = _b64(torch.cuda.get_rng_state(self.device))
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(_unb64(state["torch"]))
        if self.device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(_unb64(state["cuda"]), self.device)


Carried = tuple[torch.Tensor, torch.Tensor] | None  # this rank's (h, c), each (L, B, H)


class Checkpointer:
    """Writes a run's training checkpoints (rank 0) and restores them (every rank).

    parts: {"model", "optimizer", "scaler", "streams", "schedule", "train_state", "rng"} and,
    optionally, "average" and "overfit".
    """

    def __init__(self, run_dir: Path, config: dict, data: Dataset, par, keep_last: int):
        self.run_dir, self.config, self.data, self.par, self.keep_last = run_dir, config, data, par, keep_last

    def save(self, parts: Mapping[str, Any], carried: Carried) -> Path | None:
        """Collect state from every rank; rank 0 writes checkpoints/step-NNNNNNNN atomically.

        Returns the checkpoint path on rank 0 and None elsewhere. A write failure (disk
        full, read-only directory) removes the partial copy and raises ZlmError; existing
        checkpoints are never touched.
        """
        par = self.par
        opt_state = par.consolidate_optimizer(parts["optimizer"])  # collective under ZeRO
        rngs = par.gather_object(parts["rng"].state_dict())
        streams_all = par.gather_object(parts["streams"].state_dict())
        tensors = {} if carried is None else {"h": par.gather_state(carried[0]),
                                               "c": par.gather_state(carried[1])}
        if not par.is_main:
            return None
        scaler = parts["scaler"]
        average = parts["average"].tensors() if "average" in parts else {}
        trainer = {
            **parts["train_state"].state_dict(), "world_size": par.world,
            "global_batch": parts["streams"].batch * par.world, "streams": streams_all,
            "schedule": parts["schedule"].state_dict(),
            "scaler": scaler.state_dict() if scaler.is_enabled() else None, "rng": rngs,
            "carried_state": "state.safetensors" if tensors else None,
            "average": {"count": parts["average"].count, "file": "average.safetensors"} if average else None,
            "overfit": parts["overfit"].state_dict() if "overfit" in parts else None,
        }
        final = self.run_dir / "checkpoints" / f"step-{trainer['step']:08d}"
        self._write(final, parts["model"], opt_state, tensors, trainer, average)
        ckpt.prune(self.run_dir, self.keep_last)
        return final

    def _write(self, final: Path, model, opt_state: dict, carried: dict, trainer: dict, average: dict) -> None:
        tmp = None
        try:
            tmp = ckpt.temp_directory(final)
            ckpt.write_tensors(tmp / "model.safetensors", model.state_dict())
            opt_tensors, opt_meta = ckpt.flatten_optimizer(opt_state)
            ckpt.write_tensors(tmp / "optimizer.safetensors", opt_tensors,
                               {"zlm.optimizer": json.dumps(opt_meta)})
            if carried:
                ckpt.write_tensors(tmp / "state.safetensors", carried)
            if average:
                ckpt.write_tensors(tmp / "average.safetensors", average)
            ckpt.write_json(tmp / "trainer.json", trainer)
            ckpt.write_json(tmp / "config.json", self.config)
            self.data.copy_description(tmp)
            ckpt.finish_directory(tmp, final, trainer["step"])
        except OSError as e:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            hint = {errno.ENOSPC: "free disk space", errno.EROFS: "make the run directory writable",
                    errno.EACCES: "make the run directory writable"}.get(e.errno, "check the disk")
            raise ZlmError(f"could not write checkpoint {final.name} ({e.strerror or e}); {hint} "
                           f"and resume with --resume; earlier checkpoints are untouched") from None

    def load(self, path: Path, parts: Mapping[str, Any], warn=None) -> Carried:
        """Restore every part from a verified checkpoint; returns this rank's carried state.

        Across world sizes: the optimizer state is always the consolidated full one (loads
        with or without ZeRO). The streams and the carried hidden state continue exactly
        when the total number of streams (processes x --batch-size) is unchanged, otherwise
        the run is refused; with a different number of processes each rank's RNG starts
        afresh (`warn` says so), so dropout/zoneout masks differ from an uninterrupted run.
        """
        par = self.par
        try:
            trainer = json.loads((path / "trainer.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}/trainer.json is unreadable ({e})") from None
        _check_streams(path, trainer, parts["streams"].batch, par.world)
        loaded = ckpt.load(path)
        load_weights(parts["model"], loaded.model, path)
        opt_tensors, opt_meta = ckpt.read_tensors(path / "optimizer.safetensors")
        meta = json.loads(opt_meta["zlm.optimizer"])
        parts["optimizer"].load_state_dict(ckpt.unflatten_optimizer(opt_tensors, meta))
        if trainer.get("scaler") and parts["scaler"].is_enabled():
            parts["scaler"].load_state_dict(trainer["scaler"])
        saved_world = trainer.get("world_size", 1)
        same_world = saved_world == par.world
        # Stream positions are the same on every rank (only the offsets differ), so any rank's do.
        parts["streams"].load_state_dict(trainer["streams"][par.rank if same_world else 0])
        parts["schedule"].load_state_dict(trainer["schedule"])
        if same_world:
            parts["rng"].load_state_dict(trainer["rng"][par.rank])
        elif warn is not None:
            warn(f"{path.name} was written by {saved_world} process(es), this run has {par.world}: streams, "
                 f"hidden state and optimizer continue exactly; dropout/zoneout masks are drawn afresh")
        parts["train_state"].load_state_dict(trainer)
        parts["train_state"].last_good = str(path)
        if "overfit" in parts:
            parts["overfit"].load_state_dict(trainer.get("overfit"))
        if trainer.get("average") and "average" in parts:
            mean, _ = ckpt.read_tensors(path / trainer["average"]["file"])
            parts["average"].load(mean, trainer["average"]["count"])
        if not trainer.get("carried_state"):
            return None
        tensors, _ = ckpt.read_tensors(path / trainer["carried_state"])
        device = parts["rng"].device
        return par.scatter_state(tensors["h"]).to(device), par.scatter_state(tensors["c"]).to(device)


def _check_streams(path, trainer: dict, batch: int, world: int) -> None:
    """Refuse a resume whose processes x --batch-size differs from the checkpoint's."""
    saved_world = trainer.get("world_size", 1)
    saved = trainer.get("global_batch")
    if saved == batch * world or (saved is None and saved_world == world):
        return
    if saved is None:  # written before global_batch was recorded
        raise CheckpointError(f"{path} was written by {saved_world} processes and this run has {world}; "
                              f"resume with the same number of processes")
    fix = (f"pass --batch-size {saved // world}" if saved % world == 0
           else f"use a number of processes that divides {saved}")
    raise CheckpointError(
        f"{path} carries {saved} training streams ({saved_world} process(es) x --batch-size "
        f"{saved // saved_world}) but this run has {world} x {batch} = {world * batch}, so its streams "
        f"and hidden state cannot continue; {fix} (or start a new run directory)"
    )

"""Saving and restoring everything a training run needs to continue exactly.

A training checkpoint (layout in `zlm.checkpoint`) holds the model, the optimizer (its
tensors flattened into safetensors), the carried hidden state of every rank, and
trainer.json: step, epoch, elapsed time, stream positions, schedule state, GradScaler
state, every rank's RNG states (base64 of torch's byte tensors) and best BPC.
"""

from __future__ import annotations

import base64
import errno
import json
import shutil
from pathlib import Path

import torch

from zlm.core import checkpoint as ckpt
from zlm.core.checkpoint import load_weights
from zlm.errors import CheckpointError, ZlmError


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state(device: torch.device) -> dict:
    state = {"torch": _b64(torch.get_rng_state())}
    if device.type == "cuda":
        state["cuda"] = _b64(torch.cuda.get_rng_state(device))
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_unb64(state["cuda"]), device)


def save_training_checkpoint(run_dir, t, model, optimizer, scaler, streams, sched, state,
                             config, data, par, keep_last) -> Path | None:
    """Collect state from every rank; rank 0 writes checkpoints/step-NNNNNNNN atomically.

    Returns the checkpoint path on rank 0 and None elsewhere. A write failure (disk
    full, read-only directory) removes the partial copy and raises ZlmError; existing
    checkpoints are never touched.
    """
    opt_state = par.consolidate_optimizer(optimizer)  # collective under ZeRO
    rngs = par.gather_object(rng_state(next(model.parameters()).device))
    streams_all = par.gather_object(streams.state_dict())
    carried = {}
    if state is not None:
        carried = {"h": par.gather_state(state[0]), "c": par.gather_state(state[1])}
    if not par.is_main:
        return None
    final = Path(run_dir) / "checkpoints" / f"step-{t['step']:08d}"
    trainer = {
        "step": t["step"], "epoch": t.get("epoch", 0.0), "elapsed": t["elapsed"],
        "best_bpc": t["best_bpc"], "nonfinite": t["nonfinite"], "valid_bpc": t.get("valid_bpc"),
        "world_size": par.world, "global_batch": streams.batch * par.world,
        "streams": streams_all, "schedule": sched.state_dict(),
        "scaler": scaler.state_dict() if scaler.is_enabled() else None, "rng": rngs,
        "carried_state": "state.safetensors" if carried else None,
    }
    tmp = None
    try:
        tmp = ckpt.temp_directory(final)
        ckpt.write_tensors(tmp / "model.safetensors", model.state_dict())
        opt_tensors, opt_meta = ckpt.flatten_optimizer(opt_state)
        ckpt.write_tensors(tmp / "optimizer.safetensors", opt_tensors,
                           {"zlm.optimizer": json.dumps(opt_meta)})
        if carried:
            ckpt.write_tensors(tmp / "state.safetensors", carried)
        ckpt.write_json(tmp / "trainer.json", trainer)
        ckpt.write_json(tmp / "config.json", config)
        data.copy_description(tmp)
        ckpt.finish_directory(tmp, final, t["step"])
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        hint = {errno.ENOSPC: "free disk space", errno.EROFS: "make the run directory writable",
                errno.EACCES: "make the run directory writable"}.get(e.errno, "check the disk")
        raise ZlmError(f"could not write checkpoint {final.name} ({e.strerror or e}); {hint} "
                       f"and resume with --resume; earlier checkpoints are untouched") from None
    ckpt.prune(run_dir, keep_last)
    return final


def load_trainer_state(path, model, optimizer, scaler, streams, sched, runtime, par, warn=None):
    """Restore everything from a verified checkpoint; returns (trainer dict, carried state).

    Across world sizes: the optimizer state is always the consolidated full one (loads
    with or without ZeRO). The streams and the carried hidden state continue exactly when
    the total number of streams (processes x --batch-size) is unchanged, otherwise the run
    is refused; with a different number of processes each rank's RNG starts afresh
    (`warn` says so), so dropout/zoneout masks differ from an uninterrupted run.
    """
    try:
        trainer = json.loads((path / "trainer.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}/trainer.json is unreadable ({e})") from None
    _check_streams(path, trainer, streams.batch, par.world)
    loaded = ckpt.load(path)
    load_weights(model, loaded.model, path)
    opt_tensors, opt_meta = ckpt.read_tensors(path / "optimizer.safetensors")
    meta = json.loads(opt_meta["zlm.optimizer"])
    optimizer.load_state_dict(ckpt.unflatten_optimizer(opt_tensors, meta))
    if trainer.get("scaler") and scaler.is_enabled():
        scaler.load_state_dict(trainer["scaler"])
    saved_world = trainer.get("world_size", 1)
    same_world = saved_world == par.world
    # Stream positions are the same on every rank (only the offsets differ), so any rank's do.
    streams.load_state_dict(trainer["streams"][par.rank if same_world else 0])
    sched.load_state_dict(trainer["schedule"])
    if same_world:
        set_rng_state(trainer["rng"][par.rank], runtime.device)
    elif warn is not None:
        warn(f"{path.name} was written by {saved_world} process(es), this run has {par.world}: streams, "
             f"hidden state and optimizer continue exactly; dropout/zoneout masks are drawn afresh")
    state = None
    if trainer.get("carried_state"):
        tensors, _ = ckpt.read_tensors(path / trainer["carried_state"])
        state = (par.scatter_state(tensors["h"]).to(runtime.device),
                 par.scatter_state(tensors["c"]).to(runtime.device))
    t = {k: trainer[k] for k in ("step", "elapsed", "best_bpc", "nonfinite")}
    t["epoch"] = trainer.get("epoch", 0.0)
    t["valid_bpc"] = trainer.get("valid_bpc")
    t["last_good"] = str(path)
    return t, state


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

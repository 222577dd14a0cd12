"""Checkpoints: safetensors and JSON only, written atomically, found again safely.

Layout of one checkpoint directory (docs/files.md):

    model.safetensors       the model's parameters (same keys for every cell)
    optimizer.safetensors   every optimizer tensor, flattened as state.<param>.<name>;
                            param_groups and scalars in the header metadata
    state.safetensors       carried hidden state h, c: (L, B_total, H) of all streams
    trainer.json            step, epoch, stream positions, schedule, GradScaler state (its
                            scale and growth tracker), RNG states, best BPC, ...
    config.json             resolved model/data/train config
    dataset.json + tokenizer.json|tokenizer.model   so the checkpoint loads on its own
    checkpoint.json         the manifest, written LAST: file names, sizes, SHA-256

A directory without a valid manifest is incomplete and never loaded. Writes go to a
temporary sibling, are fsynced, then renamed into place. No pickle anywhere: tensors are
only ever read with safetensors.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError

from zlm.errors import CheckpointError
from zlm.version import __version__

if TYPE_CHECKING:
    import torch

FORMAT = "zlm-checkpoint"
VERSION = 1
MANIFEST = "checkpoint.json"
STEP_DIR = re.compile(r"^step-(\d{8,})$")
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_json(path: Path, obj) -> None:
    """Write JSON atomically: a temporary file, fsynced, renamed over `path`."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True, allow_nan=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# torch is imported only where tensors are read or written: listing and verifying
# checkpoints and reading their headers (zlm info) never load it.
def load_file(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file as load

    return load(path)


def save_file(tensors: dict[str, torch.Tensor], path: str, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file as save

    save(tensors, path, metadata=metadata)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:  # an I/O failure inside the Rust writer: surface it as OSError
        m = re.search(r"os error (\d+)", str(e))
        code = int(m.group(1)) if m else errno.EIO
        raise OSError(code, os.strerror(code), str(path)) from None
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def finish_directory(tmp: Path, final: Path, step: int | None = None) -> Path:
    """Write the manifest into tmp, fsync, and move tmp to final (replacing it)."""
    files = {}
    for p in sorted(tmp.iterdir()):
        if p.is_file() and p.name != MANIFEST:
            files[p.name] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    manifest = {"format": FORMAT, "version": VERSION, "zlm_version": __version__,
                "step": step, "files": files}
    write_json(tmp / MANIFEST, manifest)
    _fsync_dir(tmp)
    if final.exists():  # e.g. best/: swap atomically, then delete the old one
        if _exchange(tmp, final):
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # no renameat2: a short window where only .old-* holds the previous copy
            old = final.with_name(f".old-{final.name}-{os.getpid()}")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(final.parent)
    return final


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    rc = fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    return rc == 0


def temp_directory(final: Path) -> Path:
    """A fresh temporary sibling of `final` (leftovers of crashed writes are removed)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_temporaries(final.parent)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def clean_temporaries(parent: Path) -> None:
    """Remove .tmp-* / .old-* leftovers of interrupted writes in `parent`."""
    if parent.is_dir():
        for p in parent.iterdir():
            if p.name.startswith((".tmp-", ".old-")):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)


def verify(path: Path, deep: bool = True) -> dict:
    """The manifest of a complete checkpoint directory, or CheckpointError saying why not."""
    path = Path(path)
    m = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory; pass a RUN_DIR or a checkpoint")
    if not m.is_file():
        raise CheckpointError(f"{path} is incomplete (no {MANIFEST}); it was not fully written")
    try:
        manifest = json.loads(m.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{m} is corrupt ({e.__class__.__name__}); use an earlier checkpoint") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a zlm checkpoint (bad {MANIFEST})")
    if not isinstance(manifest.get("version"), int) or manifest["version"] > VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {manifest.get('version')}, newer than this "
            f"zlm reads ({VERSION}); upgrade zlm"
        )
    files = manifest.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(i, dict) for i in files.values()):
        raise CheckpointError(f"{path} is not a zlm checkpoint (bad {MANIFEST} file list)")
    for name, info in files.items():
        p = path / name
        if not p.is_file() or p.stat().st_size != info.get("bytes"):
            raise CheckpointError(f"{p} is missing or truncated; use an earlier checkpoint")
        if deep and _sha256(p) != info.get("sha256"):
            raise CheckpointError(f"{p} does not match its checksum (corrupt); use an earlier checkpoint")
    return manifest


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (names, dtypes, shapes) without its tensors."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > min(MAX_HEADER, size - 8):
                raise ValueError(f"declares a {n:,}-byte header in a {size:,}-byte file")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        return header
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a valid safetensors file ({e})") from None


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and metadata of a safetensors file; CheckpointError if it is malformed."""
    header = read_header(path)  # bounded checks before safetensors allocates anything
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path} is not a valid safetensors file ({e})") from None
    return tensors, header.get("__metadata__", {}) or {}


def step_dirs(run_dir: Path) -> list[Path]:
    """checkpoints/step-* directories of a run, oldest first (complete or not)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_complete(run_dir: Path, warn=None) -> Path | None:
    """The newest checkpoint that verifies; `warn(msg)` is told about each bad newer one."""
    for p in reversed(step_dirs(run_dir)):
        try:
            verify(p)
            return p
        except CheckpointError as e:
            if warn is not None:
                warn(f"skipping {p.name}: {e}")
    return None


def prune(run_dir: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` step directories."""
    dirs = step_dirs(run_dir)
    for p in dirs[: max(len(dirs) - keep_last, 0)]:
        # Rename first: a deletion cut short leaves a .old-* leftover, never a torn step-*.
        doomed = p.with_name(f".old-{p.name}-{os.getpid()}")
        os.rename(p, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def resolve(path: Path) -> Path:
    """A checkpoint directory from a RUN_DIR (best/, else the latest) or a checkpoint path."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a RUN_DIR or a checkpoint directory")
    if path.is_file():
        path = path.parent
    if (path / MANIFEST).exists():
        return path
    if (path / "best" / MANIFEST).exists():
        return path / "best"
    latest = latest_complete(path)
    if latest is None:
        raise CheckpointError(f"{path} holds no complete checkpoint; train first or pass a checkpoint")
    return latest


@dataclass
class Loaded:
    """What a checkpoint directory holds, read from safetensors and JSON."""

    path: Path
    config: dict
    model: dict[str, torch.Tensor]


def load(path: Path) -> Loaded:
    """Load the model weights and config of a checkpoint directory (verified first)."""
    path = resolve(path)
    verify(path)
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # (JSONDecodeError and UnicodeDecodeError included)
        raise CheckpointError(f"{path}/config.json is unreadable ({e.__class__.__name__}); "
                              "use an earlier checkpoint") from None
    tensors, _ = read_tensors(path / "model.safetensors")
    return Loaded(path, config, tensors)


def flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """optimizer.state_dict() -> (tensors named state.<param>.<key>, JSON-able rest).

    A hyperparameter held as a one-element tensor (the learning rate of a step captured in
    a CUDA graph) is saved as its number."""
    import torch

    tensors, scalars = {}, {}
    for pid, entry in state["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"state.{pid}.{key}"] = value
            else:
                scalars[f"{pid}.{key}"] = value
    groups = [{k: v.item() if torch.is_tensor(v) else v for k, v in g.items()} for g in state["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict = {}
    for name, value in tensors.items():
        _, pid, key = name.split(".", 2)
        state.setdefault(int(pid), {})[key] = value
    for name, value in meta.get("scalars", {}).items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def load_weights(model, tensors: dict, path) -> None:
    """Strict load with a one-line error naming the first mismatch."""
    check_weights(model.state_dict(), tensors, path)
    model.load_state_dict(tensors)


def check_weights(own: dict, tensors: dict, path) -> None:
    """CheckpointError unless `tensors` has exactly the keys, shapes and dtypes of `own`."""
    missing = sorted(set(own) - set(tensors))
    extra = sorted(set(tensors) - set(own))
    if missing or extra:
        raise CheckpointError(
            f"{path} does not match this model (missing {missing[:3]}, unexpected {extra[:3]}); "
            f"check its config.json"
        )
    for k, v in tensors.items():
        if v.shape != own[k].shape or v.dtype != own[k].dtype:
            raise CheckpointError(
                f"{path}: tensor {k} is {v.dtype} {tuple(v.shape)} but the config implies "
                f"{own[k].dtype} {tuple(own[k].shape)}; the checkpoint and its config.json disagree"
            )


def read_json(path: Path, what: str) -> dict:
    """A JSON object from a checkpoint file, or a one-line CheckpointError."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is unreadable ({e.__class__.__name__}); the {what} is "
                              "damaged: use another checkpoint") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path} is not a JSON object; the {what} is damaged: use "
                              "another checkpoint")
    return doc


def read_json_or_none(path: Path) -> dict | None:
    """A JSON object from a run's file, or None when it is missing or damaged (for tools
    that list runs and skip what they cannot read)."""
    try:
        return read_json(path, "file")
    except CheckpointError:
        return None

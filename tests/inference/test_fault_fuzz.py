"""Fuzzing campaign (slow): thousands of mutated checkpoints through verify, read_tensors
and zlm.inference.load. The only acceptable failure is a one-line CheckpointError.

Run with `python -m pytest -m slow tests/inference/test_fault_fuzz.py -s` (prints the counts).
Half the mutants have their manifest re-sealed (sizes and SHA-256 recomputed), as a buggy
or hostile writer would leave them, so the checks behind the checksum are reached too.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import shutil
import struct
import time

import pytest

from conftest import shakespeare_text, train_run, write_char_dataset
from zlm.core import checkpoint as ckpt
from zlm.core.config import TrainConfig
from zlm.data.dataset import Dataset
from zlm.errors import CheckpointError
from zlm.inference import load as inference
from zlm.model.lm import ModelConfig

pytestmark = pytest.mark.slow

N_MUTANTS = int(os.environ.get("ZLM_FUZZ_N", "2400"))
FILES = ("model.safetensors", "config.json", "dataset.json", "tokenizer.json", "checkpoint.json")
ODD_VALUES = [None, -1, 0, 1, 2, 3.5, 1e308, float("nan"), 2**31, 2**63, 10**6, "", "x", [], {}, [1], True]


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    data = Dataset.open(write_char_dataset(root / "data", shakespeare_text(6000)))
    mc = ModelConfig(vocab_size=data.vocab_size, hidden=16, embed=8, layers=2)
    tc = TrainConfig(batch_size=4, bptt=16, max_steps=2, eval_every=2, eval_streams=2)
    train_run(root / "run", data, mc, tc)
    path = root / "run" / "best"
    inference.load(path, device="cpu")  # the unmutated checkpoint loads
    return path


def _reseal(d) -> None:
    """Rewrite checkpoint.json so that sizes and hashes match the files as they are now."""
    m = d / ckpt.MANIFEST
    try:
        manifest = json.loads(m.read_text(encoding="utf-8"))
        files = manifest["files"]
        for name in list(files):
            p = d / name
            if p.is_file():
                raw = p.read_bytes()
                files[name] = {**files[name], "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
        m.write_text(json.dumps(manifest))
    except Exception:  # the manifest itself was the mutant: leave it as it is
        pass


def _mutate_bytes(rng: random.Random, raw: bytes, donor: bytes) -> tuple[str, bytes]:
    op = rng.choice(["truncate", "flip", "splice", "zero", "extend", "dup"])
    b = bytearray(raw)
    if op == "truncate":
        return op, raw[:rng.randrange(len(raw) + 1)]
    if op == "flip":
        for _ in range(rng.choice([1, 1, 2, 8])):
            if b:
                i = rng.randrange(len(b))
                b[i] ^= 1 << rng.randrange(8)
        return op, bytes(b)
    if op == "splice":
        i, j = sorted(rng.randrange(len(raw) + 1) for _ in range(2))
        k = rng.randrange(len(donor) + 1)
        return op, raw[:i] + donor[k:k + rng.randrange(64)] + raw[j:]
    if op == "zero":
        i = rng.randrange(len(raw) + 1)
        return op, raw[:i] + bytes(rng.randrange(1, 64)) + raw[i + rng.randrange(64):]
    if op == "extend":
        return op, raw + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
    i = rng.randrange(len(raw) + 1)
    return op, raw[:i] + raw[i:i + rng.randrange(128)] * 2 + raw[i + 128:]


def _poke(rng: random.Random, node):
    """Replace, delete or add one value somewhere in a JSON document."""
    if isinstance(node, dict) and node:
        key = rng.choice(list(node))
        r = rng.random()
        if r < 0.2:
            del node[key]
        elif r < 0.5 or not isinstance(node[key], (dict, list)):
            node[key] = rng.choice(ODD_VALUES)
        else:
            _poke(rng, node[key])
        return node
    if isinstance(node, list) and node:
        i = rng.randrange(len(node))
        if rng.random() < 0.5 or not isinstance(node[i], (dict, list)):
            node[i] = rng.choice(ODD_VALUES)
        else:
            _poke(rng, node[i])
        return node
    return rng.choice(ODD_VALUES)


def _rewrite_json(rng, raw: bytes) -> tuple[str, bytes]:
    doc = json.loads(raw)
    doc = _poke(rng, doc)
    return "json", json.dumps(doc, allow_nan=True).encode()


def _rewrite_header(rng, raw: bytes) -> tuple[str, bytes]:
    """Edit the safetensors JSON header (dtype, shape, offsets, names) and re-frame it."""
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    what = rng.choice(["dtype", "shape", "offsets", "rename", "drop", "metadata", "length"])
    if what == "dtype":
        header[name]["dtype"] = rng.choice(["F16", "BF16", "F64", "I64", "U8", "BOOL", "F8_E4M3", "Q", 7])
    elif what == "shape":
        header[name]["shape"] = rng.choice([[], [0], [1], [2**40, 2**40], [-1], [3, 5], "x",
                                            header[name]["shape"][::-1]])
    elif what == "offsets":
        a, b = header[name]["data_offsets"]
        header[name]["data_offsets"] = rng.choice([[b, a], [a, a], [0, 2**62], [a, b + 4], [a + 1, b],
                                                   [-1, b], None])
    elif what == "rename":
        header[name + ".x"] = header.pop(name)
    elif what == "drop":
        del header[name]
    elif what == "metadata":
        header["__metadata__"] = rng.choice([{"a": 1}, [1], "x", {"a": "b"}])
    body = json.dumps(header).encode()
    if what == "length":
        return "header-length", struct.pack("<Q", rng.choice([0, 1, n - 1, n + 1, 2**63, 2**64 - 1])) + raw[8:]
    return "header-" + what, struct.pack("<Q", len(body)) + body + raw[8 + n:]


def _one_line_checkpoint_error(fn, *args, **kw):
    try:
        fn(*args, **kw)
        return "ok"
    except CheckpointError as e:
        assert "\n" not in str(e) and str(e), repr(e)
        return "refused"


def test_fuzz_checkpoint_loading(good_checkpoint, tmp_path):
    rng = random.Random(20260425)
    originals = {name: (good_checkpoint / name).read_bytes() for name in FILES}
    counts = collections.Counter()
    crashes = []
    t0 = time.perf_counter()
    for i in range(N_MUTANTS):
        d = tmp_path / f"m{i % 4}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(good_checkpoint, d)
        name = rng.choice(FILES)
        raw = originals[name]
        donor = originals[rng.choice(FILES)]
        r = rng.random()
        if name.endswith(".json") and r < 0.5:
            op, mutant = _rewrite_json(rng, raw)
        elif name.endswith(".safetensors") and r < 0.5:
            op, mutant = _rewrite_header(rng, raw)
        else:
            op, mutant = _mutate_bytes(rng, raw, donor)
        (d / name).write_bytes(mutant)
        sealed = name != ckpt.MANIFEST and rng.random() < 0.5
        if sealed:
            _reseal(d)
        kind = f"{name}:{op}{':sealed' if sealed else ''}"
        counts["tried"] += 1
        if os.environ.get("ZLM_FUZZ_TRACE"):
            print(i, kind, flush=True)
        try:
            outcomes = (_one_line_checkpoint_error(ckpt.verify, d),
                        _one_line_checkpoint_error(ckpt.read_tensors, d / "model.safetensors"),
                        _one_line_checkpoint_error(inference.load, d, device="cpu"))
        except AssertionError as e:
            crashes.append((i, kind, f"multi-line message: {e}"))
            continue
        except Exception as e:  # anything but CheckpointError is a bug
            crashes.append((i, kind, f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        counts["loaded" if outcomes[2] == "ok" else "refused"] += 1
        counts[f"{name}:{'sealed' if sealed else 'unsealed'}"] += 1
    elapsed = time.perf_counter() - t0
    by_kind = collections.Counter(k for _, k, _ in crashes)
    print(f"\nfuzz: {counts['tried']} mutants in {elapsed:.0f}s: {counts['refused']} refused, "
          f"{counts['loaded']} loaded (harmless mutations), {len(crashes)} crashes")
    print("per file:", {k: v for k, v in sorted(counts.items()) if ":" in k})
    for i, kind, err in crashes[:40]:
        print(f"  #{i} {kind}: {err}")
    print("crash kinds:", dict(by_kind))
    assert counts["tried"] >= min(N_MUTANTS, 2000)
    assert not crashes, f"{len(crashes)} mutants raised something other than CheckpointError"

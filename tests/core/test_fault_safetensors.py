"""Malformed checkpoint files are refused with one line, fast, in bounded memory, running nothing."""

from __future__ import annotations

import json
import pickle
import random
import resource
import struct
import time

import pytest
import torch
from safetensors.torch import save_file

from zlm.core import checkpoint as ckpt
from zlm.core.checkpoint import load_weights
from zlm.errors import CheckpointError
from zlm.model.lm import ModelConfig, ZoneoutLM


@pytest.fixture
def good(tmp_path):
    torch.manual_seed(0)
    model = ZoneoutLM(ModelConfig(vocab_size=20, hidden=16, embed=4))
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return model, path


def _refused(path) -> str:
    # Fast: measured as this thread's CPU time, not wall-clock, so a loaded machine does
    # not change it. A refusal costs under 0.3 ms of CPU here; the bound is far above that
    # and far below what reading or parsing the gigabytes a hostile header may declare
    # would cost. A hang is pytest-timeout's to catch.
    t0 = time.thread_time()
    with pytest.raises(CheckpointError) as e:
        ckpt.read_tensors(path)
    assert time.thread_time() - t0 < 0.5
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_truncated_at_many_lengths(good, tmp_path):
    _, path = good
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    lengths = sorted(set(range(0, 9)) | {9, 20, n // 2, n + 7} | set(range(n + 8, len(raw), 97)))
    bad = tmp_path / "cut.safetensors"
    for length in lengths:
        bad.write_bytes(raw[:length])
        _refused(bad)
    assert len(lengths) > 40


def test_random_byte_flips_never_crash_and_the_manifest_catches_all(good, tmp_path):
    model, path = good
    raw = path.read_bytes()
    ck = tmp_path / "ck"
    rng = random.Random(7)
    outcomes = {"refused": 0, "loaded": 0}
    for i in range(150):
        flipped = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(raw)) if i % 2 else rng.randrange(min(len(raw), 400))
            flipped[pos] ^= 1 << rng.randrange(8)
        tmp = ckpt.temp_directory(ck)
        (tmp / "model.safetensors").write_bytes(raw)
        ckpt.finish_directory(tmp, ck)  # manifest of the good file...
        (ck / "model.safetensors").write_bytes(bytes(flipped))  # ...then the bits rot
        try:
            ckpt.read_tensors(ck / "model.safetensors")  # the parser alone: any outcome but a crash
            outcomes["loaded"] += 1
        except CheckpointError:
            outcomes["refused"] += 1
        with pytest.raises(CheckpointError, match="checksum|truncated"):
            ckpt.verify(ck)
    assert outcomes["refused"] > 0


def test_huge_declared_header_is_refused_without_allocating(tmp_path):
    path = tmp_path / "huge.safetensors"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for n in (2**63 - 1, 2**40, 10**9):
        path.write_bytes(struct.pack("<Q", n) + b"{}")
        assert "header" in _refused(path)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 50


def _with_header(path, header: dict, data: bytes):
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def test_offsets_past_the_end_and_bad_dtypes(tmp_path):
    path = tmp_path / "x.safetensors"
    _with_header(path, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1600]}}, b"\0" * 16)
    _refused(path)
    _with_header(path, {"w": {"dtype": "F32", "shape": [400], "data_offsets": [0, 16]}}, b"\0" * 16)
    _refused(path)
    _with_header(path, {"w": {"dtype": "Q99", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16)
    _refused(path)
    _with_header(path, [1, 2, 3], b"")  # a header that is not an object
    _refused(path)


def test_shape_dtype_missing_and_extra_tensors_are_named(good):
    model, _ = good
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    cases = [
        ({**sd, "decoder.weight": sd["decoder.weight"][:, :3]}, "decoder.weight"),
        ({**sd, "decoder.bias": sd["decoder.bias"].double()}, "decoder.bias"),
        ({k: v for k, v in sd.items() if k != "embedding.weight"}, "embedding.weight"),
        ({**sd, "surprise": torch.zeros(1)}, "surprise"),
    ]
    for tensors, name in cases:
        with pytest.raises(CheckpointError, match=name) as e:
            load_weights(model, tensors, "ck")
        assert "\n" not in str(e.value)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # would create the marker file if unpickled


def test_a_pickle_renamed_to_safetensors_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "model.safetensors"
    path.write_bytes(pickle.dumps({"w": _Payload(str(marker))}))
    _refused(path)
    torch_zip = tmp_path / "torch.safetensors"
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:  # the shape of a torch.save file
        z.writestr("archive/data.pkl", pickle.dumps({"w": _Payload(str(marker))}))
    torch_zip.write_bytes(buf.getvalue())
    _refused(torch_zip)
    assert not marker.exists()

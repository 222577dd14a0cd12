"""`zlm compress` / `zlm decompress` and `zlm eval --dynamic` in-process, on a tiny trained run."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from conftest import shakespeare_text, train_run, write_char_dataset
from zlm.cli import app
from zlm.core.config import TrainConfig
from zlm.data.dataset import Dataset
from zlm.model.lm import ModelConfig

runner = CliRunner()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cz")
    data = Dataset.open(write_char_dataset(root / "data", shakespeare_text(20_000)))
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    for seed in (1, 2):
        train_run(root / f"run{seed}", data, ModelConfig(vocab_size=data.vocab_size, hidden=16, embed=8),
              TrainConfig(batch_size=4, bptt=20, max_steps=2, eval_every=2, log_every=100, seed=seed))
        out.append(root / f"run{seed}")
    yield out
    torch.set_num_threads(n)


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


# Bytes that are not UTF-8: a lone continuation byte, bytes UTF-8 never uses, a NUL, a lead
# byte followed by ASCII, and a sequence cut short at the end of the file.
NOT_UTF8 = b"\x80 \xff\xfe \x00 \xc3( \xed\xa0\x80 " + "\u00e9".encode()[:1]


def test_roundtrip_and_json(runs, tmp_path):
    src = tmp_path / "in.txt"
    src.write_bytes(shakespeare_text(1200).encode() + "\u00e9\U0001F600\xff".encode() + NOT_UTF8)
    with pytest.raises(UnicodeDecodeError):
        src.read_bytes().decode("utf-8")  # the file is not UTF-8: every byte must come back
    res = invoke("compress", runs[0], src, "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    for key in ("original_bytes", "compressed_bytes", "bits_per_char", "bits_per_byte", "seconds",
                "kb_per_s", "model_bits_per_char", "streams"):
        assert key in out
    z = tmp_path / "in.txt.zlmz"
    assert out["output"] == str(z) and z.stat().st_size == out["compressed_bytes"]
    res = invoke("decompress", runs[0], z, "-o", tmp_path / "back.txt")
    assert res.exit_code == 0, res.output
    assert "bits per byte" in res.stdout and "KB/s" in res.stdout
    assert (tmp_path / "back.txt").read_bytes() == src.read_bytes()
    res = invoke("compress", runs[0], src, "--adapt", "--segment", "40", "-o", tmp_path / "a.zlmz")
    assert res.exit_code == 0, res.output
    res = invoke("decompress", runs[0], tmp_path / "a.zlmz", "-o", tmp_path / "a.txt", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["adapt"]["segment"] == 40
    assert (tmp_path / "a.txt").read_bytes() == src.read_bytes()


def test_any_bytes_round_trip(runs, tmp_path):
    """`zlm compress` takes any file: binary data (every byte value, no UTF-8 structure)
    comes back byte for byte, with and without --adapt."""
    data = bytes(range(256)) + bytes(random.Random(5).randrange(256) for _ in range(700))
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    for extra in ([], ["--adapt", "--segment", "40"]):
        z = tmp_path / "blob.zlmz"
        res = invoke("compress", runs[0], src, "-o", z, "--force", "--json", *extra)
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["original_bytes"] == len(data)
        res = invoke("decompress", runs[0], z, "-o", tmp_path / "back.bin", "--force")
        assert res.exit_code == 0, res.output
        assert (tmp_path / "back.bin").read_bytes() == data


def test_random_bytes_do_not_grow_beyond_the_header(runs, tmp_path):
    """Bytes the model cannot shrink are stored: the file is the input plus a small header."""
    data = random.Random(9).randbytes(5000)
    src = tmp_path / "noise.bin"
    src.write_bytes(data)
    res = invoke("compress", runs[0], src, "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["stored_blocks"] == out["blocks"] >= 1
    assert len(data) < out["compressed_bytes"] <= len(data) + 40
    res = invoke("compress", runs[0], src, "-o", tmp_path / "n2.zlmz")
    assert res.exit_code == 0 and "all stored" in res.stdout, res.output
    res = invoke("decompress", runs[0], tmp_path / "noise.bin.zlmz", "-o", tmp_path / "back.bin")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "back.bin").read_bytes() == data


def test_refusals_are_one_line_and_write_nothing(runs, tmp_path):
    src = tmp_path / "in.txt"
    src.write_bytes(shakespeare_text(1500).encode())
    z = tmp_path / "in.zlmz"
    assert invoke("compress", runs[0], src, "-o", z).exit_code == 0
    blob = z.read_bytes()
    bad = {"trunc.zlmz": blob[: len(blob) - 40], "dmg.zlmz": blob[:-30] + bytes((blob[-30] ^ 4,)) + blob[-29:],
           "v1.zlmz": b"ZLMZ\x01\x00" + blob[6:]}  # the older format's version byte
    for name, data in bad.items():
        (tmp_path / name).write_bytes(data)
    for run, name, expect in ((runs[0], "trunc.zlmz", "truncated"), (runs[0], "dmg.zlmz", "damaged"),
                              (runs[1], "in.zlmz", "different model"),
                              (runs[0], "v1.zlmz", "format version 1")):
        target = tmp_path / (name + ".out")
        res = invoke("decompress", run, tmp_path / name, "-o", target)
        assert res.exit_code == 1, res.output
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], res.output
        assert not target.exists()
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_usage_errors(runs, tmp_path):
    res = invoke("compress", runs[0], tmp_path / "missing.txt")
    assert res.exit_code == 2 and "does not exist" in res.output
    (tmp_path / "folder").mkdir()
    for cmd in ("compress", "decompress"):
        res = invoke(cmd, runs[0], tmp_path / "folder")
        assert res.exit_code == 2 and "is a directory; pass a file" in res.output, res.output
    src = tmp_path / "x.txt"
    src.write_text("abc")
    (tmp_path / "x.txt.zlmz").write_text("old")
    res = invoke("compress", runs[0], src)
    assert res.exit_code == 2 and "--force" in res.output
    assert invoke("compress", runs[0], src, "--force").exit_code == 0
    res = invoke("compress", runs[0], src, "-f", "--streams", "0")
    assert res.exit_code == 2 and "--streams" in res.output


@pytest.mark.slow
def test_decodes_in_another_process_with_other_thread_settings(runs, tmp_path):
    """The coder fixes its own thread count: a file compressed by a separate process whose
    torch defaults to 2 threads decodes here, bit for bit."""
    src = tmp_path / "in.txt"
    src.write_bytes(shakespeare_text(4000).encode())
    env = {**os.environ, "OMP_NUM_THREADS": "2", "NO_COLOR": "1"}
    done = subprocess.run([sys.executable, "-m", "zlm", "compress", str(runs[0]), str(src), "--adapt",
                           "--segment", "32", "-o", str(tmp_path / "p.zlmz")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    res = invoke("decompress", runs[0], tmp_path / "p.zlmz", "-o", tmp_path / "p.txt")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "p.txt").read_bytes() == src.read_bytes()


def test_eval_dynamic_json_and_table(runs):
    run = runs[0]
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (run / "best").iterdir()}
    res = runner.invoke(app, ["eval", str(run), "--dynamic", "--segment", "50", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["protocol"].startswith("1 parallel streams")
    res = runner.invoke(app, ["eval", str(run), "--dynamic", "--segment", "50", "--batch-size", "4", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["static_bpc"] > 0 and out["bpc"] > 0 and out["dynamic"]["segment"] == 50
    assert "dynamic evaluation" in out["protocol"]
    res = runner.invoke(app, ["eval", str(run), "--dynamic", "--split", "test"])
    assert res.exit_code == 0 and "static BPC" in res.stdout and "(dynamic)" in res.stdout
    res = runner.invoke(app, ["eval", str(run), "--dynamic", "--segment", "0"])
    assert res.exit_code == 2 and "--segment" in res.output
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (run / "best").iterdir()}
    assert after == digest

"""`zlm eval`, `zlm sample`, `zlm info` in-process, and their one-line errors."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from typer.testing import CliRunner

from conftest import shakespeare_text, train_run, write_char_dataset
from zlm.cli import app
from zlm.core.config import TrainConfig
from zlm.data.dataset import Dataset
from zlm.model.lm import ModelConfig

runner = CliRunner()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    data = Dataset.open(write_char_dataset(root / "data", shakespeare_text(30_000)))
    train_run(root / "run", data, ModelConfig(vocab_size=data.vocab_size, hidden=32, embed=8),
          TrainConfig(batch_size=4, bptt=20, max_steps=10, eval_every=10, log_every=100))
    return root / "run"


def ok(*args):
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res


def test_eval_json_and_text(run, tmp_path):
    out = json.loads(ok("eval", run, "--json").stdout)
    for key in ("bpc", "bits_per_byte", "perplexity", "char_perplexity", "tokens", "characters",
                "protocol", "chars_per_s", "split", "checkpoint"):
        assert key in out
    assert out["split"] == "valid" and "16 parallel streams" in out["protocol"]
    test = json.loads(ok("eval", run, "--split", "test", "--batch-size", "3", "--json").stdout)
    assert test["split"] == "test" and test["protocol"].startswith("3 parallel streams")
    text = ok("eval", run).stdout
    assert "BPC:" in text and "protocol:" in text and "characters/s" in text
    assert "bits per byte" not in text  # ASCII text: the same as BPC, so not repeated
    f = tmp_path / "t.txt"
    f.write_text("First Citizen:\nSpeak, speak.\n", encoding="utf-8")
    out = json.loads(ok("eval", run, "--file", f, "--json").stdout)
    assert out["file"] == str(f) and out["characters"] == 29


def test_eval_usage_errors(run, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("abc", encoding="utf-8")
    res = runner.invoke(app, ["eval", str(run), "--split", "valid", "--file", str(f)])
    assert res.exit_code == 2 and "not both" in res.output
    res = runner.invoke(app, ["eval", str(run), "--batch-size", "0"])
    assert res.exit_code == 2 and "--batch-size" in res.output
    f.write_text("abc\u20acd", encoding="utf-8")
    res = runner.invoke(app, ["eval", str(run), "--file", str(f)])
    assert res.exit_code == 1 and "'€' (U+20AC) at character 3" in res.output
    res = runner.invoke(app, ["eval", str(run), "--eval-tokens", "-1"])
    assert res.exit_code == 2 and "--eval-tokens must be >= 0" in res.output
    res = runner.invoke(app, ["eval", str(run), "--dynamic", "--eval-tokens", "100"])
    assert res.exit_code == 2 and "drop --eval-tokens" in res.output


def test_eval_on_a_sample(run):
    """--eval-tokens N: each stream scores the first N/S predictions of its stretch; N at
    least the split's predictions scores all of it, as without the option."""
    whole = json.loads(ok("eval", run, "--batch-size", "4", "--json").stdout)
    assert whole["tokens"] > 400
    part = json.loads(ok("eval", run, "--batch-size", "4", "--eval-tokens", "400", "--json").stdout)
    assert part["tokens"] == 400 and part["bpc"] != whole["bpc"] and "--eval-tokens 400" in part["protocol"]
    assert part["characters"] < whole["characters"]
    every = json.loads(ok("eval", run, "--batch-size", "4", "--eval-tokens", str(10 * whole["tokens"]),
                          "--json").stdout)
    assert every["tokens"] == whole["tokens"] and every["bpc"] == whole["bpc"]


def test_eval_with_the_cache(run, tmp_path):
    """--cache: BPC is the cached score, the static one beside it over the same streams
    (from the same pass: its per-token sums in float64, where plain eval sums each window
    in fp32); the settings are in the JSON and the protocol; a text file takes it too."""
    plain = json.loads(ok("eval", run, "--batch-size", "4", "--json").stdout)
    out = json.loads(ok("eval", run, "--batch-size", "4", "--cache", "--json").stdout)
    assert out["static_bpc"] == pytest.approx(plain["bpc"], rel=1e-6) and out["bpc"] != plain["bpc"]
    assert out["cache"] == {"size": 2000, "theta": 0.5, "mix": None} and out["dynamic"] is None
    assert "continuous cache" in out["protocol"] and out["tokens"] == plain["tokens"]
    fixed = json.loads(ok("eval", run, "--batch-size", "4", "--cache", "--cache-lambda", "0",
                          "--json").stdout)
    assert fixed["bpc"] == pytest.approx(plain["bpc"], rel=1e-6) and fixed["cache"]["mix"] == 0
    text = ok("eval", run, "--cache", "--cache-size", "100").stdout
    assert "(with the cache)" in text and "the cache gains" in text
    assert "protocol: 1 parallel streams" in text  # --cache, like --dynamic: one stream by default
    f = tmp_path / "t.txt"
    f.write_text("First Citizen:\nSpeak, speak.\n" * 3, encoding="utf-8")
    out = json.loads(ok("eval", run, "--file", f, "--cache", "--json").stdout)
    assert out["characters"] == 87 and out["bpc"] < out["static_bpc"]
    both = json.loads(ok("eval", run, "--cache", "--dynamic", "--json").stdout)
    alone = json.loads(ok("eval", run, "--dynamic", "--json").stdout)
    assert both["dynamic"] == alone["dynamic"] and both["cache"]["size"] == 2000
    assert both["static_bpc"] == alone["static_bpc"] and both["bpc"] != alone["bpc"]
    assert "dynamic evaluation" in both["protocol"] and "continuous cache" in both["protocol"]
    for args, message in ((["--cache", "--cache-lambda", "1"], "--cache-lambda must be in [0, 1)"),
                          (["--cache", "--cache-size", "0"], "--cache-size must be >= 1")):
        res = runner.invoke(app, ["eval", str(run), *args])
        assert res.exit_code == 2 and message in res.output, res.output


def test_sample_streams_and_repeats(run):
    a = ok("sample", run, "--prime", "ROMEO:", "--length", "50", "--seed", "7").stdout
    b = ok("sample", run, "--prime", "ROMEO:", "--length", "50", "--seed", "7").stdout
    assert a == b and a.startswith("ROMEO:") and len(a) == len("ROMEO:") + 50 + 1
    greedy = ok("sample", run, "--length", "20", "--temperature", "0").stdout
    assert greedy == ok("sample", run, "--length", "20", "--temperature", "0").stdout
    lines = ok("sample", run, "--length", "30", "--num-samples", "3", "--seed", "1", "--json",
               "--top-k", "10", "--top-p", "0.9").stdout.splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["index"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["tokens"] == 30 and len(r["text"]) == 30 and r["seed"] == 1
        assert r["log_likelihood_nats_per_token"] < 0 < r["bits_per_char"]
    several = ok("sample", run, "--length", "10", "--num-samples", "2", "--seed", "1").stdout
    assert several.count("--- sample ") == 2


def test_sample_prime_outside_vocabulary(run):
    res = runner.invoke(app, ["sample", str(run), "--prime", "caf\u00e9"])
    assert res.exit_code == 2 and "--prime: character '\u00e9'" in res.output


def test_info_text_and_json(run):
    info = json.loads(ok("info", run, "--json").stdout)
    assert info["parameters"] > 0 and info["step"] == 10
    text = ok("info", run).stdout
    assert "parameters:" in text and "best valid BPC:" in text and "model.safetensors" in text


# ------------------------------------------------------------------ corrupt inputs


def _rewrite_manifest(ck):
    manifest = json.loads((ck / "checkpoint.json").read_text())
    for name in manifest["files"]:
        raw = (ck / name).read_bytes()
        manifest["files"][name] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (ck / "checkpoint.json").write_text(json.dumps(manifest))


def _truncated(ck):
    p = ck / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])


def _truncated_manifest_rewritten(ck):
    _truncated(ck)
    _rewrite_manifest(ck)


def _config_mismatch(ck):  # same size: only the checksum can tell
    text = (ck / "config.json").read_text()
    assert '"hidden": 32' in text
    (ck / "config.json").write_text(text.replace('"hidden": 32', '"hidden": 48'))


def _config_mismatch_manifest_rewritten(ck):
    _config_mismatch(ck)
    _rewrite_manifest(ck)


def _not_a_checkpoint(ck):
    shutil.rmtree(ck)
    ck.mkdir()
    (ck / "notes.txt").write_text("hello")


def _newer_version(ck):
    manifest = json.loads((ck / "checkpoint.json").read_text())
    manifest["version"] = 99
    (ck / "checkpoint.json").write_text(json.dumps(manifest))


def _garbage_config(ck):
    (ck / "config.json").write_text("{not json")
    _rewrite_manifest(ck)


CASES = {
    "truncated": (_truncated, "truncated"),
    "truncated-rewritten": (_truncated_manifest_rewritten, "safetensors"),
    "config-mismatch": (_config_mismatch, "checksum"),
    "config-mismatch-rewritten": (_config_mismatch_manifest_rewritten, "config implies"),
    "not-a-checkpoint": (_not_a_checkpoint, "no complete checkpoint"),
    "newer-version": (_newer_version, "version 99"),
    "garbage-config": (_garbage_config, "config.json"),
}


@pytest.mark.parametrize("command", ["eval", "sample", "info"])
@pytest.mark.parametrize("case", list(CASES))
def test_corrupt_checkpoints_are_one_line_errors(run, tmp_path, command, case):
    damage, words = CASES[case]
    ck = tmp_path / "ck"
    shutil.copytree(run / "best", ck)
    damage(ck)
    if command == "info" and case in ("config-mismatch", "config-mismatch-rewritten",
                                      "truncated-rewritten"):
        # info checks no checksums and loads no tensors: it shows the checkpoint as it is,
        # with the shapes' mismatch as a warning.
        res = runner.invoke(app, ["info", str(ck)])
        assert res.exit_code == 0 and "Traceback" not in res.output, res.output
        assert res.output.startswith("checkpoint: ") and "model.safetensors" in res.output
        mismatch = case.startswith("config-mismatch")
        assert ("WARNING: tensors do not match config.json" in res.output) == mismatch, res.output
        assert ("config implies (58, 48)" in res.output) == mismatch, res.output
        return
    res = runner.invoke(app, [command, str(ck), "--length", "5"] if command == "sample"
                        else [command, str(ck)])
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and len(res.output.strip().splitlines()) == 1, res.output
    assert words in errors[0], errors[0]


def test_missing_training_data_suggests_file(run, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(run / "best", ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["data"]["path"] = str(tmp_path / "gone")
    (ck / "config.json").write_text(json.dumps(cfg))
    _rewrite_manifest(ck)
    res = runner.invoke(app, ["eval", str(ck)])
    assert res.exit_code == 1 and "--file" in res.output and "Traceback" not in res.output


def test_eval_file_that_is_missing_or_a_folder(run, tmp_path):
    for path, words in ((tmp_path / "nope.txt", "does not exist"), (tmp_path, "is a directory")):
        res = runner.invoke(app, ["eval", str(run), "--file", str(path)])
        assert res.exit_code == 2 and f"--file {path} {words}; pass a UTF-8 text file" in res.output, res.output

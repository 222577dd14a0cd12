"""`zlm bench` at tiny sizes: every implementation and phase is measured and reported.

Never asserts wall-clock times or ratios, only the structure of what is reported.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner
from zlm.cli import app

from zlm.bench import IMPLS, BenchConfig, grid_configs, measure, run_bench
from zlm.errors import UsageError

TINY = ["--hidden", "8", "--batch-size", "2", "--bptt", "3", "--vocab", "5",
        "--repeats", "2", "--warmup", "1"]  # fmt: skip


def test_measure_rows_cover_every_impl_and_phase():
    cfg = BenchConfig(hidden=8, batch_size=2, bptt=3, vocab=5, repeats=2, warmup=1)
    rows = measure(cfg)
    assert {(r["impl"], r["phase"]) for r in rows} == {(i, p) for i in IMPLS for p in ("train", "infer")}
    for r in rows:
        assert r["chars_per_s"] > 0 and r["ratio_to_lstm"] > 0
        assert (r["hidden"], r["batch_size"], r["bptt"], r["vocab"]) == (8, 2, 3, 5)
    assert all(r["ratio_to_lstm"] == 1.0 for r in rows if r["impl"] == "nn.LSTM")


def test_cli_json_structure():
    result = CliRunner().invoke(app, ["bench", *TINY, "--sample", "--sample-chars", "10", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["device"] == "cpu" and data["threads"] >= 1 and "fused_cell" in data
    phases = {(r["impl"], r["phase"]) for r in data["rows"]}
    assert phases == {(i, p) for i in IMPLS for p in ("train", "infer", "sample")}
    for r in data["rows"]:
        assert set(r) >= {"impl", "phase", "hidden", "batch_size", "bptt", "chars_per_s", "ratio_to_lstm"}
    assert all(r["batch_size"] == 1 for r in data["rows"] if r["phase"] == "sample")


def test_cli_plain_table_names_every_impl():
    result = CliRunner().invoke(app, ["bench", *TINY])
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("B=2 H=8 T=3")]
    assert len(lines) == 2  # train, infer
    for impl in IMPLS:
        assert impl in lines[0]


def test_grid_is_the_standard_one():
    sizes = [(c.batch_size, c.hidden, c.bptt) for c in grid_configs(BenchConfig(vocab=7))]
    assert sizes == [(b, h, 100) for b in (32, 128) for h in (256, 512, 1000)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_gpu_is_one_line_error():
    with pytest.raises(UsageError, match="--device cuda"):
        run_bench(BenchConfig(device="cuda"))
    result = CliRunner().invoke(app, ["bench", *TINY, "--device", "cuda"])
    assert result.exit_code == 2
    assert "--device cuda" in result.output and "Traceback" not in result.output


def test_bad_option_is_usage_error():
    result = CliRunner().invoke(app, ["bench", "--hidden", "0"])
    assert result.exit_code == 2 and "--hidden" in result.output

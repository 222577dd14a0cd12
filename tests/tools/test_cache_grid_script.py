"""scripts/cache-grid: every cell of its grid is the BPC `zlm eval --cache` reports for
the same settings (docs/inference.md, "The continuous cache")."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from conftest import run_script, shakespeare_text, train_run, write_char_dataset
from zlm.cli import app
from zlm.core.config import TrainConfig
from zlm.data.dataset import Dataset
from zlm.model.lm import ModelConfig


def zlm_eval(run, *args) -> dict:
    res = CliRunner().invoke(app, ["eval", str(run), "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_each_cell_is_what_zlm_eval_reports(tmp_path):
    data = Dataset.open(write_char_dataset(tmp_path / "data", shakespeare_text(40_000)))
    run = tmp_path / "run"
    train_run(run, data, ModelConfig(vocab_size=data.vocab_size, hidden=16, embed=8),
              TrainConfig(batch_size=4, bptt=16, max_steps=10, eval_every=10, log_every=100))
    out = run_script("cache-grid", run, "--sizes", "60", "--thetas", "0.5,2", "--rates", "0.03", "--lambdas",
                     "0.1,0.3", timeout=300)
    rows = [line for line in out.splitlines() if line.startswith("size ")]
    assert len(rows) == 2
    for row, theta in zip(rows, ("0.5", "2"), strict=True):
        static, lam1, lam3, switching = map(float, re.findall(r"\d+\.\d{4}", row))
        assert row.startswith(f"size 60 theta {theta}:")
        cached = zlm_eval(run, "--cache", "--batch-size", "16", "--cache-size", "60", "--cache-theta", theta)
        assert switching == pytest.approx(cached["bpc"], abs=1e-4)
        assert static == pytest.approx(cached["static_bpc"], abs=1e-4)
        fixed = zlm_eval(run, "--cache", "--batch-size", "16", "--cache-size", "60", "--cache-theta", theta,
                         "--cache-lambda", "0.3")
        assert lam3 == pytest.approx(fixed["bpc"], abs=1e-4) and lam1 != lam3

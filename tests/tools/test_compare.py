"""`zlm compare`: only the settings that differ, the results of every run, --json."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from test_plot import write_fake_run
from typer.testing import CliRunner

from zlm.cli import app
from zlm.cli.compare import rich_table
from zlm.tools.compare import compare_runs, differing, flatten

runner = CliRunner()


@pytest.fixture
def runs(tmp_path):
    return [
        write_fake_run(tmp_path / "plain", zc=0.0, zh=0.0, results={"valid_bpc": 1.9, "test_bpc": 2.05}),
        write_fake_run(tmp_path / "zoneout", zc=0.5, zh=0.05),
        write_fake_run(tmp_path / "zc-only", zc=0.5, zh=0.0, steps=300),
    ]


def test_flatten_and_differing():
    assert flatten({"train": {"schedule": {"kind": "x"}, "lr": 1}}) == \
        {"train.schedule.kind": "x", "train.lr": 1}
    a = {"model": {"hidden": 8, "zoneout_cell": 0.5}, "train": {"lr": 1, "device": "cpu"}}
    b = {"model": {"hidden": 8, "zoneout_cell": 0.0}, "train": {"lr": 1, "device": "cuda"}}
    assert differing([a, b]) == ["model.zoneout_cell"]  # device is never a column
    assert differing([a, {**b, "train": {}}]) == ["model.zoneout_cell", "train.lr"]


def test_rows_hold_only_differing_settings_and_results(runs):
    c = compare_runs(runs)
    assert c.settings == ["zoneout_cell", "zoneout_hidden", "max_steps"]
    plain, zoneout, zc = c.rows
    assert [r["run"] for r in c.rows] == ["plain", "zoneout", "zc-only"]
    assert plain["zoneout_cell"] == 0.0 and zoneout["zoneout_hidden"] == 0.05
    assert plain["test_bpc"] == 2.05 and zoneout["test_bpc"] is None  # results.json or nothing
    assert plain["best_valid_bpc"] == pytest.approx(min(
        1.8 + 4.0 * 2.718281828 ** (-s / 40) for s in (50, 100, 150, 200)), rel=1e-6)
    assert zc["train_time_s"] == 30.0 and zoneout["train_time_s"] == 20.0
    assert zoneout["chars_per_s"] == 1105.0  # median of 1010, 1020, ... 1200
    assert plain["parameters"] == 4 * 64 * 80


def test_table_lists_every_run(runs):
    res = runner.invoke(app, ["compare", *map(str, runs)])
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 4
    header = lines[0].split("\t")
    assert header[:4] == ["run", "z_c", "z_h", "max steps"]
    assert "hidden" not in header and "lr" not in header  # equal across runs
    for line, name in zip(lines[1:], ["plain", "zoneout", "zc-only"], strict=True):
        assert line.split("\t")[0] == name
    assert "2.0500" in lines[1] and lines[2].split("\t")[header.index("test BPC")] == "-"


def test_rich_table_lists_every_run(runs):
    buf = io.StringIO()
    Console(file=buf, width=160).print(rich_table(compare_runs(runs)))
    text = buf.getvalue()
    assert all(n in text for n in ("plain", "zoneout", "zc-only", "best valid BPC", "2.0500"))


def test_json(runs):
    res = runner.invoke(app, ["compare", *map(str, runs), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["settings"] == ["zoneout_cell", "zoneout_hidden", "max_steps"]
    assert [r["run"] for r in doc["runs"]] == ["plain", "zoneout", "zc-only"]
    assert set(doc["runs"][0]) >= {"best_valid_bpc", "test_bpc", "parameters", "chars_per_s",
                                   "train_time_s", "path"}


def test_same_names_are_told_apart(tmp_path):
    a = write_fake_run(tmp_path / "a" / "run")
    b = write_fake_run(tmp_path / "b" / "run", hidden=32)
    c = compare_runs([a, b])
    assert [r["run"] for r in c.rows] == ["a/run", "b/run"] and c.settings == ["hidden"]


def test_what_auto_resolved_to_is_a_setting_too(tmp_path):
    """Two runs of the same options on machines that resolved them differently (precision
    auto: bf16 on one, fp32 on the other; AMX's recurrent product against none recorded)."""
    a = write_fake_run(tmp_path / "a", resolved=("bf16", "fused", "compiled", "", "amx"))
    b = write_fake_run(tmp_path / "b", resolved=("fp32", "fused", "compiled"))
    c = compare_runs([a, b])
    assert c.settings == ["precision", "product"]
    assert [(r["precision"], r["product"]) for r in c.rows] == [("bf16", "amx"), ("fp32", None)]
    # The name under train and resolved both: kept whole.
    assert differing([{"train": {"precision": "auto"}, "resolved": {"precision": "bf16"}},
                      {"train": {"precision": "fp32"}, "resolved": {"precision": "fp32"}}]) == \
        ["train.precision", "resolved.precision"]


def test_not_a_run_is_one_line(tmp_path, runs):
    res = runner.invoke(app, ["compare", str(runs[0]), str(tmp_path / "missing")])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert "missing is not a run directory" in res.output

"""`zlm recipe zoneout-ablation` and `zlm recipe equal-budget` end to end at tiny sizes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import shakespeare_text
from zlm.cli import app
from zlm.core.metrics import read_metrics
from zlm.tools.curves import read_run
from zlm.tools.recipes import ABLATION, RecipeConfig, overfit_note, zoneout_ablation

runner = CliRunner()
TINY = ["--hidden", "16", "--embed", "8", "--batch-size", "4", "--bptt", "16",
        "--eval-every", "2", "--log-every", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "shakespeare.txt"
    path.write_text(shakespeare_text(60_000), encoding="utf-8")
    return path


def invoke(*args):
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res


def test_ablation_end_to_end_equal_characters(corpus, tmp_path):
    out = tmp_path / "ablation"
    res = invoke("recipe", "zoneout-ablation", "--corpus", corpus, "--out", out,
                 "--minutes", "0.02", *TINY)
    for name in ("results.json", "results.md", "curves.png", "plan.json", "data/dataset.json"):
        assert (out / name).is_file(), name
    doc = json.loads((out / "results.json").read_text())
    assert [r["setting"] for r in doc["runs"]] == [a[1] for a in ABLATION]
    steps = json.loads((out / "plan.json").read_text())["max_steps"]
    assert steps >= 1
    for (run_name, _, zc, zh), row in zip(ABLATION, doc["runs"], strict=True):
        run = read_run(out / run_name)
        assert run.finished and run.steps == steps  # the same characters for every setting
        assert (run.model["zoneout_cell"], run.model["zoneout_hidden"]) == (zc, zh)
        assert row["characters"] == steps * 4 * 16
        per_run = json.loads((out / run_name / "results.json").read_text())
        assert per_run["valid_bpc"] == row["valid_bpc"] and 0 < row["test_bpc"] < 10
        assert "parallel streams" in per_run["protocol"]  # zlm eval's protocol, best/
        assert per_run["checkpoint"].endswith("best")
    md = (out / "results.md").read_text()
    assert md.count("\n| ") == 1 + len(ABLATION)  # header + one row per setting
    assert "train-valid gap" in md and "z_c 0.5 + z_h 0.05 (paper)" in md
    assert "best valid BPC" in res.stdout and "curves.png" in res.stdout
    assert (out / "curves.png").stat().st_size > 10_000

    # The same command again: everything is kept, nothing is retrained or re-scored.
    before = [len(read_metrics(out / a[0] / "metrics.jsonl")) for a in ABLATION]
    invoke("recipe", "zoneout-ablation", "--corpus", corpus, "--out", out, "--minutes", "0.02", *TINY)
    assert [len(read_metrics(out / a[0] / "metrics.jsonl")) for a in ABLATION] == before


def test_ablation_library_with_fixed_steps(corpus, tmp_path):
    result = zoneout_ablation(RecipeConfig(corpus=str(corpus), out=tmp_path / "a", max_steps=3,
                                           hidden=16, embed=8, batch_size=4, bptt=16))
    assert len(result.rows) == 4 and all(r["steps"] == 3 for r in result.rows)
    assert result.to_dict()["runs"][0]["setting"] == "no zoneout"
    assert "3 steps" in result.markdown


def test_equal_budget_prints_the_baselines(corpus, tmp_path):
    out = tmp_path / "eq"
    res = invoke("recipe", "equal-budget", "--corpus", corpus, "--out", out,
                 "--max-steps", "3", *TINY, "--json")
    doc = json.loads(res.stdout)
    assert doc["recipe"] == "equal-budget" and len(doc["runs"]) == 1
    row = json.loads((out / "results.json").read_text())["runs"][0]
    assert row["model"]["zoneout_cell"] == 0.1 and row["model"]["hidden"] == 16  # cpu-small + --hidden
    md = (out / "results.md").read_text()
    assert "| 2.09 | 2.30 |" in md and "| 2.18 | 2.37 |" in md and "zlm cpu-small" in md
    assert (out / "curves.png").is_file() and (out / "cpu-small" / "results.json").is_file()


def test_overfit_note():
    assert "overfit:" in overfit_note({"setting": "s", "valid_bpc": 1.5, "valid_bpc_end": 1.7,
                                       "best_step": 10})
    assert "did not overfit" in overfit_note({"setting": "s", "valid_bpc": 1.5,
                                              "valid_bpc_end": 1.5})


def test_usage_errors(tmp_path):
    res = runner.invoke(app, ["recipe", "nope"])
    assert res.exit_code == 2 and "unknown recipe" in res.output
    res = runner.invoke(app, ["recipe", "zoneout-ablation", "--corpus", str(tmp_path / "x.txt"),
                              "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--corpus" in res.output
    assert len(res.output.strip().splitlines()) == 1
    res = runner.invoke(app, ["recipe", "equal-budget", "--minutes", "0"])
    assert res.exit_code == 2 and "--minutes" in res.output

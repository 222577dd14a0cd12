"""`zlm recipe defaults-loco`: the grid interpolation, the leave-one-corpus-out fit, and the
whole procedure at tiny sizes on fake corpora (grid, folds, held-out runs, baseline, restart)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from conftest import TINY_BENCH, write_fake_bench_corpora
from zlm.cli import app
from zlm.core.metrics import read_metrics
from zlm.tools import benchmark as cb
from zlm.tools import loco
from zlm.tools.loco import Constants, GridRow, fit, interpolate

runner = CliRunner()


def test_interpolate_is_linear_between_grid_points_and_flat_outside():
    valid = {0.0: 2.0, 0.1: 1.9, 0.2: 1.95}
    assert interpolate(valid, 0.0) == 2.0 and interpolate(valid, 0.2) == 1.95
    assert interpolate(valid, 0.05) == pytest.approx(1.95)
    assert interpolate(valid, 0.15) == pytest.approx(1.925)
    assert interpolate(valid, 0.5) == 1.95 and interpolate(valid, -1.0) == 2.0


def _curve(best: float) -> dict[float, float]:
    """Valid BPC by z_c with its minimum at `best` (0.5 bits per unit of z_c away from it)."""
    return {z: 1.8 + 0.5 * abs(z - best) for z in loco.GRID}


def test_fit_follows_the_passes_and_leaves_the_corpus_out():
    # Few passes want no zoneout, many want the most: the fit puts its ramp between them.
    rows = [GridRow("a", 1.0, _curve(0.0)), GridRow("b", 2.0, _curve(0.0)), GridRow("c", 8.0, _curve(0.1)),
            GridRow("d", 40.0, _curve(0.2)), GridRow("e", 60.0, _curve(0.2))]
    best, mean = fit(rows)
    assert [best.zoneout_cell(r.epochs) for r in rows] == pytest.approx([0.0, 0.0, 0.1, 0.2, 0.2], abs=0.03)
    assert best.cell == 0.2 and best.start >= 2.0 and mean == pytest.approx(0.0, abs=0.005)
    # An odd corpus (few passes, yet it wants the most zoneout) moves the fit on all corpora...
    odd = [*rows, GridRow("odd", 1.5, {0.0: 2.5, 0.1: 2.0, 0.2: 1.6})]
    assert fit(odd)[0] != best
    # ...but not its own fold, chosen from the others' rows only.
    assert fit(odd, exclude="odd") == fit(rows)
    with pytest.raises(Exception, match="at least 2 corpora"):
        fit([rows[0]], exclude="a")


def test_every_corpus_weighs_the_same_whatever_its_scale():
    # Two corpora want no zoneout at 20 passes by 5%; one wants the most by 5%. A corpus of
    # Chinese characters has about 4 times the bits per character of English: scaling its
    # row by 4 must not let it outvote the other two.
    rows = [GridRow("a", 20.0, {0.0: 1.80, 0.1: 1.845, 0.2: 1.89}),
            GridRow("b", 20.0, {0.0: 1.70, 0.1: 1.7425, 0.2: 1.785}),
            GridRow("zh", 20.0, {0.0: 2.0, 0.1: 1.95, 0.2: 1.905})]
    best, _ = fit(rows)
    assert best.zoneout_cell(20.0) < 0.1  # the least zoneout the candidates allow at 20 passes
    scaled = [*rows[:2], GridRow("zh", 20.0, {z: 4 * v for z, v in rows[2].valid.items()})]
    assert fit(scaled) == fit(rows)


def test_ties_go_to_less_regularisation():
    flat = [GridRow("a", 5.0, {z: 2.0 for z in loco.GRID}), GridRow("b", 50.0, {z: 2.0 for z in loco.GRID})]
    best, _ = fit(flat)
    assert best.cell == min(loco.CANDIDATES["cell"]) and best.start == max(loco.CANDIDATES["start"])


def test_constants_follow_the_rule():
    from zlm.training import defaults

    c = Constants(defaults.ZONEOUT_FROM, defaults.ZONEOUT_FULL, defaults.ZONEOUT_CELL)
    for epochs in (0.5, 3.0, 4.0, 7.0, 10.0, 30.0):
        assert c.zoneout_cell(epochs) == defaults.zoneout_for(epochs).zoneout_cell
    assert loco.HIDDEN_SHARE * defaults.ZONEOUT_CELL == defaults.ZONEOUT_HIDDEN


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    return write_fake_bench_corpora(tmp_path_factory.mktemp("corpora"))


def test_procedure_end_to_end_and_again(corpora, tmp_path, monkeypatch):
    monkeypatch.setattr(loco, "GRID", (0.0, 0.2))
    out = tmp_path / "loco"
    config = cb.BenchmarkConfig(corpora=corpora, only="tinyshakespeare,fortunes-ru", out=out,
                                max_steps=2, seeds=(1, 2), sizes=TINY_BENCH)
    result = loco.defaults_loco(config)
    doc = json.loads((out / "loco.json").read_text())
    assert [g["corpus"] for g in doc["grid"]] == ["tinyshakespeare", "fortunes-ru"]
    for g in doc["grid"]:
        assert set(map(float, g["valid"])) == {0.0, 0.2} and g["epochs"] > 0
        for z in (0.0, 0.2):  # each grid run trained at its z_c, z_h half of it
            cfg = json.loads((out / g["corpus"] / f"grid-zc{z:g}-seed1" / "config.json").read_text())
            assert (cfg["model"]["zoneout_cell"], cfg["model"]["zoneout_hidden"]) == (z, z / 2)
    for name, fold in doc["folds"].items():  # each fold is the fit of the other corpus's row
        other = next(GridRow(g["corpus"], g["epochs"], {float(k): v for k, v in g["valid"].items()})
                     for g in doc["grid"] if g["corpus"] != name)
        assert Constants(**fold["constants"]) == fit([other])[0]
    held = [r for r in result.rows if r["setting"] == loco.HELD_OUT]
    assert [(r["corpus"], r["seed"]) for r in held] == [(c, s) for c in ("tinyshakespeare", "fortunes-ru")
                                                         for s in (1, 2)]
    for r in held:
        cfg = json.loads((out / r["corpus"] / r["run"].split("/")[-1] / "config.json").read_text())
        assert cfg["model"]["zoneout_cell"] == r["zoneout_cell"] and cfg["train"]["seed"] == r["seed"]
        if r["seed"] == 1 and r["zoneout_cell"] in (0.0, 0.2):  # seed 1 at a grid point: the grid run
            assert r["run"].endswith(f"grid-zc{r['zoneout_cell']:g}-seed1")
    assert sum(r["setting"] == "baseline" for r in result.rows) == 4
    assert "| tinyshakespeare |" in result.markdown and "Fitted on every corpus" in result.markdown
    # Again: everything is kept, nothing trains.
    counts = {p: len(read_metrics(p)) for p in out.glob("*/*/metrics.jsonl")}
    again = loco.defaults_loco(config)
    assert {p: len(read_metrics(p)) for p in out.glob("*/*/metrics.jsonl")} == counts
    assert again.markdown == result.markdown

    # --report midway: one baseline run missing leaves its corpus pending; a grid run missing
    # leaves its corpus without a fold (one complete row is too few to fit); nothing trains.
    partial = tmp_path / "partial"
    shutil.copytree(out, partial)
    shutil.rmtree(partial / "tinyshakespeare" / "baseline-seed2")
    report = loco.defaults_loco(replace(config, out=partial, report=True))
    assert "Not finished yet (the same command without --report trains them): tinyshakespeare/baseline-seed2." \
        in report.markdown
    ts = next(line for line in report.markdown.splitlines() if line.startswith("| tinyshakespeare |"))
    assert "pending (3 of 4 runs)" in ts
    assert not (partial / "tinyshakespeare" / "baseline-seed2").exists()
    assert report.markdown.replace(ts, "").count("pending") == 0  # fortunes-ru is complete
    shutil.rmtree(partial / "fortunes-ru" / "grid-zc0.2-seed1")
    report = loco.defaults_loco(replace(config, out=partial, report=True))
    doc = json.loads((partial / "loco.json").read_text())
    assert doc["folds"] == {} and [g["corpus"] for g in doc["grid"]] == ["tinyshakespeare"]
    assert "fortunes-ru's held-out runs (its grid row is not complete)" in doc["missing"]
    assert {r["setting"] for r in doc["runs"]} == {"baseline"}
    assert not (partial / "fortunes-ru" / "grid-zc0.2-seed1").exists()


def test_cli_names_the_recipe(corpora, tmp_path):
    res = runner.invoke(app, ["recipe", "defaults-loco", "--lr", "1e-3"])
    assert res.exit_code == 2 and "does not apply" in res.output
    res = runner.invoke(app, ["recipe", "nope"])
    assert res.exit_code == 2 and "defaults-loco" in res.output

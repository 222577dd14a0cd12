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
from zlm.core.config import Options
from zlm.core.metrics import read_metrics
from zlm.tools import benchmark as cb
from zlm.tools import loco
from zlm.tools.loco import Constants, GridRow, WindowConstants, WindowRow, fit, fit_window, interpolate
from zlm.training import defaults

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
    c = Constants(defaults.ZONEOUT_FROM, defaults.ZONEOUT_FULL, defaults.ZONEOUT_CELL)
    for epochs in (0.5, 3.0, 4.0, 7.0, 10.0, 30.0):
        assert c.zoneout_cell(epochs) == defaults.zoneout_for(epochs).zoneout_cell
    assert loco.HIDDEN_SHARE * defaults.ZONEOUT_CELL == defaults.ZONEOUT_HIDDEN


def _ends(rich: float, reg: float, epochs: float, name: str) -> WindowRow:
    return WindowRow(name, epochs, 0.0, {"data-rich": rich, "regularised": reg})


def test_window_row_is_linear_between_its_ends():
    row = _ends(2.0, 1.8, 10.0, "a")
    assert row.at(0.0) == 2.0 and row.at(1.0) == 1.8 and row.at(0.25) == pytest.approx(1.95)


def test_window_fit_follows_the_passes_and_leaves_the_corpus_out():
    # Few passes want the data-rich window, many the regularised one: the ramp goes between.
    rows = [_ends(1.8, 1.9, 1.5, "a"), _ends(1.8, 1.9, 3.0, "b"), _ends(1.9, 1.8, 20.0, "c"),
            _ends(1.9, 1.8, 40.0, "d")]
    best, mean = fit_window(rows)
    assert [best.share(r.epochs) for r in rows] == [0.0, 0.0, 1.0, 1.0] and mean == pytest.approx(0.0)
    assert (best.start, best.full) == (10.0, 16.0)  # of the ramps that fit exactly, the latest
    # A corpus of many passes that wants the data-rich window moves the fit on all corpora...
    odd = [*rows, _ends(1.7, 2.2, 30.0, "odd")]
    assert fit_window(odd)[0] != best and fit_window(odd)[0].share(30.0) < 1.0
    # ...but not its own fold.
    assert fit_window(odd, exclude="odd") == fit_window(rows)
    with pytest.raises(Exception, match="at least 2 corpora"):
        fit_window([rows[0]], exclude="a")


def test_window_ties_go_to_the_data_rich_window():
    flat = [_ends(2.0, 2.0, 5.0, "a"), _ends(2.0, 2.0, 50.0, "b")]
    best, _ = fit_window(flat)
    assert (best.start, best.full) == (max(loco.WINDOW_CANDIDATES["start"]), max(loco.WINDOW_CANDIDATES["full"]))
    assert best.share(50.0) < 1.0


def test_window_constants_follow_the_rule():
    c = WindowConstants(defaults.REGULARISED_FROM, defaults.REGULARISED_FULL)
    assert defaults.REGULARISED_FROM in loco.WINDOW_CANDIDATES["start"]
    assert defaults.REGULARISED_FULL in loco.WINDOW_CANDIDATES["full"]
    for epochs in (0.5, 3.0, 10.0, 11.0, 12.6, 15.9, 16.0, 30.0):
        regime, settings = defaults.regime_for(epochs)
        assert c.share(epochs) == defaults.window_share(epochs)
        assert loco.window(c.share(epochs)) == Options(bptt=settings.bptt, lr=settings.lr)
    # The two ends are the regimes' own settings, in WINDOW_ENDS' order.
    for share, end in enumerate(loco.WINDOW_ENDS):
        r = defaults.REGIMES[end]
        assert loco.window(share) == Options(bptt=r.bptt, lr=r.lr)


def test_window_grid_runs_at_the_grid_point_nearest_the_rule():
    assert loco.window_zoneout(1.0) == 0.0 and loco.window_zoneout(40.0) == defaults.ZONEOUT_CELL
    # At 9.17 passes the rule's z_c is 0.0196: the nearest grid point is 0.
    assert defaults.zoneout_for(9.17).zoneout_cell == pytest.approx(0.0196, abs=1e-4)
    assert loco.window_zoneout(9.17) == 0.0
    assert loco.held_out_setting(0.1, None) == "heldout-zc0.1"
    assert loco.held_out_setting(0.1, 0.0) == "heldout-zc0.1-bptt50-lr0.004"


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
    # The window grid: each corpus at the end its grid run did not take (both took the
    # data-rich one: two steps are far from REGULARISED_FROM passes), at z_c 0.
    assert [w["corpus"] for w in doc["window_grid"]] == ["tinyshakespeare", "fortunes-ru"]
    for w, g in zip(doc["window_grid"], doc["grid"], strict=True):
        assert w["zoneout_cell"] == 0.0 and w["valid"]["data-rich"] == g["valid"]["0.0"]
        cfg = json.loads((out / w["corpus"] / "window-regularised-zc0-seed1" / "config.json").read_text())
        assert (cfg["train"]["bptt"], cfg["train"]["lr"], cfg["model"]["zoneout_cell"]) == (25, 0.005, 0.0)
    for name, fold in doc["window_folds"].items():
        other = next(WindowRow(**w) for w in doc["window_grid"] if w["corpus"] != name)
        assert WindowConstants(**fold["constants"]) == fit_window([other])[0]
    held = [r for r in result.rows if r["setting"] == loco.HELD_OUT]
    for r in held:  # the held-out window is the rule's here (share 0 at E < 1): no runs of its own
        assert (r["bptt"], r["lr"]) == (50, 0.004) and "bptt" not in r["run"]
    assert [(r["corpus"], r["seed"]) for r in held] == [(c, s) for c in ("tinyshakespeare", "fortunes-ru")
                                                         for s in (1, 2)]
    for r in held:
        cfg = json.loads((out / r["corpus"] / r["run"].split("/")[-1] / "config.json").read_text())
        assert cfg["model"]["zoneout_cell"] == r["zoneout_cell"] and cfg["train"]["seed"] == r["seed"]
        if r["seed"] == 1 and r["zoneout_cell"] in (0.0, 0.2):  # seed 1 at a grid point: the grid run
            assert r["run"].endswith(f"grid-zc{r['zoneout_cell']:g}-seed1")
    assert sum(r["setting"] == "baseline" for r in result.rows) == 4
    assert "| tinyshakespeare |" in result.markdown and "Fitted on every corpus" in result.markdown
    assert "Evaluation streams: each stream after the first read the tokens before it as context." in result.markdown
    # Again: everything is kept, nothing trains.
    counts = {p: len(read_metrics(p)) for p in out.glob("*/*/metrics.jsonl")}
    again = loco.defaults_loco(config)
    assert {p: len(read_metrics(p)) for p in out.glob("*/*/metrics.jsonl")} == counts
    assert again.markdown == result.markdown

    # A fold whose window is not the rule's at the corpus's E: its held-out runs take that
    # window and lr (seed 1 reuses the window grid's run of it; seed 2 trains its own).
    other = tmp_path / "other-window"
    shutil.copytree(out, other)
    monkeypatch.setattr(loco, "fit_window", lambda rows, exclude=None: (WindowConstants(1e-9, 2e-9), 0.0))
    regularised = loco.defaults_loco(replace(config, out=other))
    for r in (r for r in regularised.rows if r["setting"] == loco.HELD_OUT):
        z = r["zoneout_cell"]
        assert r["run"].split("/")[-1] == (f"window-regularised-zc{z:g}-seed1" if r["seed"] == 1
                                           else f"heldout-zc{z:g}-bptt25-lr0.005-seed2")
        cfg = json.loads((other / r["corpus"] / r["run"].split("/")[-1] / "config.json").read_text())
        assert (cfg["train"]["bptt"], cfg["train"]["lr"], cfg["model"]["zoneout_cell"]) == (25, 0.005, z)
    ts = next(line for line in regularised.markdown.splitlines() if line.startswith("| tinyshakespeare |"))
    assert " | 0 | 25, 0.005 | " in ts
    monkeypatch.undo()
    monkeypatch.setattr(loco, "GRID", (0.0, 0.2))

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
    shutil.rmtree(partial / "fortunes-ru" / "window-regularised-zc0-seed1")
    loco.defaults_loco(replace(config, out=partial, report=True))
    doc = json.loads((partial / "loco.json").read_text())
    assert doc["window_folds"] == {} and {r["setting"] for r in doc["runs"]} == {"baseline"}
    assert {"fortunes-ru's held-out runs (its window row is not complete)",
            "tinyshakespeare's held-out runs (no other corpus's window row is complete)",
            "fortunes-ru/window-regularised-zc0-seed1"} <= set(doc["missing"])
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

"""Learning curves (zlm.curves), the PNG (zlm.plot) and `zlm plot` in-process.

Most runs here are fakes: a config.json and a metrics.jsonl written in the trainer's
format, so the curves are known exactly; one real tiny run checks that format.
"""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from conftest import shakespeare_text, train_run, write_char_dataset
from zlm.cli import app
from zlm.cli.plot import WIDTH, render_terminal, terminal_lines
from zlm.core.config import TrainConfig
from zlm.core.spec import DataRef, Resolved, RunSpec
from zlm.data.dataset import Dataset
from zlm.model.config import ModelConfig
from zlm.tools.curves import Curve, read_run, read_runs, sample_at

runner = CliRunner()


def write_fake_run(path, hidden=64, zc=0.5, zh=0.05, steps=200, batch_size=4, bptt=10,
                   world_size=1, floor=1.8, log_every=10, eval_every=50, s_per_step=0.1,
                   overfit=0.0, results=None, resolved=("fp32", "fused", "compiled")):
    """A run directory as zlm train writes it: config.json and metrics.jsonl."""
    path.mkdir(parents=True)
    spec = RunSpec(ModelConfig(vocab_size=65, hidden=hidden, layers=1, embed=16, zoneout_cell=zc,
                               zoneout_hidden=zh, dropout=0.0),
                   TrainConfig(batch_size=batch_size, bptt=bptt, lr=0.002, max_steps=steps),
                   Resolved(*resolved), DataRef("/nonexistent", {"kind": "char"}, "character"),
                   world_size=world_size)
    (path / "config.json").write_text(json.dumps(spec.to_dict()))

    def bpc(step):  # decays to `floor`, then rises by `overfit` per 100 steps
        return floor + 4.0 * math.exp(-step / 40) + overfit * step / 100

    events = [{"event": "start", "time": 1.0, "parameters": 4 * hidden * (hidden + 16),
               "cell": "fused", "runtime": "cpu fp32", "world_size": world_size, "step": 0}]
    for s in range(1, steps + 1):
        events.append({"event": "step", "step": s, "loss": bpc(s) * math.log(2), "grad_norm": 1.0,
                       "lr": 0.002})
        if s % log_every == 0:
            events.append({"event": "train", "step": s, "epoch": s / 100, "train_bpc": bpc(s) - 0.1,
                           "valid_bpc": None, "chars_per_s": 1000.0 + s, "lr": 0.002,
                           "elapsed": s * s_per_step, "eta": 0.0, "total_steps": steps})
        if s % eval_every == 0:
            events.append({"event": "eval", "step": s, "epoch": s / 100, "valid_bpc": bpc(s) + overfit * s / 50,
                           "valid_ppl": 2.0, "best_bpc": bpc(s), "tokens": 100, "characters": 100})
    events.append({"event": "finish", "step": steps, "best_valid_bpc": bpc(steps),
                   "elapsed_s": steps * s_per_step, "run": str(path), "interrupted": None})
    (path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if results is not None:
        (path / "results.json").write_text(json.dumps(results))
    return path


@pytest.fixture
def runs(tmp_path):
    return [write_fake_run(tmp_path / "plain", zc=0.0, zh=0.0, overfit=0.3),
            write_fake_run(tmp_path / "zoneout", steps=300, floor=1.6),
            write_fake_run(tmp_path / "wide", hidden=256, world_size=2, floor=1.7)]


def test_curves_characters_and_time(tmp_path):
    run = read_run(write_fake_run(tmp_path / "r", batch_size=4, bptt=10, world_size=2,
                                  steps=100, s_per_step=0.5))
    assert run.chars_per_step == 80  # step x batch x bptt x world size
    assert run.train.steps == tuple(range(10, 101, 10))
    assert run.train.chars[0] == 800 and run.valid.chars == (4000, 8000)
    assert run.valid.seconds == pytest.approx((25.0, 50.0))
    assert run.finished and run.elapsed_s == 50.0 and run.steps == 100
    assert run.settings == "1x64 z_c 0.5 z_h 0.05 dropout 0"
    assert run.best_valid_bpc == pytest.approx(min(run.valid.bpc))


def test_resumed_steps_keep_the_later_value(tmp_path):
    path = write_fake_run(tmp_path / "r", steps=20)
    with open(path / "metrics.jsonl", "a") as f:  # resumed from step 10: 20 logged again
        f.write(json.dumps({"event": "start", "step": 10, "parameters": 1}) + "\n")
        f.write(json.dumps({"event": "train", "step": 20, "train_bpc": 9.0, "elapsed": 7.0,
                            "chars_per_s": 5.0}) + "\n")
        f.write('{"event": "eval", "step": 2')  # torn last line
    run = read_run(path)
    assert run.train.steps == (10, 20) and run.train.bpc[-1] == 9.0
    assert not run.finished and run.elapsed_s == 7.0


def test_sample_at_bins():
    curve = Curve((1, 2, 3), (10.0, 20.0, 30.0), (1.0, 2.0, 3.0), (3.0, 2.0, 1.0))
    # bins (0,5] (5,10] (10,15] (15,25] (25,30] (30,35] (35,45]: blank before and after
    assert sample_at(curve, "chars", [5, 10, 15, 25, 30, 35, 45]) == \
        [None, 3.0, 3.0, 2.0, 1.0, None, None]
    assert sample_at(curve, "time", [1.5, 3.0]) == [3.0, 1.0]


def test_real_run_has_the_trainers_format(tmp_path):
    data = Dataset.open(write_char_dataset(tmp_path / "data", shakespeare_text(20_000)))
    train_run(tmp_path / "run", data, ModelConfig(vocab_size=data.vocab_size, hidden=8, embed=4),
          TrainConfig(batch_size=4, bptt=16, max_steps=8, eval_every=4, log_every=2))
    run = read_run(tmp_path / "run")
    assert run.train.steps == (2, 4, 6, 8) and run.valid.steps == (4, 8)
    assert run.valid.chars == (4 * 64, 8 * 64) and run.finished
    assert 0 < run.valid.seconds[0] <= run.valid.seconds[1] and run.parameters > 0


def test_rounded_finish_time_does_not_override_the_exact_one(tmp_path):
    """The finish event's elapsed_s is rounded to 0.1 s; for a run shorter than 0.05 s it
    used to pull the last validation's time back to 0 (a flaky test above found it)."""
    run = tmp_path / "run"
    write_fake_run(run, steps=20, log_every=10, eval_every=10, s_per_step=0.002)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    finish = json.loads(lines[-1])
    finish["elapsed_s"] = 0.0  # round(0.04, 1)
    lines[-1] = json.dumps(finish)
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert read_run(run).valid.seconds == pytest.approx((0.02, 0.04))


def test_png_is_written_and_not_blank(runs, tmp_path):
    import matplotlib.image

    out = tmp_path / "figs" / "curves.png"
    res = runner.invoke(app, ["plot", *map(str, runs), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert out.stat().st_size > 10_000
    img = matplotlib.image.imread(out)  # (H, W, 4) floats in [0, 1]
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 500
    rgb = img[..., :3].reshape(-1, 3)
    assert rgb.std() > 0.05  # not one flat colour
    coloured = ((rgb.max(axis=1) - rgb.min(axis=1)) > 0.3).mean()
    assert coloured > 0.002  # the coloured lines are there, not only axes and text


def test_png_against_time(runs, tmp_path):
    out = tmp_path / "time.png"
    res = runner.invoke(app, ["plot", *map(str, runs), "--out", str(out), "--x", "time"])
    assert res.exit_code == 0, res.output
    assert out.stat().st_size > 10_000


def test_terminal_view_lists_every_run(runs):
    res = runner.invoke(app, ["plot", *map(str, runs)])
    assert res.exit_code == 0, res.output
    for name in ("plain", "zoneout", "wide"):
        assert name in res.stdout
    assert "1x256 z_c 0.5 z_h 0.05 dropout 0" in res.stdout
    assert all(len(line) <= 80 for line in res.stdout.splitlines())
    buf = io.StringIO()
    render_terminal(read_runs(runs), "time", console=Console(file=buf, width=80))
    text = buf.getvalue()
    assert all(n in text for n in ("plain", "zoneout", "wide")) and "▁" in text


def test_terminal_shows_a_short_run_ending_early(runs):
    lines = [t for _, t in terminal_lines(read_runs(runs), "chars")]
    start = len("  valid ")
    sparks = [t[start:start + WIDTH] for t in lines if t.startswith("  valid ")]
    assert len(sparks) == 3
    plain, zoneout, wide = sparks  # 8k, 12k and 16k characters: one shared x axis
    assert plain.endswith(" " * (WIDTH // 3)) and zoneout.endswith(" " * (WIDTH // 8))
    assert wide[-1] != " "


def test_missing_matplotlib_is_one_line(runs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    res = runner.invoke(app, ["plot", str(runs[0]), "--out", str(tmp_path / "c.png")])
    assert res.exit_code == 1
    assert res.output.strip() == "error: matplotlib is not installed; pip install 'zlm[plot]'"
    assert not (tmp_path / "c.png").exists()


def test_usage_errors(runs, tmp_path):
    res = runner.invoke(app, ["plot", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "not a run directory" in res.output
    assert len(res.output.strip().splitlines()) == 1
    res = runner.invoke(app, ["plot", str(runs[0]), "--x", "steps"])
    assert res.exit_code == 2 and "--x" in res.output

"""`zlm recipe corpora-benchmark` at tiny sizes on fake corpora: the two settings, the
tables, restart after an interruption (finished runs kept, the unfinished one resumed)."""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import signal
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from conftest import RUSSIAN, TINY_BENCH, shakespeare_text, write_char_dataset, write_fake_bench_corpora
from zlm.cli import app
from zlm.core.config import Options
from zlm.core.metrics import read_metrics
from zlm.core.reporter import Reporter
from zlm.data.dataset import Dataset
from zlm.errors import UsageError, ZlmError
from zlm.tools import benchmark as cb
from zlm.tools.curves import read_run
from zlm.training import speed_probe

runner = CliRunner()


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """A fake fetch-corpora OUT_DIR holding two of the set's names."""
    return write_fake_bench_corpora(tmp_path_factory.mktemp("corpora"))


def test_defaults_are_zlm_trains_and_baseline_is_the_plain_lstm(tmp_path, monkeypatch):
    data = Dataset.open(write_char_dataset(tmp_path / "data", shakespeare_text(20_000)))
    monkeypatch.setattr(speed_probe, "probe_tokens_per_s", lambda *a, **k: 1e6)  # many passes
    spec = cb.zlm_defaults(data, Options(time_budget=600.0, seed=2), tmp_path / "preview")
    model, train, rule = spec.model, spec.train, spec.rule
    # what `zlm train DATA --time-budget 10m --seed 2` resolves: the preset, then the rule
    assert rule.regime == "regularised" and rule.tokens_per_s == 1e6
    assert (model.hidden, model.zoneout_cell, model.zoneout_hidden) == (rule.settings.hidden, 0.1, 0.05)
    assert (train.lr, train.schedule.kind, train.eval_every) == (5e-3, "cosine", rule.settings.eval_every)
    assert (train.time_budget, train.seed, model.vocab_size) == (600.0, 2, data.vocab_size)
    bm, bt = cb.baseline((model, train))
    assert (bm.layers, bm.hidden, bm.embed, bm.zoneout_cell, bm.zoneout_hidden, bm.dropout) == \
        (1, 512, 64, 0.0, 0.0, 0.0)
    assert (bt.optimizer, bt.lr, bt.schedule.kind, bt.clip, bt.batch_size, bt.bptt) == \
        ("adam", 2e-3, "constant", 1.0, 32, 100)
    assert (bt.state, bt.reset_prob) == ("carry", 0.0)
    for same in ("precision", "device", "cell", "time_budget", "seed"):
        assert getattr(bt, same) == getattr(train, same), same
    # The same validation schedule in tokens: the defaults' windows are 32 x 25, the baseline's 32 x 100.
    assert train.bptt == 25 and bt.eval_every * 3200 == pytest.approx(train.eval_every * 800, abs=5 * 3200)
    assert bm.vocab_size == data.vocab_size
    # A sample of the valid split (a run under one pass) is validated on by both alike.
    _, sampled = cb.baseline((model, replace(train, eval_tokens=50_000)))
    assert sampled.eval_tokens == 50_000
    # The baseline of a seed shares the spec its defaults run stored, never a new measurement.
    run = tmp_path / "defaults-seed2"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(spec.to_dict()))
    monkeypatch.setattr(speed_probe, "probe_tokens_per_s", lambda *a, **k: 1.0)
    planned = cb.run_plan("baseline", data, 2, cb.BenchmarkConfig(), tmp_path)
    assert planned.spec.rule is None and planned.spec.train == bt and planned.spec.model == bm
    assert planned.spec.preset == cb.BASELINE.name


def test_config_checks():
    assert cb.parse_seeds("1,2") == (1, 2)
    with pytest.raises(UsageError, match="--seeds"):
        cb.parse_seeds("1,x")
    with pytest.raises(UsageError, match="--seeds"):
        cb.BenchmarkConfig(seeds=(1, 1))
    with pytest.raises(UsageError, match="--lr does not apply"):
        cb.BenchmarkConfig(sizes={"lr": 1e-3})
    with pytest.raises(UsageError, match="--minutes"):
        cb.BenchmarkConfig(minutes=0)
    assert cb.BenchmarkConfig().budget() == {"time_budget": 600.0}
    assert cb.BenchmarkConfig(max_steps=3).budget() == {"max_steps": 3}


class KillAt(Reporter):
    """Sends SIGTERM to this process when training reaches `step` (the trainer saves a
    checkpoint and stops, as after Ctrl-C)."""

    def __init__(self, step: int):
        self.step = step

    def log(self, record: dict) -> None:
        if record.get("step") == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_benchmark_end_to_end_and_restart_after_interruption(corpora, tmp_path):
    out = tmp_path / "bench"
    config = cb.BenchmarkConfig(corpora=corpora, only="tinyshakespeare,fortunes-ru", out=out,
                                max_steps=4, seeds=(1, 2), sizes=TINY_BENCH)
    calls = []

    def interrupt_third_run():  # reporter 0 is the recipe's, 1.. are the runs'
        calls.append(1)
        return KillAt(2) if len(calls) == 4 else Reporter()

    with pytest.raises(ZlmError, match="interrupted during .*tinyshakespeare/baseline-seed1"):
        cb.corpora_benchmark(config, interrupt_third_run)
    first = ["defaults-seed1", "defaults-seed2"]
    done = {n: len(read_metrics(out / "tinyshakespeare" / n / "metrics.jsonl")) for n in first}
    stopped = out / "tinyshakespeare" / "baseline-seed1"  # order: corpus, setting, seed
    assert not read_run(stopped).finished and (stopped / "checkpoints").is_dir()

    result = cb.corpora_benchmark(config)  # the same command again
    for n in first:  # finished runs are kept as they are
        assert len(read_metrics(out / "tinyshakespeare" / n / "metrics.jsonl")) == done[n]
    resumed = read_run(stopped)  # resumed from its step-2 checkpoint, not started again
    assert resumed.finished and resumed.steps == 4
    starts = [e for e in read_metrics(stopped / "metrics.jsonl") if e.get("event") == "start"]
    assert len(starts) == 2 and starts[-1]["resumed_from"].endswith("step-00000002")

    assert [(r["corpus"], r["setting"], r["seed"]) for r in result.rows] == [
        (c, s, seed) for c in ("tinyshakespeare", "fortunes-ru") for s in cb.SETTINGS for seed in (1, 2)]
    for r in result.rows:
        assert 0 < r["valid_bpc"] < 10 and 0 < r["test_bpc"] < 10
        assert r["characters"] == 4 * 4 * 16 and r["checkpoint"].endswith("best")
        assert r["model"]["hidden"] == 16  # --hidden applies to both settings
        zc = r["model"]["zoneout_cell"]
        stored = json.loads((pathlib.Path(r["run"]) / "config.json").read_text()).get("defaults_rule")
        if r["setting"] == "baseline":
            assert zc == 0.0 and stored is None
        else:  # 4 steps of 64 tokens are a small part of a pass: the rule's data-rich settings
            assert stored["regime"] == "data-rich" and zc == stored["settings"]["zoneout_cell"]
            assert r["train"]["lr"] == stored["settings"]["lr"]
    doc = json.loads((out / "results.json").read_text())
    assert doc["recipe"] == "corpora-benchmark" and len(doc["summary"]) == 2
    ru = next(c for c in doc["corpora"] if c["name"] == "fortunes-ru")
    assert ru["pinned"] is False and ru["vocabulary"] == len(set(RUSSIAN))  # a fake, not the pin
    md = (out / "results.md").read_text()
    assert md.count("| tinyshakespeare | defaults |") == 2 and "defaults win" in md
    assert "- baseline: 1x16, embed 8, z_c 0, z_h 0, adam 0.002 constant" in md
    assert "Evaluation streams: each stream after the first read the tokens before it as context." in md
    for name in ("tinyshakespeare", "fortunes-ru"):
        assert (out / name / "curves.png").is_file() and (out / name / "data" / "dataset.json").is_file()


def test_summary_means_and_wins():
    rows = [{"corpus": "c", "setting": s, "seed": k, "valid_bpc": v, "test_bpc": v + 0.1,
             "characters": 100} for s, k, v in (("defaults", 1, 1.90), ("defaults", 2, 1.92),
                                                ("baseline", 1, 1.95), ("baseline", 2, 1.95))]
    (s,) = cb.summarize(rows)
    assert s["defaults_valid"] == pytest.approx(1.91) and s["delta_valid"] == pytest.approx(-0.04)
    assert s["defaults_win"]
    rows[1]["test_bpc"] = 2.2
    assert not cb.summarize(rows)[0]["defaults_win"]  # test mean 2.11 vs 2.05
    # A setting with fewer runs than seeds (a --report midway) is not decided either way.
    (s,) = cb.summarize(rows[:3], seeds=2)
    assert s["defaults_win"] is None and (s["defaults_runs"], s["baseline_runs"]) == (2, 1)
    assert cb.win_cell(s, "defaults", 2) == "pending (3 of 4 runs)"
    assert cb.win_cell(cb.summarize(rows, seeds=2)[0], "defaults", 2) == "no"


def test_cli(corpora, tmp_path):
    out = tmp_path / "cli"
    res = runner.invoke(app, ["recipe", "corpora-benchmark", "--corpora", str(corpora), "--only",
                              "fortunes-ru", "--seeds", "3", "--max-steps", "2", "--out", str(out),
                              "--hidden", "16", "--embed", "8", "--batch-size", "4", "--bptt", "16",
                              "--eval-every", "2", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [(r["setting"], r["seed"]) for r in doc["runs"]] == [("defaults", 3), ("baseline", 3)]
    for args in (["--lr", "1e-3"], ["--corpus", "x.txt"], ["--seed", "3"]):
        res = runner.invoke(app, ["recipe", "corpora-benchmark", *args])
        assert res.exit_code == 2 and "does not apply" in res.output, args
    res = runner.invoke(app, ["recipe", "equal-budget", "--only", "stdlib"])
    assert res.exit_code == 2 and "--only does not apply" in res.output
    res = runner.invoke(app, ["recipe", "corpora-benchmark", "--only", "nope"])
    assert res.exit_code == 2 and "--only nope" in res.output
    assert len(res.output.strip().splitlines()) == 1
    res = runner.invoke(app, ["recipe", "corpora-benchmark", "--corpora", str(tmp_path / "none"),
                              "--only", "python-docs", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "scripts/fetch-corpora" in res.output


def test_record_continues_a_benchmark_on_a_machine_without_its_out(corpora, tmp_path):
    """--record DIR keeps each finished run's spec, log and scores (no weights); a fresh OUT
    with the same record restores those runs instead of training them again."""
    args = ["recipe", "corpora-benchmark", "--corpora", str(corpora), "--only", "fortunes-ru",
            "--seeds", "1", "--max-steps", "2", "--hidden", "16", "--embed", "8", "--batch-size", "4",
            "--bptt", "16", "--eval-every", "2", "--record", str(tmp_path / "record"), "--json"]
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    first = json.loads(res.stdout)["runs"]
    kept = sorted(str(p.relative_to(tmp_path / "record")) for p in (tmp_path / "record").rglob("*") if p.is_file())
    assert kept == sorted(f"fortunes-ru/{s}-seed1/{f}" for s in cb.SETTINGS for f in (*cb.RECORD_FILES, cb.RECORD_LOG)
                          if s == "baseline" or f != cb.BASELINE_RULE)  # a baseline's copy of the rule

    res = runner.invoke(app, [*args, "--out", str(tmp_path / "b")])  # another machine: OUT is new
    assert res.exit_code == 0, res.output
    again = json.loads(res.stdout)["runs"]
    assert [(r["setting"], r["valid_bpc"], r["test_bpc"], r["steps"]) for r in again] == \
        [(r["setting"], r["valid_bpc"], r["test_bpc"], r["steps"]) for r in first]
    for s in cb.SETTINGS:  # restored, not trained: no checkpoint was written
        assert not (tmp_path / "b" / "fortunes-ru" / f"{s}-seed1" / "checkpoints").exists()

    res = runner.invoke(app, [*args[:-1], "--max-steps", "3", "--out", str(tmp_path / "c")])
    assert res.exit_code == 2 and "pass the same budget or another --record" in res.output
    res = runner.invoke(app, ["recipe", "equal-budget", "--record", str(tmp_path / "r")])
    assert res.exit_code == 2 and "--record does not apply" in res.output

    # --report with a second seed asked: the finished seed-1 runs are tabled, seed 2's are
    # listed as left, and nothing trains.
    seeds = args.index("--seeds") + 1
    report = [*args[:seeds], "1,2", *args[seeds + 1:], "--report", "--out", str(tmp_path / "d")]
    res = runner.invoke(app, report)
    assert res.exit_code == 0, res.output
    assert [r["setting"] for r in json.loads(res.stdout)["runs"]] == list(cb.SETTINGS)
    md = (tmp_path / "d" / "results.md").read_text()
    assert "Not finished yet (the same command without --report trains them): fortunes-ru/defaults-seed2, " \
        "fortunes-ru/baseline-seed2." in md
    assert "pending (2 of 4 runs)" in md
    assert not (tmp_path / "d" / "fortunes-ru" / "defaults-seed2").exists()
    res = runner.invoke(app, ["recipe", "equal-budget", "--report"])
    assert res.exit_code == 2 and "--report does not apply" in res.output


def test_a_run_planned_before_the_rule_changed_is_trained_again(corpora, tmp_path, monkeypatch):
    """A run (in OUT or the record) planned otherwise than the rule plans it now is trained
    again and its record replaced; a run the change leaves alone is kept; --report leaves a
    stale run out of the tables. The plans are compared at each run's measured speed."""
    from zlm.training import defaults

    def record_of(setting: str) -> dict:
        return json.loads((tmp_path / "record" / "fortunes-ru" / f"{setting}-seed1" / "config.json").read_text())

    args = ["recipe", "corpora-benchmark", "--corpora", str(corpora), "--only", "fortunes-ru",
            "--seeds", "1", "--max-steps", "3", "--hidden", "16", "--embed", "8", "--batch-size", "4",
            "--bptt", "16", "--record", str(tmp_path / "record"), "--json"]
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    # The baseline validates as often in tokens: every 50 of 4 x 16 -> every 10 (at least) of 32 x 100.
    assert (record_of("defaults")["train"]["eval_every"], record_of("baseline")["train"]["eval_every"]) == (50, 10)
    assert (tmp_path / "record" / "fortunes-ru" / "baseline-seed1" / cb.BASELINE_RULE).is_file()

    # The validation schedule changes: both settings take it, so both train again.
    monkeypatch.setattr(defaults, "MIN_EVAL_EVERY", 1000)
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    assert "eval_every 50 -> 1000" in res.output and "eval_every 10 -> 20" in res.output
    assert "moved to defaults-seed1.stale" in res.output and "moved to baseline-seed1.stale" in res.output
    assert (record_of("defaults")["train"]["eval_every"], record_of("baseline")["train"]["eval_every"]) == (1000, 20)
    for s in cb.SETTINGS:
        assert (tmp_path / "a" / "fortunes-ru" / f"{s}-seed1.stale" / "config.json").is_file()
        assert json.loads((tmp_path / "a" / "fortunes-ru" / f"{s}-seed1" / "config.json").read_text()) == record_of(s)

    # Weight averaging changes: only the defaults retrain (from the record, on a fresh OUT);
    # the baseline is restored, not trained.
    monkeypatch.setattr(defaults, "AVERAGE_SHARE", 0.5)
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    assert "average 0.25 -> 0.5" in res.output and "the record is replaced" in res.output
    assert record_of("defaults")["train"]["average"] == 0.5
    assert (tmp_path / "b" / "fortunes-ru" / "defaults-seed1" / "checkpoints").is_dir()
    assert not (tmp_path / "b" / "fortunes-ru" / "baseline-seed1" / "checkpoints").exists()

    # --report after another change trains nothing and leaves the stale run out.
    monkeypatch.setattr(defaults, "AVERAGE_SHARE", 0.3)
    res = runner.invoke(app, [*args, "--report", "--out", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    assert [r["setting"] for r in json.loads(res.stdout)["runs"]] == ["baseline"]
    assert "fortunes-ru/defaults-seed1" in (tmp_path / "c" / "results.md").read_text()
    assert record_of("defaults")["train"]["average"] == 0.5


def test_a_run_the_overfitting_guard_leaves_alone_is_kept(corpora, tmp_path, monkeypatch):
    """A defaults run recorded before the rule turned the overfitting guard on stands for a
    run with it when its validations never meet the guard's test (the run trains the same);
    when they do (the record's log rewritten to rise while the train slice falls), it is
    stale and --report leaves it out, naming the change."""
    from zlm.training import defaults

    monkeypatch.setattr(defaults, "ON_OVERFIT", "continue")
    args = ["recipe", "corpora-benchmark", "--corpora", str(corpora), "--only", "fortunes-ru",
            "--seeds", "1", "--max-steps", "4", "--hidden", "16", "--embed", "8", "--batch-size", "4",
            "--bptt", "16", "--record", str(tmp_path / "record"), "--json"]
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    record = tmp_path / "record" / "fortunes-ru" / "defaults-seed1"
    assert json.loads((record / "config.json").read_text())["train"]["on_overfit"] == "continue"

    monkeypatch.setattr(defaults, "ON_OVERFIT", "cool-down")
    res = runner.invoke(app, [*args, "--report", "--out", str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    assert sorted(r["setting"] for r in json.loads(res.stdout)["runs"]) == ["baseline", "defaults"]
    assert "on_overfit continue -> cool-down" not in res.output

    log = [json.loads(line) for line in gzip.decompress((record / cb.RECORD_LOG).read_bytes()).splitlines()]
    rising = [{"event": "eval", "step": s, "valid_bpc": v, "train_slice_bpc": t}
              for s, v, t in ((1, 5.0, 4.9), (2, 5.2, 4.8), (3, 5.5, 4.7))]
    log = [e for e in log if e["event"] != "eval" or e["step"] == 4] + rising
    (record / cb.RECORD_LOG).write_bytes(gzip.compress("".join(json.dumps(e) + "\n" for e in log).encode()))
    assert not cb.guard_idle(record)
    res = runner.invoke(app, [*args, "--report", "--out", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    assert [r["setting"] for r in json.loads(res.stdout)["runs"]] == ["baseline"]
    assert "on_overfit continue -> cool-down" in res.output


def test_a_record_trained_under_an_earlier_guard_stands_and_is_named(corpora, tmp_path):
    """The recipe restores a record whose plan is today's even where today's guard would have
    reacted on it (its log rewritten to rise while the train slice falls, with no reaction),
    keeps it in the tables, and says so."""
    args = ["recipe", "corpora-benchmark", "--corpora", str(corpora), "--only", "fortunes-ru",
            "--seeds", "1", "--max-steps", "4", "--hidden", "16", "--embed", "8", "--batch-size", "4",
            "--bptt", "16", "--record", str(tmp_path / "record"), "--json"]
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    assert "earlier overfitting guard" not in res.output
    record = tmp_path / "record" / "fortunes-ru" / "defaults-seed1"
    assert json.loads((record / "config.json").read_text())["train"]["on_overfit"] == "cool-down"
    log = [json.loads(line) for line in gzip.decompress((record / cb.RECORD_LOG).read_bytes()).splitlines()]
    rising = [{"event": "eval", "step": s, "valid_bpc": v, "train_slice_bpc": t}
              for s, (v, t) in enumerate(RISING, 1)]
    log = [e for e in log if e["event"] != "eval" or e["step"] == 4] + rising
    (record / cb.RECORD_LOG).write_bytes(gzip.compress("".join(json.dumps(e) + "\n" for e in log).encode()))
    res = runner.invoke(app, [*args, "--report", "--out", str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    assert sorted(r["setting"] for r in json.loads(res.stdout)["runs"]) == ["baseline", "defaults"]
    assert ("defaults-seed1 was trained under an earlier overfitting guard (the guard now reacts at step 3; "
            "this run's never did): it stands as trained") in " ".join(res.output.split())


def stored_run(root: pathlib.Path, name: str, on_overfit: str, history, reacted: int | None = None,
               gzipped: bool = False) -> pathlib.Path:
    """A run dir (or, gzipped, a record) holding only what `guard_moved` reads: config.json's
    train.on_overfit and the log's eval events (steps 1, 2, ...) and its overfit event."""
    run = root / name
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"train": {"on_overfit": on_overfit}}))
    events = [{"event": "start", "step": 0}]
    for step, (valid, train) in enumerate(history, 1):
        events.append({"event": "eval", "step": step, "valid_bpc": valid, "train_slice_bpc": train})
        if step == reacted:
            events.append({"event": "overfit", "step": step})
    text = "".join(json.dumps(e) + "\n" for e in events)
    if gzipped:
        (run / cb.RECORD_LOG).write_bytes(gzip.compress(text.encode()))
    else:
        (run / "metrics.jsonl").write_text(text)
    return run


RISING = [(5.0, 4.9), (5.2, 4.8), (5.5, 4.7)]  # the guard reacts at the third validation (step 3)
FALLING = [(5.0, 4.9), (4.9, 4.8), (4.8, 4.7), (4.7, 4.6)]


def test_guard_moved_tells_a_run_trained_under_another_guard(tmp_path):
    """`stale` compares plans; `guard_moved` replays today's guard over a run's validations
    (up to its own reaction) and says where the two part."""
    assert cb.first_overfit(RISING) == 2
    agree = [stored_run(tmp_path, "same-reaction", "cool-down", RISING + [(5.1, 4.8)], reacted=3),
             stored_run(tmp_path, "never", "cool-down", FALLING, gzipped=True),
             stored_run(tmp_path, "no-guard", "continue", RISING + [(5.6, 4.6)]),
             # its last validation ends the run either way: the guard reacting there changes nothing
             stored_run(tmp_path, "at-the-end", "cool-down", RISING)]
    assert [cb.guard_moved(r) for r in agree] == ["", "", "", ""]
    assert cb.guard_moved(stored_run(tmp_path, "missed", "cool-down", RISING + [(5.6, 4.6)], gzipped=True)) == \
        "the guard now reacts at step 3; this run's never did"
    assert cb.guard_moved(stored_run(tmp_path, "late", "cool-down", RISING + [(5.6, 4.6)], reacted=4)) == \
        "the guard now reacts at step 3; this run's reacted at 4"
    assert cb.guard_moved(stored_run(tmp_path, "early", "cool-down", FALLING, reacted=2)) == \
        "the guard now does not react by step 2, where this run's did"


def test_the_report_says_how_the_streams_started_and_flags_a_mix():
    """A record's protocol line says whether its streams read context (docs/inference.md,
    "Stream context"); every record of the leave-one-corpus-out benchmark was scored before
    there was any, as docs/results.md says, and a table that mixes the two is flagged."""
    records = pathlib.Path(__file__).resolve().parents[2] / "docs" / "records" / "defaults-loco"
    recorded = [json.loads(p.read_text()) for p in sorted(records.glob("*/*/results.json"))]
    assert len(recorded) > 60
    cold = "every stream started from a zero state (scored before --stream-context)"
    assert {cb.stream_start(r["protocol"]) for r in recorded} == {cold}
    warm = ("16 parallel streams of 3,485 predictions, each after the first from the 256 tokens before "
            "it (context, not scored), state carried across 256-token windows, never reset; 55,769 predictions")
    assert cb.stream_start(warm) == cb.stream_start(warm.replace("256", "40")) == (
        "each stream after the first read the tokens before it as context")
    assert cb.stream_start("1 parallel streams of 55,769 predictions, state carried") == "one stream"
    rows = [{"corpus": "c", "setting": s, "seed": 1, "protocol": p}
            for s, p in (("defaults", warm), ("baseline", recorded[0]["protocol"]))]
    assert cb.protocol_lines(rows[:1]) == [
        "Evaluation streams: each stream after the first read the tokens before it as context.", ""]
    (mixed, _) = cb.protocol_lines(rows + rows[:1])  # a run listed twice is named once
    assert mixed.startswith("**The runs were scored under different protocols**")
    assert mixed.endswith(f"as context: c/defaults-seed1; {cold}: c/baseline-seed1.")


def test_the_guard_has_moved_on_exactly_the_record_the_docs_name():
    """Replayed over every recorded run of the leave-one-corpus-out benchmark, today's guard
    parts from the guard the run trained under on one run only: fortunes-zh's window-grid
    run at the data-rich window, trained before the drift test, which would react at its 9th
    of 10 validations (docs/defaults-rule.md: "The records under the drift test"). A change
    of the guard's test that moves any other record fails here until the docs say so."""
    records = pathlib.Path(__file__).resolve().parents[2] / "docs" / "records" / "defaults-loco"
    runs = sorted(records.glob("*/*"))
    assert len(runs) > 60
    moved = {f"{r.parent.name}/{r.name}": cb.guard_moved(r) for r in runs}
    assert {k: v for k, v in moved.items() if v} == {
        "fortunes-zh/window-data-rich-zc0.1-seed1": "the guard now reacts at step 5130; this run's never did"}


def test_record_log_drops_step_lines_and_thins_train_lines(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    events = [{"event": "start", "step": 0}]
    for step in range(1, 2001):
        events.append({"event": "step", "step": step, "loss": 1.0})
        if step % 2 == 0:
            events.append({"event": "train", "step": step, "train_bpc": 3.0 - step / 1000, "elapsed": step / 10})
        if step % 500 == 0:
            events.append({"event": "eval", "step": step, "valid_bpc": 2.0})
    events.append({"event": "finish", "step": 2000, "elapsed_s": 200.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    cb.save_record(run, tmp_path / "record")
    kept = [json.loads(line) for line in gzip.decompress((tmp_path / "record" / cb.RECORD_LOG).read_bytes()).splitlines()]
    kinds = [e["event"] for e in kept]
    assert "step" not in kinds and kinds.count("eval") == 4 and kinds[0] == "start" and kinds[-1] == "finish"
    train = [e["step"] for e in kept if e["event"] == "train"]
    assert 250 <= len(train) <= cb.RECORD_TRAIN_POINTS and train[-1] == 2000  # the last train line is kept
    assert len(set(b - a for a, b in zip(train, train[1:], strict=False))) == 1  # evenly spaced

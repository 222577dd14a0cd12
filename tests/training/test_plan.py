"""The one path from options to a run: `plan` -> RunSpec -> config.json -> `read_spec`.

tests/fixtures/plans.json holds the configs and the defaults rule's decision that
`zlm train` planned for eight sources and option sets (the speed probe fixed at 14,000
tokens/s at 1x512), first recorded with the code before `plan` existed and re-recorded on
purpose when the rule changed (its zoneout ramp, weight averaging, overfitting guard, the
window ramp's ends, its start line under --bptt, the validation sample of a run under
one pass: the field eval_tokens, 0 in the plans it leaves alone; and the second reading of
a small model, which changed only the start lines of the four plans below 1x512, since the
fixture's small model runs at the speed parameter scaling predicts); the same inputs must
plan the same run.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zlm.cli import app
from zlm.core.config import Options, fields_of_options
from zlm.core.spec import FORMAT, RunSpec, read_spec
from zlm.errors import CheckpointError, UsageError
from zlm.training import defaults, speed_probe
from zlm.training.plan import plan

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "plans.json"


def _text(n: int, seed: int) -> str:
    """The recorded sources: random words from a seeded generator (as when plans.json was made)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9))) for _ in range(500)]
    out, size = [], 0
    while size < n:
        w = rng.choice(words) + rng.choice("  \n,. ")
        out.append(w)
        size += len(w)
    return "".join(out)[:n]


@pytest.mark.parametrize("name", sorted(json.loads(FIXTURE.read_text())))
def test_the_same_source_options_and_speed_give_the_recorded_plan(name, tmp_path, monkeypatch):
    case = json.loads(FIXTURE.read_text())[name]
    monkeypatch.setattr(speed_probe, "probe_tokens_per_s", _proportional)
    src = tmp_path / f"{name}.txt"
    src.write_text(_text(case["chars"], case["chars"]), encoding="utf-8")
    spec = plan(src, Options(**case["options"]), out=tmp_path / "run").spec
    assert asdict(spec.model) == case["model"]
    assert asdict(spec.train) == case["train"]
    rule = spec.rule
    assert {"regime": rule.regime, "expected_epochs": rule.expected_epochs, "line": rule.line} == case["rule"]


def _proportional(model, train, **_) -> float:
    """The fixture's probe: 14,000 tokens/s at 1x512, and a smaller model faster in
    proportion to its parameters (so the rule's second reading, where it takes one, says
    what parameter scaling predicted, and the plan is the one-reading plan)."""
    def count(hidden: int) -> int:
        return defaults.parameters(model.vocab_size, hidden, model.embed, model.layers)
    return 14_000.0 * count(512) / count(model.hidden)


def _tiny(tmp_path) -> Path:
    src = tmp_path / "tiny.txt"
    src.write_text(_text(20_000, 5), encoding="utf-8")
    return src


TINY = Options(hidden=16, embed=8, batch_size=4, bptt=10, max_steps=2, eval_every=2, eval_streams=2,
               device="cpu", log_every=1)


def test_config_json_is_the_spec_and_reads_back_equal(tmp_path):
    from zlm.training.runner import run

    planned = plan(_tiny(tmp_path), TINY, out=tmp_path / "run")
    run(planned)
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert stored == planned.spec.to_dict() and stored["format"] == FORMAT
    assert read_spec(tmp_path / "run") == planned.spec
    for ck in (tmp_path / "run" / "checkpoints").iterdir():
        assert read_spec(ck) == planned.spec
    assert read_spec(tmp_path / "run" / "best") == planned.spec


@pytest.mark.parametrize("fmt, needle", [(None, "has no format number"), (FORMAT + 1, f"is format {FORMAT + 1}")])
def test_a_run_of_another_format_is_refused_in_one_line(tmp_path, fmt, needle):
    from zlm.training.runner import run

    run(plan(_tiny(tmp_path), TINY, out=tmp_path / "run"))
    for where in (tmp_path / "run", *sorted((tmp_path / "run").glob("checkpoints/*")), tmp_path / "run" / "best"):
        config = json.loads((where / "config.json").read_text())
        config.pop("format") if fmt is None else config.update(format=fmt)
        (where / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=needle) as e:
        read_spec(tmp_path / "run")
    assert "\n" not in str(e.value) and f"reads format {FORMAT}" in str(e.value)
    r = CliRunner().invoke(app, ["train", str(_tiny(tmp_path)), "--out", str(tmp_path / "run"), "--resume"])
    assert r.exit_code != 0 and needle in r.output
    # A checkpoint's manifest covers config.json, so eval refuses the edit before reading it;
    # either way nothing is evaluated and the message is one line.
    r = CliRunner().invoke(app, ["eval", str(tmp_path / "run")])
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1


def test_resume_keeps_the_model_and_takes_new_training_settings(tmp_path):
    from zlm.training.runner import run

    src = _tiny(tmp_path)
    first = plan(src, TINY | Options(hidden=24), out=tmp_path / "run")
    run(first)
    # Nothing given again: the stored spec, the checkpoint to continue from.
    again = plan(src, Options(), out=tmp_path / "run", resume=True)
    assert again.spec == first.spec and again.resume_from.name == "step-00000002"
    longer = plan(src, Options(max_steps=4), out=tmp_path / "run", resume=True)
    assert longer.spec == replace(first.spec, train=replace(first.spec.train, max_steps=4))
    with pytest.raises(UsageError, match=r"--hidden 32 differs from this run's 24"):
        plan(src, Options(hidden=32), out=tmp_path / "run", resume=True)
    with pytest.raises(UsageError, match="started with --preset cpu-small"):
        plan(src, Options(), out=tmp_path / "run", resume=True, preset="zoneout-ptb-char")


def test_spec_round_trips_through_its_dict(tmp_path, monkeypatch):
    monkeypatch.setattr(speed_probe, "probe_tokens_per_s", lambda *a, **k: 14_000.0)
    spec = plan(_tiny(tmp_path), Options(time_budget=60.0), out=tmp_path / "run").spec
    assert spec.rule is not None and spec.rule.settings.hidden is not None
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_replay_decides_the_rule_again_at_the_measured_speed_without_probing(tmp_path, monkeypatch):
    """`replay`: the spec a fresh plan gives now, at the stored run's measured speed; equal
    while nothing changed, different once the rule changes, None for a CUDA decision."""
    from zlm.data.dataset import Dataset
    from zlm.training.plan import replay

    monkeypatch.setattr(speed_probe, "probe_tokens_per_s", lambda *a, **k: 14_000.0)
    planned = plan(_tiny(tmp_path), Options(time_budget=60.0, seed=3), out=tmp_path / "run")
    data = Dataset.open(tmp_path / "run" / "data")

    def no_probe(*a, **k):
        raise AssertionError("replay must not probe")

    monkeypatch.setattr(speed_probe, "probe_tokens_per_s", no_probe)
    again = replay(planned.spec, data, Options(time_budget=60.0, seed=3))
    assert (again.model, again.train, again.rule) == (planned.spec.model, planned.spec.train, planned.spec.rule)
    assert planned.spec.rule.small_hidden == defaults.SMALL_PROBE_HIDDEN  # this plan took a second reading
    slower = replace(planned.spec, rule=replace(planned.spec.rule, tokens_per_s=20.0, small_tokens_per_s=20.0))
    assert replay(slower, data, Options(time_budget=60.0, seed=3)).train != planned.spec.train
    # A run planned before the rule timed a small model cannot be told: its reading is missing.
    one_reading = replace(planned.spec, rule=replace(planned.spec.rule, small_hidden=None, small_tokens_per_s=None))
    assert replay(one_reading, data, Options(time_budget=60.0, seed=3)) is None
    monkeypatch.setattr(defaults, "AVERAGE_SHARE", 0.5)
    changed = replay(planned.spec, data, Options(time_budget=60.0, seed=3))
    assert changed.train == replace(planned.spec.train, average=0.5) and changed.model == planned.spec.model
    cuda = replace(planned.spec, rule=replace(planned.spec.rule, settings=planned.spec.rule.settings
                                              | Options(batch_size=128)))
    assert replay(cuda, data, Options(time_budget=60.0, seed=3)) is None
    # A run planned with a preset replays that preset's configs.
    preset_run = plan(_tiny(tmp_path), TINY, out=tmp_path / "preset", preset="cpu-small").spec
    assert replay(preset_run, data, TINY).train == preset_run.train


def _help(*args: str) -> str:
    r = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "400", "NO_COLOR": "1", "TERM": "dumb"})
    assert r.exit_code == 0, r.output
    return r.output


def test_train_help_says_every_default():
    """Each option of `zlm train` shows its default or says that the defaults rule chooses it."""
    text = _help("train")
    rows = [line for line in text.splitlines() if re.search(r"^\W*--[a-z]", line)]
    options = [re.search(r"--[a-z-]+", row).group() for row in rows]
    assert {"--hidden", "--lr", "--bptt", "--eval-every", "--time-budget", "--precision"} <= set(options)
    missing = [o for o, row in zip(options, rows, strict=True) if o != "--help" and "[default:" not in row]
    assert not missing, f"options without a stated default: {missing}"
    hidden = next(row for row in rows if "--hidden " in row)
    assert "512" in hidden and "defaults rule" in hidden
    lr = next(row for row in rows if "--lr " in row)
    assert "0.003" in lr and "0.005 when regularising, 0.004 when data-rich" in lr
    # Every rule-chosen field says so.
    from zlm.training.defaults import RULED

    for name in RULED:
        row = next(row for row in rows if f"--{name.replace('_', '-')} " in row)
        assert "defaults rule" in row, row


def test_every_train_option_is_an_options_field():
    """The CLI's options are Options' fields (plus the run-level ones that are not settings)."""
    import inspect

    from zlm.cli import train as cli_train

    params = set(inspect.signature(cli_train.command).parameters)
    run_level = {"source", "out", "resume", "preset", "nproc", "sample", "mirror", "unknown", "init_from"}
    assert params - run_level <= fields_of_options()


def test_the_python_api_trains_through_the_same_plan(tmp_path):
    import zlm

    outcome = zlm.train(_tiny(tmp_path), out=tmp_path / "api", **TINY.given())
    assert outcome.summary["step"] == 2 and outcome.interrupted is None
    assert read_spec(tmp_path / "api") == plan(_tiny(tmp_path), TINY, out=tmp_path / "api", resume=True).spec
    assert zlm.load(tmp_path / "api").sample(length=5, seed=1)
    with pytest.raises(UsageError, match="unknown option"):
        zlm.train(_tiny(tmp_path), out=tmp_path / "bad", hiden=16)


@pytest.mark.parametrize("args, needle", [
    (["--time-budget", "0s"], "--time-budget must be > 0"),
    (["--hidden", "0"], "--hidden must be >= 1"),
    (["--reset-prob", "1"], "--reset-prob must be in [0, 1)"),
    (["--optimizer", "lion"], "unknown optimizer 'lion'"),
    (["--preset", "nope"], "unknown preset 'nope'"),
])
def test_a_bad_option_value_is_refused_before_anything_is_written(tmp_path, monkeypatch, args, needle):
    """The run directory (and the data prepared into it) would be left behind, and the next
    try would get the next free name."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text(_text(5000, 1), encoding="utf-8")
    res = CliRunner().invoke(app, ["train", "corpus.txt", *args])
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines()[-1].startswith("error:") and needle in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]

"""End to end through the CLI: prepare -> train a few steps -> checkpoint -> resume."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from conftest import shakespeare_text
from zlm.cli import app
from zlm.core.metrics import read_metrics

runner = CliRunner()
SMALL = ["--hidden", "32", "--embed", "8", "--batch-size", "4", "--bptt", "20", "--log-every", "2",
         "--eval-every", "4"]


def test_prepare_train_checkpoint_resume(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text(shakespeare_text(40_000), encoding="utf-8")
    data = tmp_path / "data"
    r = runner.invoke(app, ["prepare", str(text), "--out", str(data)])
    assert r.exit_code == 0, r.output
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", str(data), "--out", str(run), "--max-steps", "4", *SMALL])
    assert r.exit_code == 0, r.output
    assert "no --preset given: cpu-small with the defaults rule" in r.output
    assert (run / "checkpoints" / "step-00000004" / "checkpoint.json").exists()
    assert (run / "best" / "model.safetensors").exists()
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"]["hidden"] == 32 and cfg["train"]["max_steps"] == 4
    assert cfg["train"]["reset_prob"] == 0.02  # the rule's (4 steps: data-rich)
    assert cfg["defaults_rule"]["regime"] == "data-rich" and cfg["model"]["zoneout_cell"] == 0.0

    r = runner.invoke(app, ["train", str(data), "--out", str(tmp_path / "bad"), "--reset-prob", "1.5", *SMALL])
    assert r.exit_code == 2 and "--reset-prob must be in [0, 1), got 1.5" in r.output
    assert not (tmp_path / "bad").exists()

    # Same command line again without --resume: refused, nothing touched.
    r = runner.invoke(app, ["train", str(data), "--out", str(run), "--max-steps", "4", *SMALL])
    assert r.exit_code == 2 and "--resume" in r.output
    r = runner.invoke(app, ["train", str(data), "--out", str(run), "--max-steps", "8", "--resume", *SMALL])
    assert r.exit_code == 0, r.output
    assert "resumed from" in r.output
    steps = [e["step"] for e in read_metrics(run / "metrics.jsonl") if e["event"] == "step"]
    assert steps == list(range(1, 9))


def test_train_raw_text_file_prepares_on_the_fly(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text(shakespeare_text(30_000), encoding="utf-8")
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", str(text), "--out", str(run), "--max-steps", "2", *SMALL])
    assert r.exit_code == 0, r.output
    assert (run / "data" / "dataset.json").exists()
    assert (run / "checkpoints" / "step-00000002").is_dir()


def test_train_bad_options_are_one_line_usage_errors(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text(shakespeare_text(30_000), encoding="utf-8")
    for args, needle in [
        (["--zoneout-cell", "1.5"], "--zoneout-cell must be in [0, 1)"),
        (["--preset", "nope"], "unknown preset"),
        (["--time-budget", "soon"], "cannot read duration"),
        (["--cell", "magic"], "unknown cell"),
    ]:
        r = runner.invoke(app, ["train", str(text), "--out", str(tmp_path / "r"), *args])
        assert r.exit_code == 2, (args, r.output)
        assert needle in r.output
        assert "Traceback" not in r.output
    r = runner.invoke(app, ["train", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "r2")])
    assert r.exit_code in (1, 2) and "Traceback" not in r.output
    assert r.output.strip().startswith("error:")


def test_train_a_text_whose_valid_split_has_characters_train_lacks(tmp_path):
    """`zlm train FILE` works on any UTF-8 text without flags: the vocabulary is the whole
    file's; --unknown error gives a one-line error whose suggested fix zlm train accepts."""
    body = shakespeare_text(20_000)
    text = tmp_path / "quotes.txt"
    text.write_text(body + "Über café naïve — ü\n" * 40, encoding="utf-8")  # only in valid/test
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", str(text), "--out", str(run), "--max-steps", "2", *SMALL])
    assert r.exit_code == 0, r.output
    vocab = json.loads((run / "data" / "tokenizer.json").read_text())
    assert "ü" in json.dumps(vocab, ensure_ascii=False)
    r = runner.invoke(app, ["train", str(text), "--out", str(tmp_path / "strict"), "--unknown", "error",
                            "--max-steps", "2", *SMALL])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "never occurs in the train split; pass --unknown replace" in r.output
    r = runner.invoke(app, ["train", str(text), "--out", str(tmp_path / "replaced"), "--unknown", "replace",
                            "--max-steps", "2", *SMALL])
    assert r.exit_code == 0, r.output


def test_every_flag_an_error_message_suggests_exists(tmp_path):
    """No message in the code base suggests an option that no zlm command has."""
    import pathlib
    import re

    import typer.main

    root = pathlib.Path(__file__).resolve().parents[2]
    click_app = typer.main.get_command(app)
    options = set()
    for cmd in click_app.commands.values():
        for p in cmd.params:
            options.update(o for o in p.opts + p.secondary_opts if o.startswith("--"))
    options.update(o for p in click_app.params for o in p.opts if o.startswith("--"))
    mentioned = {}
    for path in [*root.glob("zlm/**/*.py"), *root.glob("cli/*.py")]:
        for line in path.read_text(encoding="utf-8").splitlines():
            if "torchrun" in line:  # torchrun's own flags (--max-restarts, --nproc-per-node)
                continue
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", line):
                mentioned.setdefault(flag, path.name)
    options.add("--help")  # click adds it to every command outside params
    missing = {f: where for f, where in mentioned.items() if f not in options}
    assert not missing, f"flags mentioned but no command has them: {missing}"

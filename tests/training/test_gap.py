"""The generalisation gap: at each validation the trainer also scores a fixed sample of the
train split in eval mode, spread over it; valid minus that is shown live, logged, and read by
info/compare."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from conftest import shakespeare_text
from zlm.cli import app
from zlm.core.config import Options
from zlm.core.eval_protocol import EvalProtocol, evaluate_tokens
from zlm.core.metrics import read_metrics
from zlm.data.dataset import Dataset
from zlm.inference.load import load_model
from zlm.training.plan import plan
from zlm.training.runner import run
from zlm.training.trainer import GAP_TOKENS, describe_plan


def test_the_gap_is_valid_minus_a_fixed_train_slice_in_eval_mode(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text(shakespeare_text(40_000), encoding="utf-8")
    options = Options(hidden=32, embed=8, batch_size=4, bptt=16, max_steps=12, eval_every=6, eval_streams=2,
                      device="cpu", precision="fp32", log_every=3)
    planned = plan(src, options, out=tmp_path / "run", preset="cpu-small")
    run(planned)
    evals = [e for e in read_metrics(tmp_path / "run" / "metrics.jsonl") if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [6, 12]
    for e in evals:
        assert e["gap"] == e["valid_bpc"] - e["train_slice_bpc"]
    # The last validation's train slice, scored again from the checkpoint of that step.
    data = Dataset.open(planned.spec.data.path)
    n = min(GAP_TOKENS, data.split_info("valid").tokens // 2, data.split_info("train").tokens)
    lm = load_model(tmp_path / "run" / "checkpoints" / "step-00000012", device="cpu")
    info = data.split_info("train")
    assert info.tokens > 4 * n  # a sample spread over the split, not all of it
    again = evaluate_tokens(lm.model, data.tokens("train"), data.tokenizer, info.characters, info.bytes, lm.runtime,
                            EvalProtocol(2, sample=n))
    assert again.tokens == n and abs(again.bpc - evals[-1]["train_slice_bpc"]) < 1e-5
    r = CliRunner().invoke(app, ["eval", str(tmp_path / "run" / "checkpoints" / "step-00000012"), "--split", "train",
                                 "--eval-tokens", str(n), "--batch-size", "2", "--json"])
    assert r.exit_code == 0, r.output
    cli = json.loads(r.output)  # zlm eval reproduces it
    assert cli["tokens"] == n and abs(cli["bpc"] - evals[-1]["train_slice_bpc"]) < 1e-5
    assert "--eval-tokens" in cli["protocol"]
    first = evaluate_tokens(lm.model, data.tokens("train")[:n + 1], data.tokenizer, n + 1, n + 1, lm.runtime,
                            EvalProtocol(2)).bpc
    assert abs(first - again.bpc) > 1e-4  # and not the split's first tokens
    # Shown by zlm info (the checkpoint's trainer state) and zlm compare.
    r = CliRunner().invoke(app, ["info", str(tmp_path / "run" / "checkpoints" / "step-00000012")])
    assert r.exit_code == 0 and "generalisation gap" in r.output and f"{evals[-1]['gap']:+.4f}" in r.output
    # zlm info RUN names best/: the gap at the best validation's step.
    best = min(evals, key=lambda e: e["valid_bpc"])
    r = CliRunner().invoke(app, ["info", str(tmp_path / "run")])
    assert r.exit_code == 0 and "best" in r.output and f"{best['gap']:+.4f}" in r.output
    # A best/ written before trainer.json kept the slice: the run's log has it.
    trainer = tmp_path / "run" / "best" / "trainer.json"
    size = trainer.stat().st_size  # the manifest records it: pad the older form to the same size
    old = json.dumps({k: v for k, v in json.loads(trainer.read_text()).items() if k != "train_slice_bpc"})
    trainer.write_text(old.ljust(size))
    r = CliRunner().invoke(app, ["info", str(tmp_path / "run"), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["train_slice_bpc"] == best["train_slice_bpc"]
    (tmp_path / "run" / "metrics.jsonl").rename(tmp_path / "metrics.jsonl")  # and without a log: no gap
    r = CliRunner().invoke(app, ["info", str(tmp_path / "run")])
    assert r.exit_code == 0 and "generalisation gap" not in r.output
    (tmp_path / "metrics.jsonl").rename(tmp_path / "run" / "metrics.jsonl")
    r = CliRunner().invoke(app, ["compare", str(tmp_path / "run"), "--json"])
    assert r.exit_code == 0
    assert json.loads(r.output)["runs"][0]["gap"] == evals[-1]["gap"]


def test_the_plain_display_prints_the_gap(capsys):
    from zlm.core.reporter import PlainReporter

    PlainReporter().eval({"step": 5, "valid_bpc": 2.5, "valid_ppl": 5.6, "best_bpc": 2.5,
                          "train_slice_bpc": 2.25, "gap": 0.25})
    assert "gap +0.2500 (valid - train slice 2.2500)" in capsys.readouterr().out


def test_with_eval_tokens_validation_and_the_train_slice_score_a_sample(tmp_path):
    # --eval-tokens: each validation scores the same sample of the valid split (its streams'
    # first pieces), best/ and the gap follow it, and the train slice is at most half of it.
    src = tmp_path / "t.txt"
    src.write_text(shakespeare_text(40_000), encoding="utf-8")
    options = Options(hidden=32, embed=8, batch_size=4, bptt=16, max_steps=12, eval_every=6, eval_streams=2,
                      eval_tokens=300, device="cpu", precision="fp32", log_every=3)
    planned = plan(src, options, out=tmp_path / "run", preset="cpu-small")
    run(planned)
    evals = [e for e in read_metrics(tmp_path / "run" / "metrics.jsonl") if e["event"] == "eval"]
    assert [(e["step"], e["tokens"], e["characters"]) for e in evals] == [(6, 300, 300), (12, 300, 300)]
    data = Dataset.open(planned.spec.data.path)
    valid = data.split_info("valid")
    assert valid.tokens > 1000  # a sample, not the whole split
    assert f"validation on 300 of the valid split's {valid.tokens:,} tokens" in describe_plan(
        planned.spec.train, 12, 100, valid.tokens)
    lm = load_model(tmp_path / "run" / "checkpoints" / "step-00000012", device="cpu")
    again = evaluate_tokens(lm.model, data.tokens("valid"), data.tokenizer, valid.characters, valid.bytes,
                            lm.runtime, EvalProtocol(2, sample=300))
    assert abs(again.bpc - evals[-1]["valid_bpc"]) < 1e-5
    n = 150  # the train slice: half the sample
    info = data.split_info("train")
    slice_bpc = evaluate_tokens(lm.model, data.tokens("train"), data.tokenizer, info.characters, info.bytes,
                                lm.runtime, EvalProtocol(2, sample=n)).bpc
    assert info.characters == info.tokens and abs(slice_bpc - evals[-1]["train_slice_bpc"]) < 1e-5
    r = CliRunner().invoke(app, ["info", str(tmp_path / "run")])
    assert r.exit_code == 0 and "(on a 300-token sample of the valid split; zlm eval scores all of it)" in r.output


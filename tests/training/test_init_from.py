"""`zlm train --init-from`: a new run from a trained model's weights, shape and tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import shakespeare_text
from zlm.cli import app
from zlm.core.config import Options
from zlm.core.metrics import read_metrics
from zlm.core.spec import read_spec
from zlm.errors import DataError, UsageError
from zlm.inference.load import load_model
from zlm.training.plan import plan
from zlm.training.runner import run
from zlm.training.trainer import Trainer

TINY = Options(hidden=24, embed=8, batch_size=4, bptt=12, eval_every=4, eval_streams=2, device="cpu",
               precision="fp32", log_every=1)
NEW = "Ωμέγα — ünïcode ✓\n"  # characters tiny Shakespeare lacks


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    root = tmp_path_factory.mktemp("parent")
    src = root / "a.txt"
    src.write_text(shakespeare_text(20_000), encoding="utf-8")
    run(plan(src, TINY | Options(max_steps=4), out=root / "run", preset="cpu-small"))
    return root / "run"


def _child_text(tmp_path, extra: str = NEW) -> str:
    src = tmp_path / "b.txt"
    src.write_text((shakespeare_text(30_000)[20_000:] + extra) * 2, encoding="utf-8")
    return src


def test_the_child_starts_where_the_parent_is_and_records_it(parent, tmp_path):
    planned = plan(_child_text(tmp_path), TINY | Options(max_steps=2), out=tmp_path / "child",
                   preset="cpu-small", init_from=parent)
    spec, mother = planned.spec, read_spec(parent / "best")
    assert (spec.model.hidden, spec.model.embed) == (24, 8)
    assert spec.model.vocab_size == mother.model.vocab_size + len(set(NEW) - set(shakespeare_text(30_000)))
    from zlm.core.checkpoint import MANIFEST

    manifest = json.loads((parent / "best" / MANIFEST).read_text())
    assert spec.parent.path == str((parent / "best").resolve())
    assert spec.parent.model_sha256 == manifest["files"]["model.safetensors"]["sha256"]
    # Before any step the child predicts the old characters as the parent does.
    child = Trainer(planned).model.eval()
    old = load_model(parent, device="cpu")
    text = shakespeare_text(500)
    x_old = torch.as_tensor(old.tokenizer.encode(text))[:, None]  # (T, 1)
    x_new = torch.as_tensor(Trainer(planned).data.tokenizer.encode(text))[:, None]
    with torch.no_grad():
        lp_old = torch.log_softmax(old.model(x_old)[0].float(), -1)  # (T, 1, V_old)
        lp_new = torch.log_softmax(child(x_new)[0].float(), -1)  # (T, 1, V_new)
    new_chars = Trainer(planned).data.tokenizer.chars
    cols = torch.tensor([new_chars.index(c) for c in old.tokenizer.chars])
    assert torch.allclose(lp_new[..., cols], lp_old, atol=1e-6)
    assert lp_new.exp()[..., [i for i in range(len(new_chars)) if i not in cols.tolist()]].sum() < 1e-6
    # Training and recording.
    run(planned)
    assert read_spec(tmp_path / "child").parent == spec.parent
    r = CliRunner().invoke(app, ["info", str(tmp_path / "child")])
    assert r.exit_code == 0 and str(parent / "best") in r.output.replace("\n", "")


def test_a_parent_that_changed_after_planning_is_refused(parent, tmp_path):
    from dataclasses import replace

    from zlm.errors import CheckpointError

    planned = plan(_child_text(tmp_path), TINY | Options(max_steps=2), out=tmp_path / "c", preset="cpu-small",
                   init_from=parent)
    moved = replace(planned, spec=replace(planned.spec, parent=replace(planned.spec.parent, model_sha256="0" * 64)))
    with pytest.raises(CheckpointError, match="has changed since this run was planned"):
        Trainer(moved)


def test_a_shape_option_that_differs_is_refused(parent, tmp_path):
    with pytest.raises(UsageError, match=r"--hidden 32 differs from the 24 of the model in --init-from"):
        plan(_child_text(tmp_path), TINY | Options(hidden=32, max_steps=2), out=tmp_path / "c", init_from=parent)


def test_new_characters_refused_or_replaced_as_asked(parent, tmp_path):
    with pytest.raises(DataError, match="not in the vocabulary of the model trained from"):
        plan(_child_text(tmp_path), TINY | Options(max_steps=2), out=tmp_path / "c", init_from=parent,
             unknown="error", preset="cpu-small")
    replaced = plan(_child_text(tmp_path), TINY | Options(max_steps=2), out=tmp_path / "d", init_from=parent,
                    unknown="replace", preset="cpu-small").spec
    assert replaced.model.vocab_size == read_spec(parent / "best").model.vocab_size + 1  # U+FFFD


def test_a_fine_tuned_run_resumes_exactly(parent, tmp_path):
    src = _child_text(tmp_path)

    def losses(run_dir):
        return [e["loss"] for e in read_metrics(run_dir / "metrics.jsonl") if e["event"] == "step"]

    run(plan(src, TINY | Options(max_steps=8), out=tmp_path / "whole", preset="cpu-small", init_from=parent))
    run(plan(src, TINY | Options(max_steps=4), out=tmp_path / "half", preset="cpu-small", init_from=parent))
    run(plan(src, Options(max_steps=8), out=tmp_path / "half", resume=True))
    assert losses(tmp_path / "half")[-4:] == losses(tmp_path / "whole")[-4:]
    assert len(losses(tmp_path / "whole")) == 8


def test_the_cli_flag(parent, tmp_path):
    r = CliRunner().invoke(app, ["train", str(_child_text(tmp_path)), "--init-from", str(parent), "--out",
                                 str(tmp_path / "cli"), "--max-steps", "2", "--batch-size", "4", "--bptt", "12",
                                 "--eval-every", "2", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "initialised from" in r.output and read_spec(tmp_path / "cli").parent is not None
    r = CliRunner().invoke(app, ["train", str(_child_text(tmp_path)), "--init-from", str(parent), "--out",
                                 str(tmp_path / "cli2"), "--layers", "2", "--max-steps", "2"])
    assert r.exit_code != 0 and "--layers 2 differs" in r.output

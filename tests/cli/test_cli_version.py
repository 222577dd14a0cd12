"""`zlm --version` and Typer's shell completion options."""

from __future__ import annotations

import platform

import torch
from typer.testing import CliRunner

from zlm.cli import app
from zlm.model.cells import choose_cell
from zlm.version import __version__

runner = CliRunner()


def test_version_names_versions_device_cell_and_precision():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0] == f"zlm {__version__}" and lines[1] == f"torch {torch.__version__}"
    assert lines[2].startswith(f"Python: {platform.python_version()}")
    keys = [line.split(":")[0] for line in lines[2:]]
    assert keys == ["Python", "device", "cell", "precision"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    assert lines[3].startswith(f"device: {dev}")
    assert lines[4].startswith(f"cell: {choose_cell('auto', dev).name}: ")
    assert "for training with --precision auto" in lines[5]


def test_shell_completion_is_offered():
    help_text = runner.invoke(app, ["--help"]).output
    assert "--install-completion" in help_text and "--show-completion" in help_text
    res = runner.invoke(app, ["--show-completion", "bash"])
    assert res.exit_code == 0 and "_zlm_completion" in res.output and "complete" in res.output

"""Commands that need no tensors answer without importing torch.

`zlm --help`, every `zlm CMD --help` and `zlm info RUN` each run in a fresh interpreter (in
this one, an earlier test has long imported torch) and must leave torch out of
sys.modules: importing it costs more than a second before anything is printed. The
interpreter's own timings are checked only against generous bounds (CI machines are
loaded); the import check is the test.

Also here: the torch-free parameter shapes that `zlm info` and loading compare a
checkpoint's tensors with are the model's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from cli_tiny_run import train_tiny

from zlm.model.config import ModelConfig
from zlm.model.lm import ZoneoutLM

# Runs in a fresh interpreter: every help page through the app, then what got imported.
HELP_PROBE = """
import json, sys
from typer.main import get_command
from typer.testing import CliRunner
from zlm.cli import app

runner = CliRunner()
names = sorted(get_command(app).commands)
pages = {}
for args in [[]] + [[name] for name in names]:
    res = runner.invoke(app, [*args, "--help"])
    pages[" ".join(["zlm", *args])] = {"exit_code": res.exit_code, "output": res.output}
print(json.dumps({"commands": names, "pages": pages,
                  "heavy": sorted(m for m in ("torch", "numpy", "zlm.training", "zlm.inference.load")
                                  if m in sys.modules)}))
"""

INFO_PROBE = """
import json, sys
from typer.testing import CliRunner
from zlm.cli import app

runner = CliRunner()
plain = runner.invoke(app, ["info", sys.argv[1]])
as_json = runner.invoke(app, ["info", sys.argv[1], "--json"])
print(json.dumps({"plain": [plain.exit_code, plain.output], "json": [as_json.exit_code, as_json.output],
                  "heavy": sorted(m for m in ("torch", "numpy", "zlm.training", "zlm.inference.load")
                                  if m in sys.modules)}))
"""


def _probe(code: str, *args: str, cwd) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         cwd=cwd, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_every_help_page_renders_without_torch(tmp_path):
    found = _probe(HELP_PROBE, cwd=tmp_path)
    assert "torch" not in found["heavy"], f"zlm --help imported {found['heavy']}"
    assert {"train", "eval", "sample", "info", "bench", "recipe"} <= set(found["commands"])
    assert len(found["pages"]) == len(found["commands"]) + 1
    for page, res in found["pages"].items():
        assert res["exit_code"] == 0 and "Usage" in res["output"], (page, res["output"])


def test_help_answers_at_once(tmp_path):
    best = min(_timed([sys.executable, "-m", "zlm", "--help"], tmp_path) for _ in range(2))
    assert best < 5.0, f"zlm --help took {best:.2f} s"  # ~0.2 s unloaded; importing torch alone ~1.5 s


def _timed(cmd: list[str], cwd) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=True, cwd=cwd, timeout=300)
    return time.perf_counter() - start


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("startup"), layers=2)


def test_info_reads_a_run_without_torch(run, tmp_path):
    found = _probe(INFO_PROBE, str(run), cwd=tmp_path)
    assert "torch" not in found["heavy"], f"zlm info imported {found['heavy']}"
    code, text = found["plain"]
    assert code == 0 and "parameters:" in text and "2 x 32 zoneout LSTM" in text, text
    code, text = found["json"]
    info = json.loads(text)
    assert code == 0 and info["checkpoint"] == str(run / "best") and info["mismatches"] == []
    model = ZoneoutLM(ModelConfig(**info["model"]))
    assert info["parameters"] == model.num_parameters()


@pytest.mark.parametrize("config", [
    ModelConfig(vocab_size=65, hidden=32, layers=1, embed=8),
    ModelConfig(vocab_size=7, hidden=16, layers=3, embed=40, zoneout_cell=0.0, dropout=0.2),
])
def test_parameter_shapes_are_the_models(config):
    with torch.device("meta"):
        model = ZoneoutLM(config)
    own = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert config.parameter_shapes() == own
    assert list(config.parameter_shapes()) == list(own)  # and in the same order

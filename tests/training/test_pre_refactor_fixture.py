"""The run directory written by zlm before the architecture change still resumes bit for bit.

tests/fixtures/pre-refactor-run was written by zlm at commit bfa6a2e (5 steps of a tiny
model, see pre-refactor-resume.json for the command). Resuming it for 5 more steps must
log exactly the losses and gradient norms that code logged: the checkpoint format, the
data format, the RNG streams and the training step are all unchanged.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_pre_refactor_run_resumes_bit_for_bit(tmp_path):
    expected = json.loads((FIXTURES / "pre-refactor-resume.json").read_text())
    run = tmp_path / "moved-run"  # relocated: nothing may depend on where it was written
    shutil.copytree(FIXTURES / "pre-refactor-run", run)
    cmd = [sys.executable, "-m", "zlm", "train", str(run / "data"), "--out", str(run), "--resume",
           "--max-steps", "10", *expected["train_options"].split()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {str(e["step"]): e for e in events if e["event"] == "step" and e["step"] > 5}
    assert {k: e["loss"] for k, e in steps.items()} == expected["resumed_step_losses"]
    assert {k: e["grad_norm"] for k, e in steps.items()} == expected["resumed_grad_norms"]
    final = [e for e in events if e["event"] == "eval" and e["step"] == 10]
    assert final[-1]["valid_bpc"] == expected["valid_bpc_step_10"]


def test_a_moved_run_still_evaluates_on_its_own_data(tmp_path):
    """config.json records the absolute data path, which is gone once the run is moved:
    `zlm eval` falls back to RUN_DIR/data."""
    opts = json.loads((FIXTURES / "pre-refactor-resume.json").read_text())["train_options"].split()
    first, moved = tmp_path / "first", tmp_path / "moved"
    proc = subprocess.run([sys.executable, "-m", "zlm", "train", str(FIXTURES / "pre-refactor-tiny.txt"),
                           "--out", str(first), "--max-steps", "2", *opts], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    shutil.move(first, moved)
    recorded = json.loads((moved / "best" / "config.json").read_text())["data"]["path"]
    assert recorded == str(first / "data") and not Path(recorded).exists()
    proc = subprocess.run([sys.executable, "-m", "zlm", "eval", str(moved), "--split", "test", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["characters"] == 149 and 0 < result["bpc"] < 10

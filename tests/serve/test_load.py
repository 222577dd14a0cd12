"""scripts/serve-load, small: 8 clients x 3 short streamed requests against `zlm serve`,
some dropped mid-stream. Every request completes or is dropped, with no errors and no
slot left taken (speed is measured in docs/serve.md, not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from serve_fixtures import tiny_run

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "serve-load"


@pytest.mark.timeout(240)
def test_load_with_random_disconnects(tmp_path):
    run = tiny_run(tmp_path)
    out = subprocess.run([sys.executable, str(SCRIPT), str(run), "--clients", "8", "--requests", "3",
                          "--length", "300", "--disconnect", "0.4", "--seed", "1", "--json"],
                         capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout)
    assert r["errors"] == 0 and r["leaked_slots"] == 0, r
    assert r["requests"] == 24 and r["completed"] + r["dropped"] == 24 and r["refused"] == 0
    assert r["dropped"] > 0 and r["completed"] > 0
    assert r["characters"] > 0 and r["ttfc_p99_ms"] is not None


def test_only_loopback_addresses():
    out = subprocess.run([sys.executable, str(SCRIPT), "--url", "http://192.0.2.1:8000"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "loopback only" in out.stderr


def test_the_ceiling_without_http(tmp_path):
    run = tiny_run(tmp_path)
    out = subprocess.run([sys.executable, str(SCRIPT), str(run), "--ceiling", "--clients", "3", "--length", "50",
                          "--json"], capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout)
    assert r["clients"] == 3 and r["kernel"] == "decode"
    assert r["engine_chars_per_s"] > 0 and r["step_tokens_per_s"] > 0

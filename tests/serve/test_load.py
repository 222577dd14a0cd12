"""scripts/serve-load, small: 8 clients x 3 short streamed requests against `zlm serve`,
some dropped mid-stream. Every request completes or is dropped, with no errors and no
slot left taken (speed is measured in docs/serve.md, not asserted here)."""

from __future__ import annotations

import json

import pytest
from serve_fixtures import tiny_run

from conftest import run_script, script_refusal


@pytest.mark.timeout(240)
def test_load_with_random_disconnects(tmp_path):
    run = tiny_run(tmp_path)
    r = json.loads(run_script("serve-load", run, "--clients", "8", "--requests", "3", "--length", "300",
                              "--disconnect", "0.4", "--seed", "1", "--json", timeout=200))
    assert r["errors"] == 0 and r["leaked_slots"] == 0, r
    assert r["requests"] == 24 and r["completed"] + r["dropped"] == 24 and r["refused"] == 0
    assert r["dropped"] > 0 and r["completed"] > 0
    assert r["characters"] > 0 and r["ttfc_p99_ms"] is not None


def test_only_loopback_addresses():
    _, err = script_refusal("serve-load", "--url", "http://192.0.2.1:8000", timeout=60, code=1)
    assert "loopback only" in err


def test_the_ceiling_without_http(tmp_path):
    run = tiny_run(tmp_path)
    r = json.loads(run_script("serve-load", run, "--ceiling", "--clients", "3", "--length", "50", "--json",
                              timeout=200))
    assert r["clients"] == 3 and r["kernel"] == "decode"
    assert r["engine_chars_per_s"] > 0 and r["step_tokens_per_s"] > 0

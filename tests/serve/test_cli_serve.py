"""The `zlm serve` command: it binds 127.0.0.1 by default and says where, warns for any
other host, refuses bad options in one line, serves until interrupted."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
from serve_fixtures import Client, tiny_run
from typer.testing import CliRunner

from zlm.cli import app as cli_app


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("serve-cli"))


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "zlm", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "NO_COLOR": "1"})


def test_serves_on_loopback_until_interrupted(run):
    proc = _start(str(run), "--port", "0", "--max-streams", "2")
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"serving {run / 'best'} at http://127.0.0.1:"), (line, proc.stderr.read())
        url = line.split(" at ")[1].split("/ ")[0]
        c = Client(url)
        assert c.json("GET", "/healthz")[1]["max_streams"] == 2
        status, headers, page = c.get("/")
        assert status == 200 and b'id="prime"' in page and headers["content-type"].startswith("text/html")
        status, _, text = c.post("/v1/sample", {"prime": "the ", "length": 80, "seed": 9})
        res = CliRunner().invoke(cli_app, ["sample", str(run), "--prime", "the ", "--length", "80",
                                           "--seed", "9"])
        assert status == 200 and res.output == "the " + text.decode() + "\n"
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and err.strip().splitlines()[-1] == "stopped", err
    assert "warning" not in err


def test_another_host_warns_and_a_bad_address_is_one_line(run):
    proc = _start(str(run), "--host", "192.0.2.1", "--port", "0")  # TEST-NET: not on this machine
    _, err = proc.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 2, err
    assert lines[0].startswith("warning: --host 192.0.2.1 makes the server reachable from other machines")
    assert "(pass --token)" in lines[0]
    assert lines[1].startswith("error: cannot listen on 192.0.2.1:0")


def test_a_taken_port_is_one_line(run):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        res = CliRunner().invoke(cli_app, ["serve", str(run), "--port", str(port)])
    assert res.exit_code == 2 and res.output.startswith(f"error: cannot listen on 127.0.0.1:{port}")


@pytest.mark.parametrize(("args", "message"), [
    (["--max-streams", "0"], "--max-streams must be from 1 to 1024, got 0"),
    (["--port", "70000"], "--port must be from 0 to 65535, got 70000"),
    (["--timeout", "0"], "--timeout must be > 0 seconds, got 0.0"),
    (["--max-body", "10"], "--max-body must be >= 1024 bytes, got 10"),
    (["--token", ""], "--token must be non-empty, without spaces"),
])
def test_bad_options_are_one_line(run, args, message):
    res = CliRunner().invoke(cli_app, ["serve", str(run), *args])
    assert res.exit_code == 2 and res.output == f"error: {message}\n"


def test_a_missing_run_is_one_line(tmp_path):
    res = CliRunner().invoke(cli_app, ["serve", str(tmp_path / "nope")])
    assert res.exit_code == 1 and res.output.startswith("error: ") and len(res.output.splitlines()) == 1

"""The CI rules of tests/conftest.py: under CI=true every way a test can skip fails unless the
test is marked gpu, or cpu_feature on a CPU whose flags lack it; without CI they skip as usual;
a cpu_feature other than bf16 or amx is refused; CI refuses to run without pytest-timeout.
Run in a child pytest on a folder holding a copy of the conftest and tests that skip."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

CONFTEST = pathlib.Path(__file__).with_name("conftest.py")

SKIPPING = '''
import pytest

def test_skip_call():
    pytest.skip("no thing")

@pytest.mark.skipif(True, reason="a condition")
def test_skipif():
    pass

@pytest.fixture
def needs_thing():
    pytest.skip("fixture: no thing")

def test_skip_in_fixture(needs_thing):
    pass

def test_importorskip():
    pytest.importorskip("zlm_no_such_module")

@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False

@pytest.mark.gpu
def test_gpu_only():
    pytest.skip("no CUDA device")

@pytest.mark.cpu_feature("amx")
def test_amx_on_a_cpu_without_it():
    from zlm.model.cells import cpu_ext
    cpu_ext.cpu_flags = lambda: {"avx2", "fma", "avx512_bf16"}  # what the rule reads: /proc/cpuinfo's flags
    pytest.skip("this CPU has no AMX")

@pytest.mark.cpu_feature("bf16")
def test_bf16_on_a_cpu_with_it():
    from zlm.model.cells import cpu_ext
    cpu_ext.cpu_flags = lambda: {"avx2", "fma", "avx512_bf16"}
    pytest.skip("this CPU has no native bf16 (it has)")

@pytest.mark.timeout(1)
def test_hang():
    import time
    time.sleep(60)

def test_passes():
    pass
'''

MODULE_SKIP = '''
import pytest
pytest.importorskip("zlm_no_such_module")

def test_never_collected():
    pass
'''

INI = "[pytest]\nmarkers =\n    gpu: needs CUDA\n    cpu_feature(name): needs a CPU instruction set\n"


def _run(folder: pathlib.Path, ci: bool, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA",
                           "-c", str(folder / "pytest.ini"), "--rootdir", str(folder), *args, str(folder)],
                          capture_output=True, text=True, env=env, cwd=folder, timeout=240)


def _outcomes(out: str) -> dict[str, str]:
    """test name -> PASSED | FAILED | ERROR | SKIPPED | XFAIL, from the -rA summary."""
    found = {}
    for line in out.splitlines():
        m = re.match(r"(PASSED|FAILED|ERROR|XFAIL) \S+::(\w+)", line)
        if m:
            found.setdefault(m.group(2), m.group(1))
        m = re.match(r"SKIPPED \[\d+\] \S+:\d+: (.*)", line)
        if m:
            found.setdefault("skipped: " + m.group(1), "SKIPPED")
    return found


@pytest.fixture
def folder(tmp_path) -> pathlib.Path:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    return tmp_path


def test_under_ci_every_skip_fails_unless_marked_gpu(folder):
    p = _run(folder, ci=True)
    got = _outcomes(p.stdout)
    assert p.returncode == 1, p.stdout + p.stderr
    assert got == {"test_skip_call": "FAILED", "test_skipif": "ERROR", "test_skip_in_fixture": "ERROR",
                   "test_importorskip": "FAILED", "test_xfail": "FAILED", "test_hang": "FAILED",
                   "test_passes": "PASSED", "skipped: no CUDA device": "SKIPPED",
                   "skipped: this CPU has no AMX": "SKIPPED", "test_bf16_on_a_cpu_with_it": "FAILED"}, p.stdout
    assert "skipped under CI=true (only tests marked gpu, or cpu_feature on a CPU without it, may skip there)" \
        in p.stdout
    assert "xfailed under CI=true" in p.stdout and "Timeout" in p.stdout


def test_without_ci_they_skip(folder):
    p = _run(folder, ci=False, args=("--deselect", "test_skipping.py::test_hang"))
    got = _outcomes(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr
    assert got.get("test_passes") == "PASSED" and got.get("test_xfail") == "XFAIL"
    assert sum(v == "SKIPPED" for v in got.values()) == 7, got


def test_under_ci_a_module_level_skip_fails_collection(folder):
    (folder / "test_skipping.py").unlink()
    (folder / "test_module_skip.py").write_text(MODULE_SKIP)
    p = _run(folder, ci=True)
    assert p.returncode != 0
    assert "test_module_skip.py skipped under CI=true" in p.stdout, p.stdout


def test_under_ci_pytest_timeout_is_required(folder):
    p = _run(folder, ci=True, args=("-p", "no:timeout"))
    assert p.returncode != 0
    assert "CI=true needs pytest-timeout" in p.stderr + p.stdout


def test_an_unknown_cpu_feature_is_refused(folder):
    (folder / "test_skipping.py").write_text(
        "import pytest\n\n@pytest.mark.cpu_feature('avx9')\ndef test_it():\n    pass\n")
    p = _run(folder, ci=False)
    assert p.returncode != 0
    assert "cpu_feature takes one of ['amx', 'bf16'], got ('avx9',)" in p.stdout + p.stderr

"""The built package contains zlm, zlm.cli and zlm.corpora, and no top-level `cli`."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import zipfile

import pytest
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _declared():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_dir_is_listed():
    """Automatic discovery would drop zlm or zlm.cli with this mapping: list all."""
    cfg = _declared()
    on_disk = {"zlm"} | {
        "zlm." + ".".join(p.relative_to(ROOT / "zlm").parent.parts)
        for p in (ROOT / "zlm").rglob("__init__.py")
        if p.parent != ROOT / "zlm"
    }
    on_disk |= {"zlm.cli", "zlm.corpora"}
    assert set(cfg["packages"]) == on_disk
    assert cfg["package-dir"]["zlm.cli"] == "cli"


def test_cli_importable_as_zlm_cli_only():
    import zlm.cli

    assert pathlib.Path(zlm.cli.__file__).parent == ROOT / "cli"
    out = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('cli') is None)"],
        capture_output=True, text=True, cwd="/", check=True,
    )
    assert out.stdout.strip() == "True"


@pytest.mark.skipif(
    subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode,
    reason="pip unavailable",
)
def test_wheel_contents(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("zlm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "zlm/cli/__init__.py" in names
    assert "zlm/model/cells/__init__.py" in names
    assert "zlm/corpora/catalog.json" in names
    for name in ("cell_steps.cpp", "mask_draw.cpp", "decoder.cpp", "module.cpp", "kernels.h"):
        assert f"zlm/model/cells/csrc/{name}" in names  # the C++ kernels compile from them
    assert not any(n.startswith("cli/") for n in names)


def test_python_dash_m_runs_the_cli():
    """`python -m zlm` is the `zlm` command where the console script is not on PATH."""
    r = subprocess.run([sys.executable, "-m", "zlm", "--help"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "NO_COLOR": "1", "COLUMNS": "100"})
    assert r.returncode == 0, r.stderr
    for command in ("prepare", "train", "eval", "sample", "bench", "recipe"):
        assert command in r.stdout

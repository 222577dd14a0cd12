"""The constants the C++ kernels and Python share are defined once, in
zlm/model/cells/kernel_constants.py, and reach the compiler as -D defines."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from zlm.model.cells import cpu_ext, kernel_constants
from zlm.model.cells.kernel_constants import CONSTANTS, compiler_defines


def test_defines_spell_every_constant():
    defines = compiler_defines()
    assert len(defines) == len(CONSTANTS)
    assert "-DZLM_DECODER_TILE=32" in defines and "-DZLM_DECODER_UNITS=8" in defines
    assert "-DZLM_SPLITMIX_GAMMA=0x9e3779b97f4a7c15ull" in defines  # 64-bit: unsigned hex
    assert all(d in cpu_ext.compile_flags("base") for d in defines)
    assert kernel_constants.DECODER_TILE == 4 * kernel_constants.DECODER_UNITS


def test_the_compiled_module_holds_the_python_values():
    ext = cpu_ext.load_extension()
    if ext is None:
        pytest.skip(f"no compiled extension here: {cpu_ext.unavailable_reason()}")
    assert ext.constants == CONSTANTS


def test_the_sources_do_not_build_without_the_defines():
    """kernels.h stops the preprocessor with #error, naming the missing constant."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    from torch.utils.cpp_extension import include_paths

    header = cpu_ext.SOURCE_DIR / "kernels.h"
    cmd = [cxx, "-E", "-x", "c++", "-std=c++17", *(f"-I{p}" for p in include_paths()), str(header),
           "-o", os.devnull]
    without = subprocess.run(cmd, capture_output=True, text=True)
    assert without.returncode != 0 and "ZLM_DECODER_TILE is not defined" in without.stderr
    partial = [d for d in compiler_defines() if "SPLITMIX_MIX2" not in d]
    assert "ZLM_SPLITMIX_MIX2 is not defined" in subprocess.run(cmd + partial, capture_output=True, text=True).stderr
    assert subprocess.run(cmd + compiler_defines(), capture_output=True, text=True).returncode == 0

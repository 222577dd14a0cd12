"""Building and caching the C++ step, and the fallback to the Python fused cell.

The build itself is faked here (a fake `cpp_extension.load`), so these tests do not
compile; tests/model/test_cells_compiled.py uses the real build.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.utils.cpp_extension

from zlm.model.cells import choose_cell, cpu_ext
from zlm.model.cells.fused import zoneout_lstm_fused


@pytest.fixture(autouse=True)
def _own_state(monkeypatch):
    """Each test starts untried and leaves the process's real outcome as it was."""
    saved = dict(cpu_ext._state)
    cpu_ext.forget()
    yield
    cpu_ext._state.clear()
    cpu_ext._state.update(saved)


def test_no_extension_env_falls_back_with_one_line_reason(monkeypatch):
    monkeypatch.setenv("ZLM_NO_EXTENSION", "1")
    choice = choose_cell("auto", "cpu")
    assert choice.name == "fused" and choice.fn is zoneout_lstm_fused
    assert "ZLM_NO_EXTENSION" in choice.reason and "\n" not in choice.reason
    assert "Python" in choice.reason


def test_missing_compiler_falls_back(monkeypatch):
    monkeypatch.delenv("ZLM_NO_EXTENSION", raising=False)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    choice = choose_cell("fused", "cpu")  # asked for explicitly: still runs, in Python
    assert choice.fn is zoneout_lstm_fused
    assert "no C++ compiler" in choice.reason and "\n" not in choice.reason


def test_failed_build_falls_back_with_first_line(monkeypatch, tmp_path):
    monkeypatch.delenv("ZLM_NO_EXTENSION", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("ZLM_EXT_CACHE", str(tmp_path))  # no cached build to fall back on

    def broken(**kw):
        raise RuntimeError("Error building extension 'zlm_cpu'\nlong compiler output\n...")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", broken)
    monkeypatch.setattr(cpu_ext, "_compiler_missing", lambda: None)
    assert cpu_ext.load_extension() is None
    assert cpu_ext.unavailable_reason() == "the C++ step did not build (Error building extension 'zlm_cpu')"
    assert cpu_ext.load_extension() is None  # tried once per process, not again


def test_first_build_says_compiling_and_how_long(monkeypatch, tmp_path):
    monkeypatch.delenv("ZLM_NO_EXTENSION", raising=False)
    monkeypatch.setenv("ZLM_EXT_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_ext, "_compiler_missing", lambda: None)
    seen = {}

    def fake_load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        seen.update(name=name, flags=extra_cflags, dir=build_directory)
        (tmp_path / name / f"{name}.so").write_text("")
        return types.SimpleNamespace(forward_step=None, backward_step=None)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    events = []
    assert cpu_ext.load_extension(events.append) is not None
    assert events[0].startswith("compiling") and events[1].startswith("compiled") and "s" in events[1]
    assert seen["dir"] == str(tmp_path / seen["name"])
    assert "-march=native" not in seen["flags"]
    cpu_ext.forget()
    events.clear()
    cpu_ext.load_extension(events.append)  # cached: nothing to say
    assert events == []


def test_cache_key_names_torch_isa_and_source():
    key = cpu_ext.build_key("avx2")
    assert key.startswith("zlm_cpu_") and "_avx2_" in key
    assert torch.__version__.split("+")[0].replace(".", "_") in key
    assert cpu_ext.build_key("avx512") != key


@pytest.mark.parametrize("flags, isa", [
    ({"avx2", "fma"}, "avx2"),
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx512"),
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}, "avx512bf16"),
    ({"sse4_2"}, "base"),
    (set(), "base"),
])
def test_instruction_set_from_flags(flags, isa):
    assert cpu_ext.instruction_set(flags) == isa
    assert all("native" not in f for f in cpu_ext._ISA_FLAGS[isa])


def test_cpu_name_and_flags_from_cpuinfo(tmp_path, monkeypatch):
    """The first processor's model name and flags; without /proc/cpuinfo, no flags and the
    architecture as the name (a run's log still says something)."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\n"
                    "flags\t\t: fpu avx2 fma avx512_bf16 amx_bf16\n\nprocessor\t: 1\nmodel name\t: other\n")
    monkeypatch.setattr(cpu_ext, "CPUINFO", info)
    assert cpu_ext.cpu_name() == "Intel(R) Xeon(R) Processor" and cpu_ext.cpu_vendor() == "GenuineIntel"
    assert cpu_ext.cpu_flags() == {"fpu", "avx2", "fma", "avx512_bf16", "amx_bf16"}
    monkeypatch.setattr(cpu_ext, "CPUINFO", tmp_path / "absent")
    monkeypatch.setattr(cpu_ext.platform, "processor", lambda: "")
    assert cpu_ext.cpu_flags() == set() and cpu_ext.cpu_name() == cpu_ext.platform.machine()
    assert cpu_ext.cpu_vendor() == ""


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ZLM_EXT_CACHE", str(tmp_path / "a"))
    assert cpu_ext.cache_root() == tmp_path / "a"
    monkeypatch.delenv("ZLM_EXT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cpu_ext.cache_root() == tmp_path / "x" / "zlm" / "ext"


def test_a_cached_build_is_imported_without_the_build_tooling(monkeypatch, tmp_path):
    monkeypatch.delenv("ZLM_NO_EXTENSION", raising=False)
    monkeypatch.setenv("ZLM_EXT_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_ext, "_compiler_missing", lambda: None)
    key = cpu_ext.build_key()
    (tmp_path / key).mkdir()
    (tmp_path / key / f"{key}.so").write_text("")  # a build cut short: not a library
    calls = []

    def fake_load(name, **kw):
        calls.append(name)
        return types.SimpleNamespace(forward_step=None)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    assert cpu_ext.load_extension() is not None and calls == [key]  # built again by torch's tooling
    cpu_ext.forget()
    monkeypatch.setattr(cpu_ext, "_import_built", lambda key, path: types.SimpleNamespace(path=path))
    assert cpu_ext.load_extension().path == tmp_path / key / f"{key}.so"
    assert calls == [key]  # imported directly: no ninja, no compiler checks

"""Builds, caches and loads zlm's C++ kernels (csrc/): one extension module.

The sources, one per job, and the header they share:

    csrc/cell_steps.cpp   the compiled CPU cell: element-wise steps, time windows, bf16 conversion
    csrc/mkl_gemm.cpp     the fp32 windows' recurrent product through MKL's packed GEMM, where torch has MKL
    csrc/amx_gemm.cpp     the bf16 windows' recurrent product through oneDNN's AMX micro-kernel, where the CPU has AMX
    csrc/mask_draw.cpp    the zoneout keep masks of the mix16 draw
    csrc/decoder.cpp      sampling and scoring a few streams: the whole-model Decoder, the inverse-CDF token draw
    csrc/module.cpp       the Python bindings
    csrc/kernels.h        what they share

The extension is compiled on first use with torch's own tooling
(`torch.utils.cpp_extension.load`, ninja, which compiles the files in parallel), never
inside pip's isolated build. The constants the C++ and Python share come from
`zlm.model.cells.kernel_constants` as -D defines. Builds are cached under a key of torch
version, instruction set and a hash of the sources and flags:

    $ZLM_EXT_CACHE or $XDG_CACHE_HOME/zlm/ext or ~/.cache/zlm/ext
        zlm_cpu_<torch>_<isa>_<source hash>/      one build directory per key

The instruction set is chosen from the CPU's flags and passed explicitly (`-mavx2 -mfma`,
or `-mavx512f ...`, with `-mavx512bf16` where the CPU has it), never `-march=native`, so a cache shared by machines with different
CPUs cannot hand one of them code it cannot run: each ISA has its own key.

First use reports "compiling ..." and then how long it took through `on_event` (a
callback) or, without one, the `zlm.ext` logger. Without a compiler, with
`ZLM_NO_EXTENSION=1`, or when the build fails, `load_extension` returns None and
`unavailable_reason()` gives one line; the callers fall back to Python (the fused cell in
Python, the Stepper's torch kernel, the torch expression of the mask draw).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from zlm.model.cells.kernel_constants import compiler_defines

log = logging.getLogger("zlm.ext")
SOURCE_DIR = Path(__file__).with_name("csrc")
SOURCES = ("cell_steps.cpp", "mkl_gemm.cpp", "amx_gemm.cpp", "mask_draw.cpp", "decoder.cpp", "module.cpp")  # compiled, in SOURCE_DIR
HEADERS = ("kernels.h",)  # included by them
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mavx2"]
_ISA_FLAGS = {
    "avx512bf16": [*_AVX512, "-mavx512bf16"],  # the Decoder's bf16 dot products (decoder.cpp)
    "avx512": _AVX512,
    "avx2": ["-mavx2", "-mfma"],
    "base": [],
}
_state: dict = {}  # "module" or "reason" once tried (one attempt per process)


CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo(field: str) -> str | None:
    """The first value of `field` in CPUINFO (None where there is none)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}\s*:\s*(.*)$", text, re.MULTILINE)
    return m.group(1).strip() if m else None


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return set((_cpuinfo("flags") or "").split())


def cpu_name() -> str:
    """The CPU's model name ("Intel(R) Xeon(R) Processor"), or the architecture where
    /proc/cpuinfo does not say."""
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "unknown CPU"


def cpu_vendor() -> str:
    """The CPU's vendor id ("GenuineIntel", "AuthenticAMD"), or "" where /proc/cpuinfo does
    not say."""
    return _cpuinfo("vendor_id") or ""


def instruction_set(flags: set[str] | None = None) -> str:
    """'avx512bf16', 'avx512', 'avx2' or 'base': the widest set both this CPU and the flags
    above cover."""
    flags = cpu_flags() if flags is None else flags
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        return "avx512bf16" if "avx512_bf16" in flags else "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "base"


def cache_root() -> Path:
    """Where builds are cached (see the module docstring)."""
    if os.environ.get("ZLM_EXT_CACHE"):
        return Path(os.environ["ZLM_EXT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "zlm" / "ext"


def compile_flags(isa: str) -> list[str]:
    """-O3, explicit ISA flags and the shared constants (-DZLM_...); no -ffast-math
    (-fno-trapping-math lets the exp vectorise)."""
    return ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", *_ISA_FLAGS[isa], *compiler_defines()]


def build_key(isa: str | None = None) -> str:
    """zlm_cpu_<torch version>_<isa>_<hash of sources and flags>: one build per combination."""
    isa = isa or instruction_set()
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes() + b"\0")
    h.update(" ".join(compile_flags(isa)).encode())
    digest = h.hexdigest()[:12]
    version = re.sub(r"[^0-9A-Za-z]+", "_", torch.__version__)
    return f"zlm_cpu_{version}_{isa}_{digest}"


def _compiler_missing() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not found; install g++ or set CXX)"
    return None


def _build(on_event: Callable[[str], None]):
    """Compile (or load the cached build of) the extension."""
    isa = instruction_set()
    key = build_key(isa)
    directory = cache_root() / key
    cached = directory / f"{key}.so"
    if cached.is_file():  # the key covers the sources, flags and torch: a cached build is current
        try:
            return _import_built(key, cached)
        except ImportError:  # e.g. a build cut short: torch's tooling builds it again
            pass
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    fresh = not any(directory.glob("*.so"))
    if fresh:
        on_event(f"compiling zlm's C++ kernels for {isa} (first use; cached in {directory})")
    t0 = time.perf_counter()
    flags = compile_flags(isa)
    module = cpp_extension.load(
        name=key, sources=[str(SOURCE_DIR / name) for name in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
        build_directory=str(directory), verbose=False,
    )
    if fresh:
        on_event(f"compiled zlm's C++ kernels in {time.perf_counter() - t0:.1f}s")
    return module


def _import_built(key: str, path: Path):
    """Import a cached build as `cpp_extension.load` does once ninja finds it up to date, but
    without importing setuptools or running ninja and the compiler checks in subprocesses,
    which every command that loads the extension would otherwise wait for."""
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_extension(on_event: Callable[[str], None] | None = None):
    """The compiled module (`forward_step`, `backward_step`, ..., `draw_mask`, `Decoder`, `draw`), or None.

    Tried once per process; the outcome (module or reason) is remembered.
    """
    if "module" in _state or "reason" in _state:
        return _state.get("module")
    report = on_event or log.info
    reason = None
    if os.environ.get("ZLM_NO_EXTENSION", "") not in ("", "0"):
        reason = "ZLM_NO_EXTENSION is set"
    else:
        reason = _compiler_missing()
    if reason is None:
        try:
            _state["module"] = _build(report)
            return _state["module"]
        except Exception as e:  # any build or load failure: fall back, in one line
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            reason = f"the C++ step did not build ({first[:200]})"
            log.warning("%s; the Python fused cell runs instead", reason)
    _state["reason"] = reason
    return None


def loaded():
    """The module if `load_extension` already loaded it, else None; never builds."""
    return _state.get("module")


def unavailable_reason() -> str | None:
    """Why `load_extension` returned None (None if it loaded or was not tried)."""
    return _state.get("reason")


def forget() -> None:
    """Forget the outcome, so the next `load_extension` tries again (tests)."""
    _state.clear()

"""Shared fixtures and helpers: the text the tests read (shipped in tests/corpora), tiny
prepared datasets built directly, PTB-char files written from that text, and the CI rule
that no test may skip there unless it is marked gpu (or cpu_feature, on a CPU without it)."""

from __future__ import annotations

import json
import os
import pathlib
import re

import numpy as np
import pytest
import torch

from zlm.core.graphs import CapturedStep
from zlm.core.precision import cpu_bf16_native
from zlm.data.tokenizers import CharTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A mirror in the catalog's layout (CORPORA/<name>/<file>): `zlm prepare NAME --mirror CORPORA`
# reads it. Only tiny Shakespeare is shipped; see tests/corpora/README.md.
CORPORA = ROOT / "tests" / "corpora"
TINY_SHAKESPEARE = CORPORA / "tinyshakespeare" / "input.txt"

try:  # hypothesis: no per-example deadline by default (a wall-clock limit fails a loaded CI)
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # (the dev extra installs it; the tests that use it import it)
    pass
else:
    _hypothesis_settings.register_profile("zlm", deadline=None)
    _hypothesis_settings.load_profile("zlm")


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need_corpus(path: pathlib.Path) -> pathlib.Path:
    """Return path, a file or folder of tests/corpora; fail the test when it is missing
    (the checkout is incomplete: the text is part of the repository)."""
    if not path.exists():
        pytest.fail(f"{path} is missing: it is part of the repository (tests/corpora)")
    return path


SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def _script(name: str, args, timeout: int):
    import subprocess
    import sys

    return subprocess.run([sys.executable, str(SCRIPTS / name), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def run_script(name: str, *args, timeout: int = 600) -> str:
    """The script `name` (in scripts/) run with this Python and `args`: its stdout, once it
    exits 0 (else the test fails with its stderr). Where the script measures the compiled
    extension, the caller skips first without it."""
    out = _script(name, args, timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout


def script_refusal(name: str, *args, timeout: int = 300, code: int | None = None) -> tuple[str, str]:
    """The script `name` run as `run_script` runs it, where the test expects it to refuse
    its arguments: its (stdout, stderr), once it exits non-zero (exactly `code` when given;
    else the test fails)."""
    out = _script(name, args, timeout)
    assert out.returncode != 0 if code is None else out.returncode == code, \
        f"{name} exited {out.returncode}:\n{out.stdout}{out.stderr}"
    return out.stdout, out.stderr


def shakespeare_text(n_chars: int | None = None) -> str:
    text = need_corpus(TINY_SHAKESPEARE).read_text(encoding="utf-8")
    return text if n_chars is None else text[:n_chars]


# PTB-char -------------------------------------------------------------------------------
# The Penn Treebank character files (ptb.char.*.txt) hold one sentence a line, every
# character preceded by a space and "_" for a space: " a _ c a t\n" is "a cat\n". Their
# alphabet is these 48 symbols, the space and the end of line: 50 in all.
PTB_SYMBOLS = "#$&'*-./0123456789<>N\\abcdefghijklmnopqrstuvwxyz"
PTB_FILES = {s: f"ptb.char.{s}.txt" for s in ("train", "valid", "test")}


def ptb_char_text(n_lines: int, start: int = 0) -> str:
    """n_lines sentences in PTB's alphabet: a line with every symbol, then tiny
    Shakespeare's lines from line `start` on, lower-cased, other characters dropped."""
    out = [" ".join(PTB_SYMBOLS)]
    for line in shakespeare_text().splitlines()[start:]:
        if len(out) == n_lines:
            break
        kept = re.sub(" +", " ", "".join(c for c in line.lower() if c in PTB_SYMBOLS or c == " "))
        if kept.strip():
            out.append(kept.strip())
    assert len(out) == n_lines, f"tiny Shakespeare has fewer than {n_lines} lines from {start}"
    return "".join(line + "\n" for line in out)


def ptb_char_format(text: str) -> str:
    """Decoded text -> the PTB-char file that decodes to it ("a cat\\n" -> " a _ c a t\\n")."""
    assert "_" not in text and text.endswith("\n")
    return "".join("".join(" " + c for c in line.replace(" ", "_")) + "\n"
                   for line in text[:-1].split("\n"))


def write_ptb_char(directory: pathlib.Path, lines=(3000, 400, 400)) -> dict[str, str]:
    """ptb.char.{train,valid,test}.txt in `directory` (train, valid, test: `lines` lines
    each, from different parts of tiny Shakespeare); returns each split's decoded text."""
    directory.mkdir(parents=True, exist_ok=True)
    texts, start = {}, 0
    for (split, name), n in zip(PTB_FILES.items(), lines, strict=True):
        texts[split] = ptb_char_text(n, start)
        (directory / name).write_text(ptb_char_format(texts[split]), encoding="utf-8")
        start += 2 * n  # (blank lines dropped: the parts never overlap)
    return texts


# Tiny datasets ---------------------------------------------------------------------------

# The corpora recipes' tests (corpora-benchmark, defaults-loco): a fake fetch-corpora OUT_DIR
# and tiny run sizes.
RUSSIAN = "Выиграть по лотерейному билету автомобиль — всё равно, что выиграть поезд.\n%\n"
TINY_BENCH = {"hidden": 16, "embed": 8, "batch_size": 4, "bptt": 16, "eval_every": 2, "log_every": 1,
              "device": "cpu"}


def write_fake_bench_corpora(root: pathlib.Path) -> pathlib.Path:
    """A fetch-corpora OUT_DIR holding two of the set's names with small stand-in texts."""
    for name, text in (("tinyshakespeare", shakespeare_text(20_000)), ("fortunes-ru", RUSSIAN * 200)):
        (root / name).mkdir()
        (root / name / "input.txt").write_text(text, encoding="utf-8")
    return root


def write_char_dataset(out: pathlib.Path, text: str, split=(0.9, 0.05, 0.05)) -> pathlib.Path:
    """A DATA_DIR in zlm-dataset format, written without zlm.prepare (a fake, not a mock)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = CharTokenizer(text)
    n = len(text)
    a, b = int(n * split[0]), int(n * (split[0] + split[1]))
    parts = {"train": text[:a], "valid": text[a:b], "test": text[b:]}
    splits = {}
    for name, part in parts.items():
        ids = tok.encode(part).astype(np.uint8 if tok.vocab_size <= 256 else np.uint16)
        ids.tofile(out / f"{name}.bin")
        splits[name] = {"file": f"{name}.bin", "tokens": len(ids), "characters": len(part),
                        "bytes": len(part.encode("utf-8"))}
    tok.save(out)
    meta = {"format": "zlm-dataset", "version": 1, "zlm_version": "test",
            "tokenizer": {"kind": "char", "vocab_size": tok.vocab_size, "file": "tokenizer.json"},
            "dtype": "uint8" if tok.vocab_size <= 256 else "uint16", "unit": "character",
            "splits": splits, "source": {"name": "test", "paths": [], "sha256": ""},
            "unknown": "error"}
    (out / "dataset.json").write_text(json.dumps(meta))
    return out


@pytest.fixture
def tiny_data(tmp_path) -> pathlib.Path:
    """~60k characters of tiny Shakespeare as a char DATA_DIR."""
    return write_char_dataset(tmp_path / "data", shakespeare_text(60_000))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread is fastest, and on a shared CPU two threads can be 50x slower.
    A module takes it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def untrained_char_model():
    """(model, tokenizer): an untrained 1 x 24 model over tiny Shakespeare's characters, in
    eval mode without gradients; enough to check a scoring protocol (no training, so fast)."""
    from zlm.model.lm import ModelConfig, ZoneoutLM

    tok = CharTokenizer(shakespeare_text(5000))
    torch.manual_seed(0)
    model = ZoneoutLM(ModelConfig(vocab_size=tok.vocab_size, hidden=24, embed=8)).eval()
    model.requires_grad_(False)
    return model, tok


# CI: a skip is a failure unless the test is marked gpu ----------------------------------
# Locally a test may skip for what this machine lacks (a C++ compiler, triton, onnx, a
# mount it may not make, ...). CI (CI=true; .ci/run sets it) installs everything the dev
# extra names, so such a skip there is a broken environment or a broken test: it fails.
# The hooks see every way to skip: pytest.skip in a test or fixture, skipif marks,
# importorskip (in a test, or at module level: a collection skip), and xfail.
# What no install can add is the CPU's instruction set: a test marked
# cpu_feature("bf16") or cpu_feature("amx") may skip under CI where /proc/cpuinfo shows
# this CPU really lacks it (native bf16: AVX512-BF16 or AMX; AMX's bf16 tiles).
CPU_FEATURES = {"bf16": cpu_bf16_native, "amx": lambda flags: "amx_bf16" in flags}  # name -> has it, by flags


def cpu_lacks(feature: str) -> bool:
    """Whether this CPU lacks `feature` (a key of CPU_FEATURES), by its /proc/cpuinfo flags."""
    from zlm.model.cells import cpu_ext

    return not CPU_FEATURES[feature](cpu_ext.cpu_flags())


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        for mark in item.iter_markers("cpu_feature"):
            if len(mark.args) != 1 or mark.args[0] not in CPU_FEATURES:
                raise pytest.UsageError(f"{item.nodeid}: cpu_feature takes one of {sorted(CPU_FEATURES)}, "
                                        f"got {mark.args}")


def _may_skip(item) -> bool:
    """A skip the CI rule allows: a gpu test, or a cpu_feature test on a CPU without it."""
    if item.get_closest_marker("gpu") is not None:
        return True
    return any(cpu_lacks(m.args[0]) for m in item.iter_markers("cpu_feature"))


def _skip_reason(report) -> str:
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail or '(no reason given)'}"
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail_instead(report, what: str) -> None:
    reason = _skip_reason(report)
    if hasattr(report, "wasxfail"):
        what = what.replace("skipped", "xfailed")
        del report.wasxfail
    report.outcome = "failed"
    report.longrepr = (f"{what} under CI=true (only tests marked gpu, or cpu_feature on a CPU without it, "
                       f"may skip there): {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and in_ci() and not _may_skip(item):
        _fail_instead(report, "skipped")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and in_ci():  # a module-level skip: no test in it ran
        _fail_instead(report, f"{collector.nodeid or 'collection'} skipped")


def pytest_configure(config) -> None:
    if in_ci() and not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError("CI=true needs pytest-timeout (pip install -e '.[dev]'): "
                                "without it a hung test hangs CI")


def pytest_report_header(config) -> str:
    found = "found" if TINY_SHAKESPEARE.exists() else "MISSING (tests that read it fail)"
    ci = "; CI=true: a skip fails unless the test is marked gpu (or cpu_feature, on a CPU without it)" \
        if in_ci() else ""
    return f"zlm test corpora: {CORPORA} {found}{ci}"


def train_run(run_dir, data, model_config, train_config, *, resume: bool = False, reporter=None, fault=None) -> dict:
    """Train DATA_DIR `data` (a Dataset or a path) with exactly these configs, through the one
    path `zlm train` takes (`plan` -> `Trainer`); the trainer's summary. `fault(step, loss)`
    injects non-finite values."""
    from zlm.core.config import Options
    from zlm.training.plan import plan
    from zlm.training.presets import Preset
    from zlm.training.trainer import Trainer

    path = getattr(data, "path", data)
    planned = plan(path, Options.of(model_config, train_config), out=run_dir, resume=resume, reporter=reporter,
                   preset=Preset("test", "the test's own configs", model_config, train_config))
    return Trainer(planned, reporter=reporter, fault=fault).fit()


# ------------------------------------- CUDA graphs on the CPU (an eager stand-in)


class EagerReplay(CapturedStep):
    """CapturedStep with its four CUDA methods replaced: "capture" runs fn (after the same
    warm-up calls, which draw random numbers the RNG restore must undo) and keeps its
    outputs and gradients; "replay" reruns fn on the static inputs and writes the results
    into those same tensors, as a CUDA graph replay writes into its static memory. All the
    rest - copying inputs in, restoring the RNG and (after a whole step's warm-up) the
    weights, reattaching gradients, the trainer's use of it - is the production code."""

    def check_device(self, device):
        pass

    def get_rng_state(self):
        return torch.get_rng_state()

    def set_rng_state(self, state):
        torch.set_rng_state(state)

    def _capture(self):
        for _ in range(self.warmup):
            self._clear_grads()
            self.fn(*self.static_inputs)
        self._clear_grads()
        return tuple(self.fn(*self.static_inputs))

    def _replay(self):
        self._clear_grads()
        outputs = self.fn(*self.static_inputs)
        for static, out in zip(self.static_outputs, outputs, strict=True):
            static.copy_(out)
        for g, p in zip(self.grads, self.params, strict=True):
            g.copy_(p.grad)


def counting(cls: type, made: list) -> type:
    """A subclass of cls (a capture class) that appends each instance to `made`."""

    class Counting(cls):
        def __init__(self, *a, **k):
            made.append(self)
            super().__init__(*a, **k)

    return Counting

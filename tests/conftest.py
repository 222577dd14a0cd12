"""Shared fixtures: real text from ../shared, and tiny prepared datasets built directly."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest

from zlm.data.tokenizers import CharTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = pathlib.Path(os.environ.get("ZLM_SHARED", ROOT.parent / "shared"))
CORPORA = SHARED / "corpora"
TINY_SHAKESPEARE = CORPORA / "tinyshakespeare" / "input.txt"


def need_corpus(path: pathlib.Path) -> pathlib.Path:
    """Return path, a file or folder of ../shared/corpora; skip the test when it is missing.

    Under CI (CI=true) a missing corpus fails the test instead: a third of the suite reads
    real text, and CI must not pass by skipping it."""
    if not path.exists():
        msg = (f"{path} is not available: put the shared corpora beside the checkout "
               f"(../shared) or set ZLM_SHARED=DIR")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def pytest_report_header(config) -> str:
    found = "found" if TINY_SHAKESPEARE.exists() else "MISSING (tests that read it skip; fail under CI)"
    return f"zlm shared corpora: {CORPORA} {found}"


def shakespeare_text(n_chars: int | None = None) -> str:
    text = need_corpus(TINY_SHAKESPEARE).read_text(encoding="utf-8")
    return text if n_chars is None else text[:n_chars]


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

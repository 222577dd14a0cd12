"""Corpus -> DATA_DIR: tokenizer, train/valid/test.bin and dataset.json, in bounded memory.

Owns `PrepareConfig` and `prepare`, the library function behind `zlm prepare` (and
`zlm train` on a raw file). The source is read twice, in chunks:

    pass 1  count units (characters, or bytes for enwik8) to place the split boundaries,
            hash the content, and collect what the tokenizer needs: for char the first
            position of every code point (vocabulary = characters first seen in train;
            an unknown character in valid/test is reported before anything is written),
            for bpe/unigram a bounded sample of the training split;
    pass 2  cut the stream at the boundaries, encode chunk by chunk, append to the .bin.

Splits are contiguous and in the order train, valid, test. Everything is written into a
hidden sibling directory that is renamed into place at the end, dataset.json last, so an
interrupted prepare never leaves a DATA_DIR that looks complete. Output is a pure
function of the input and the config: no timestamps, byte-identical on a re-run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable

import numpy as np

from zlm.atomic import building
from zlm.data import catalog, textio
from zlm.data.dataset import SPLITS, Dataset
from zlm.data.passes import Passes, Plan, Scan
from zlm.data.tokenizers import (
    KINDS,
    UNKNOWN_POLICIES,
    CharTokenizer,
    Tokenizer,
    check_unknown,
    load_tokenizer,
    token_dtype,
    train_tokenizer,
)
from zlm.errors import DataError, UsageError
from zlm.version import __version__

DEFAULT_SPLIT = (0.9, 0.05, 0.05)
VOCAB_POLICIES = (*UNKNOWN_POLICIES, "include")  # --unknown

_DATA_FILES = {"dataset.json", "tokenizer.json", "tokenizer.model", "train.bin",
               "valid.bin", "test.bin"}

Progress = Callable[[int, int], None]  # (done_bytes, total_bytes) of source read

@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """How to turn a corpus into a DATA_DIR.

    tokenizer: "char" | "byte" | "bpe" | "unigram"; None = the corpus's own (byte for
        enwik8), else char.
    vocab_size: bpe/unigram only; an upper bound (default 1024).
    split: train/valid/test fractions by characters, contiguous; None = the corpus's
        convention, else (0.9, 0.05, 0.05).
    valid, test: explicit files (or lists/directories) instead of a split; both or none.
    unknown: what to do with characters of valid/test not seen in train: "error" (name
        the first), "replace" (map them to U+FFFD, one vocabulary entry), "include" (the
        vocabulary is every character of the whole corpus, as char-rnn and nanoGPT
        build it; `zlm train FILE` uses this). None = the corpus's convention (replace
        for stdlib, whose docstrings hold rare symbols), else error.
    mirror: local copy of named corpora (DIR/<name>/<file>); None = $ZLM_CORPORA.
    format: "text" | "ptb-char" for file sources (named corpora carry their own).
    max_source_bytes: read source files only until their total size reaches this
        (whole files, at least one): quick looks at big folders, and tests.
    base: a directory holding a tokenizer to start from (a checkpoint's dataset.json and
        tokenizer file: `zlm train --init-from`). Its kind is used; a char vocabulary is
        extended by the new text's characters ("include"), maps them to U+FFFD
        ("replace", adding U+FFFD if it lacks it) or refuses them ("error"); byte and
        sentencepiece tokenizers are used as they are.
    chunk_bytes: read size; memory use scales with it, results do not.
    """

    tokenizer: str | None = None
    vocab_size: int | None = None
    split: tuple[float, float, float] | None = None
    valid: object = None
    test: object = None
    unknown: str | None = None
    mirror: object = None
    format: str = "text"
    max_source_bytes: int | None = None
    chunk_bytes: int = textio.CHUNK_BYTES
    base: str | None = None

    def __post_init__(self):
        if self.tokenizer is not None and self.tokenizer not in KINDS:
            raise UsageError(f"--tokenizer {self.tokenizer} is not a tokenizer; use one of "
                             f"{', '.join(KINDS)}")
        if self.vocab_size is not None and self.tokenizer not in ("bpe", "unigram"):
            raise UsageError("--vocab-size applies to --tokenizer bpe or unigram only")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise UsageError(f"--vocab-size {self.vocab_size} is too small; pass e.g. 1024")
        if self.unknown is not None:
            check_unknown(self.unknown, VOCAB_POLICIES)
        if self.format not in textio.FORMATS:
            raise UsageError(f"--format {self.format} is not a format; use one of "
                             f"{', '.join(textio.FORMATS)}")
        if (self.valid is None) != (self.test is None):
            raise UsageError("pass both --valid and --test (or neither and use --split)")
        if self.split is not None:
            if self.valid is not None:
                raise UsageError("pass --valid/--test or --split, not both")
            split = tuple(float(f) for f in self.split)
            if len(split) != 3 or min(split) <= 0 or abs(sum(split) - 1) > 1e-6:
                raise UsageError(f"--split {','.join(map(str, self.split))} must be three "
                                 "positive fractions summing to 1, e.g. 0.9,0.05,0.05")
            object.__setattr__(self, "split", split)
        if self.chunk_bytes < 1:
            raise UsageError("chunk_bytes must be positive")

def prepare(source, out, config: PrepareConfig = PrepareConfig(),
            on_progress: Progress | None = None, force: bool = False) -> Dataset:
    """Prepare `source` (file(s), a directory, a .gz, or a corpus name) into DATA_DIR `out`."""
    out = pathlib.Path(out).expanduser()
    _check_out(out, force)
    plan = _plan(source, config)
    base = _base_tokenizer(config.base) if config.base is not None else None
    if base is not None:
        plan = dataclasses.replace(plan, kind=base.kind)
    total = textio.disk_size(plan.files) * 2
    done = [0]

    def on_read(n: int) -> None:
        done[0] += n
        if on_progress is not None:
            on_progress(min(done[0], total), total)

    stream = Passes(plan, config.chunk_bytes, on_read)
    scan = stream.scan(want_sample=plan.kind in ("bpe", "unigram"))
    bounds = _boundaries(plan, scan.part_units)
    tok = _build_tokenizer(plan, config, scan, bounds) if base is None else _extend(base, plan, scan, bounds)
    with building(out) as tmp:
        dtype = token_dtype(tok.vocab_size)
        counts = stream.write(tok, dtype, bounds, tmp, _encode_policy(plan.unknown))
        tok.save(tmp)
        meta = {
            "format": "zlm-dataset", "version": 1, "zlm_version": __version__,
            "tokenizer": tok.meta(), "dtype": dtype.name, "unit": plan.unit,
            "splits": {s: {"file": f"{s}.bin", **counts[s]} for s in SPLITS},
            "source": {"name": plan.name, "paths": [str(p) for p in plan.files],
                       "sha256": scan.sha256, "format": plan.fmt, "split": plan.split},
            "unknown": plan.unknown,
        }
        (tmp / "dataset.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return Dataset.open(out)

def _check_out(out: pathlib.Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; pass a directory path for DATA_DIR")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise UsageError(f"--out {out} exists and is not empty; pass --force to replace it "
                         "or choose another --out")
    if not {p.name for p in out.iterdir()} <= _DATA_FILES:
        raise UsageError(f"--out {out} holds files that are not a zlm DATA_DIR's; refusing to "
                         "delete them even with --force; choose another --out")

def _plan(source, config: PrepareConfig) -> Plan:
    is_name = isinstance(source, str) and not os.path.exists(source) and source in catalog.names()
    if is_name:
        corpus = catalog.locate(source, config.mirror)
        if config.valid is not None:
            raise UsageError(f"{source} comes with its own splits; pass --valid/--test only "
                             "with files")
        split = corpus.split
        if config.split is not None:
            if split["kind"] == "files":
                raise UsageError(f"{source} comes split in three files; drop --split")
            split = {"kind": "fractions", "fractions": list(config.split)}
        kind = config.tokenizer or corpus.tokenizer
        if corpus.unit == "byte" and kind != "byte":
            raise UsageError(f"{source} is measured in bits per byte; use --tokenizer byte "
                             "(its default)")
        by_file = corpus.split_files()
        parts = [by_file[s] for s in SPLITS] if by_file else [list(corpus.files)]
        parts = [_cap(p, config.max_source_bytes) for p in parts]
        unknown = config.unknown or corpus.unknown
        return Plan(parts, split, kind, corpus.format, corpus.unit, source, unknown)
    names = catalog.names()
    parts = [textio.resolve_files(source, names)]
    split = {"kind": "fractions", "fractions": list(config.split or DEFAULT_SPLIT)}
    if config.valid is not None:
        parts += [textio.resolve_files(config.valid), textio.resolve_files(config.test)]
        split = {"kind": "files"}
    parts = [_cap(p, config.max_source_bytes) for p in parts]
    return Plan(parts, split, config.tokenizer or "char", config.format, "character", None,
                 config.unknown or "error")

def _cap(files: list[pathlib.Path], max_bytes: int | None) -> list[pathlib.Path]:
    if max_bytes is None:
        return files
    kept, size = [], 0
    for path in files:
        if kept and size + path.stat().st_size > max_bytes:
            break
        kept.append(path)
        size += path.stat().st_size
    return kept

def _boundaries(plan: Plan, part_units: list[int]) -> list[int]:
    """[0, end_train, end_valid, end_test] in units of the stream."""
    total = sum(part_units)
    what = plan.name or ", ".join(map(str, plan.parts[0][:3]))
    if total == 0:
        raise DataError(f"{what} is empty; pass a non-empty text file")
    kind = plan.split["kind"]
    if kind == "files":
        for s, n, files in zip(SPLITS, part_units, plan.parts, strict=True):
            if n == 0:
                raise DataError(f"the {s} split ({files[0]}) is empty; pass a non-empty file")
        return [0, part_units[0], part_units[0] + part_units[1], total]
    if kind == "counts":
        c = plan.split["counts"]
        if total < sum(c):
            raise DataError(f"{what} has {total:,} {plan.unit}s, fewer than the {sum(c):,} its "
                            "split needs; the file is truncated: delete it and fetch it again")
        return [0, c[0], c[0] + c[1], c[0] + c[1] + c[2]]
    f = plan.split["fractions"]
    bounds = [0, round(total * f[0]), round(total * (f[0] + f[1])), total]
    for s, lo, hi in zip(SPLITS, bounds, bounds[1:], strict=False):
        if hi <= lo:
            raise DataError(f"{what} has only {total} {plan.unit}s: the {s} split of "
                            f"--split {','.join(map(str, f))} would be empty; use a larger "
                            "corpus, or give its splits as files: zlm prepare TRAIN --valid VALID "
                            "--test TEST --out DATA_DIR")
    return bounds

def _build_tokenizer(plan: Plan, config: PrepareConfig, scan: Scan, bounds) -> Tokenizer:
    if plan.kind == "char":
        first = scan.first_pos
        known = bounds[3] if plan.unknown == "include" else bounds[1]
        in_train = np.flatnonzero(first < known)  # code points in the vocabulary
        if plan.unknown == "error":
            late = (first >= bounds[1]) & (first < bounds[3])
            if late.any():
                cp = int(np.argmin(np.where(late, first, np.iinfo(np.int64).max)))
                pos = int(first[cp])
                s = 1 if pos < bounds[2] else 2
                raise DataError(
                    f"character {chr(cp)!r} (U+{cp:04X}) at character {pos - bounds[s]:,} of "
                    f"the {SPLITS[s]} split never occurs in the train split; pass "
                    "--unknown replace to map such characters to U+FFFD, or --unknown include "
                    "to build the vocabulary from the whole corpus"
                )
        chars = [chr(c) for c in in_train.tolist()]
        return CharTokenizer(chars + (["\ufffd"] if plan.unknown == "replace" else []))
    sample = scan.sample[:bounds[1]]
    return train_tokenizer(plan.kind, sample, config.vocab_size, _encode_policy(plan.unknown))


def _base_tokenizer(directory: str) -> Tokenizer:
    meta = json.loads((pathlib.Path(directory) / "dataset.json").read_text(encoding="utf-8"))
    return load_tokenizer(directory, meta["tokenizer"])


def _extend(base: Tokenizer, plan: Plan, scan: Scan, bounds) -> Tokenizer:
    """The tokenizer of a text prepared from `base`: a char vocabulary grows by the text's
    new characters (`--unknown include`), gains U+FFFD (replace) or refuses them (error)."""
    if not isinstance(base, CharTokenizer):
        return base
    seen = np.flatnonzero(scan.first_pos < bounds[3])  # code points of the whole text
    new = sorted(set(chr(c) for c in seen.tolist()) - set(base.chars))
    if not new:
        return base
    if plan.unknown == "error":
        raise DataError(f"character {new[0]!r} (U+{ord(new[0]):04X}) is not in the vocabulary of the model "
                        f"trained from ({len(new)} new characters); pass --unknown include to extend it "
                        "or --unknown replace to map them to U+FFFD")
    return CharTokenizer(base.chars + (new if plan.unknown == "include" else ["\ufffd"]))


def _encode_policy(unknown: str) -> str:
    """The tokenizer's policy: with "include" every character is in the vocabulary."""
    return "error" if unknown == "include" else unknown

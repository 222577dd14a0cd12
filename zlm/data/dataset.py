"""The read side of a prepared DATA_DIR: metadata, tokenizer and memory-mapped splits.

A DATA_DIR, as `zlm.data.prepare` writes it:

    dataset.json     {"format": "zlm-dataset", "version": 1, "zlm_version",
                      "tokenizer": {"kind", "vocab_size", "file"},
                      "dtype": "uint8|uint16|uint32", "unit": "character|byte",
                      "splits": {"train"|"valid"|"test":
                                 {"file", "tokens", "characters", "bytes"}},
                      "source": {"name", "paths", "sha256", ...}, "unknown": "error|replace"}
    tokenizer.json | tokenizer.model
    train.bin, valid.bin, test.bin    flat little-endian token ids, shape (tokens,)

dataset.json is written last, so a directory without it is not (yet) a DATA_DIR.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import numpy as np

from zlm.atomic import temporary_of
from zlm.data.tokenizers import Tokenizer, load_tokenizer
from zlm.errors import DataError

FORMAT = "zlm-dataset"
VERSION = 1
SPLITS = ("train", "valid", "test")
DTYPES = {"uint8": "<u1", "uint16": "<u2", "uint32": "<u4"}


@dataclasses.dataclass(frozen=True)
class SplitInfo:
    """Size of one split: tokens stored, characters and UTF-8 bytes of its text."""

    tokens: int
    characters: int
    bytes: int

    def __post_init__(self):
        if min(self.tokens, self.characters, self.bytes) < 0:
            raise ValueError("split sizes are counts and cannot be negative")


class Dataset:
    """A prepared DATA_DIR, opened read-only."""

    def __init__(self, path: pathlib.Path, meta: dict, tokenizer: Tokenizer):
        self.path = path
        self.meta = meta
        self.tokenizer = tokenizer
        self.vocab_size: int = tokenizer.vocab_size
        self.dtype: np.dtype = np.dtype(DTYPES[meta["dtype"]])
        self.unit: str = meta.get("unit", "character")

    @classmethod
    def open(cls, path) -> Dataset:
        """Open and check a DATA_DIR; `DataError` (one line) if it is not one."""
        path = pathlib.Path(path)
        meta_path = path / "dataset.json"
        if not path.is_dir():
            raise DataError(f"{path} is not a directory; pass a DATA_DIR made by zlm prepare")
        target = temporary_of(path)
        if target is not None:
            raise DataError(f"{path} is a temporary left by an interrupted zlm prepare, not a DATA_DIR; "
                            f"delete it and pass {path.with_name(target)} or prepare again")
        if not meta_path.is_file():
            raise DataError(f"{path} has no dataset.json: not a prepared DATA_DIR (or an "
                            "interrupted one); run zlm prepare SOURCE --out DATA_DIR")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"{meta_path} is not valid JSON ({e}); re-run zlm prepare") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise DataError(f"{meta_path} is not a zlm dataset description; re-run zlm prepare")
        if int(meta.get("version", 0)) > VERSION:
            raise DataError(f"{path} was prepared by a newer zlm (dataset format "
                            f"{meta.get('version')}); upgrade zlm or re-run zlm prepare")
        try:
            dtype = np.dtype(DTYPES[meta["dtype"]])
            splits = meta["splits"]
            tok_meta = meta["tokenizer"]
        except KeyError as e:
            raise DataError(f"{meta_path} lacks {e}; re-run zlm prepare") from None
        for name in SPLITS:
            info = splits.get(name)
            if info is None:
                raise DataError(f"{meta_path} has no {name} split; re-run zlm prepare")
            bin_path = path / info["file"]
            want = int(info["tokens"]) * dtype.itemsize
            if not bin_path.is_file() or bin_path.stat().st_size != want:
                raise DataError(f"{bin_path} is missing or not {want} bytes long: the DATA_DIR "
                                "is incomplete; re-run zlm prepare with --force")
        return cls(path, meta, load_tokenizer(path, tok_meta))

    def tokens(self, split: str) -> np.ndarray:
        """Read-only memory map of a split's ids, shape (tokens,), the stored dtype."""
        info = self._split(split)
        if int(info["tokens"]) == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self.path / info["file"], dtype=self.dtype, mode="r")

    def split_info(self, split: str) -> SplitInfo:
        info = self._split(split)
        return SplitInfo(int(info["tokens"]), int(info["characters"]), int(info["bytes"]))

    def copy_description(self, dest: pathlib.Path) -> None:
        """Copy dataset.json and the tokenizer file into dest, so a checkpoint needs nothing else."""
        shutil.copyfile(self.path / "dataset.json", dest / "dataset.json")
        name = self.meta["tokenizer"]["file"]
        shutil.copyfile(self.path / name, dest / name)

    def _split(self, split: str) -> dict:
        if split not in self.meta["splits"]:
            raise DataError(f"no split {split!r} in {self.path}; use one of "
                            f"{', '.join(self.meta['splits'])}")
        return self.meta["splits"][split]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s}={self.meta['splits'][s]['tokens']}" for s in SPLITS)
        return (f"Dataset({str(self.path)!r}, {self.tokenizer.kind}, vocab={self.vocab_size}, "
                f"{sizes})")

"""zlm compress against everyday compressors on the same files.

Owns `compare_compressors(run, files, ...) -> list[Row]` and `markdown(rows)`: for each
file, zlm static and zlm --adapt (both round-tripped through decompression and checked),
then gzip -9, bzip2 -9, xz -9 and zstd -19 where the binary is installed (skipped with a
note otherwise), each run as a subprocess on the file's bytes. Reported per compressor:
compressed bytes, bits per byte, compression and decompression speed (KB/s of the
original). The model's size (its tensors' bytes) is reported beside zlm's rows,
because the decompressor needs it: a pretrained model is part of the decompressor.

Run it with `python scripts/compare_compressors.py RUN FILE [FILE ...]`.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from zlm.inference.compress import compress_bytes, decompress_bytes, load_for_coding
from zlm.inference.dynamic import DynamicConfig

EXTERNAL = (("gzip -9", ["gzip", "-9", "-c"], ["gzip", "-d", "-c"]),
            ("bzip2 -9", ["bzip2", "-9", "-c"], ["bzip2", "-d", "-c"]),
            ("xz -9", ["xz", "-9", "-c"], ["xz", "-d", "-c"]),
            ("xz -9e", ["xz", "-9e", "-c"], ["xz", "-d", "-c"]),
            ("zstd -19", ["zstd", "-19", "-c", "-q"], ["zstd", "-d", "-c", "-q"]))


@dataclass(frozen=True)
class Row:
    """One compressor on one file."""

    file: str
    compressor: str
    original_bytes: int
    compressed_bytes: int
    compress_kb_s: float
    decompress_kb_s: float
    model_bytes: int | None = None  # zlm only: the weights the decompressor needs

    @property
    def bits_per_byte(self) -> float:
        return 8 * self.compressed_bytes / max(self.original_bytes, 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "bits_per_byte": self.bits_per_byte}


def _external(name: str, enc: list[str], dec: list[str], data: bytes, file: str) -> Row | None:
    if shutil.which(enc[0]) is None:
        return None
    t0 = time.perf_counter()
    packed = subprocess.run(enc, input=data, capture_output=True, check=True).stdout
    t1 = time.perf_counter()
    back = subprocess.run(dec, input=packed, capture_output=True, check=True).stdout
    t2 = time.perf_counter()
    if back != data:
        raise RuntimeError(f"{name} did not round-trip {file}")
    kb = len(data) / 1000
    return Row(file, name, len(data), len(packed), kb / (t1 - t0), kb / (t2 - t1))


def _zlm(lm, name: str, data: bytes, file: str, adapt: DynamicConfig | None,
         streams: int | None, model_bytes: int) -> Row:
    blob, r = compress_bytes(lm, data, adapt, streams)
    back, d = decompress_bytes(lm, blob, file)
    assert back == data
    kb = len(data) / 1000
    return Row(file, name, len(data), len(blob), kb / r.seconds, kb / d.seconds, model_bytes)


def compare_compressors(run, files: list[Path], adapt: DynamicConfig | None = DynamicConfig(),
                        streams: int | None = None, externals: bool = True) -> tuple[list[Row], list[str]]:
    """Rows for every file and compressor, and notes (e.g. a compressor not installed)."""
    return compare_loaded(load_for_coding(run), files, adapt, streams, externals)


def compare_loaded(lm, files: list[Path], adapt: DynamicConfig | None = DynamicConfig(),
                   streams: int | None = None, externals: bool = True) -> tuple[list[Row], list[str]]:
    """`compare_compressors` with a model already loaded (`load_for_coding`)."""
    model_bytes = sum(t.numel() * t.element_size() for t in lm.model.state_dict().values())
    rows, notes = [], []
    for f in files:
        data = Path(f).read_bytes()
        name = str(f)
        rows.append(_zlm(lm, "zlm", data, name, None, streams, model_bytes))
        if adapt is not None:
            rows.append(_zlm(lm, "zlm --adapt", data, name, adapt, streams, model_bytes))
        for label, enc, dec in EXTERNAL if externals else ():
            row = _external(label, enc, dec, data, name)
            if row is None:
                note = f"{label}: `{enc[0]}` is not installed; skipped"
                if note not in notes:
                    notes.append(note)
            else:
                rows.append(row)
    return rows, notes


def markdown(rows: list[Row], notes: list[str] = ()) -> str:
    """A results table: one line per file and compressor."""
    out = ["| file | compressor | original bytes | compressed bytes | bits/byte | "
           "compress KB/s | decompress KB/s | model bytes |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        model = f"{r.model_bytes:,}" if r.model_bytes is not None else ""
        out.append(f"| {Path(r.file).name} | {r.compressor} | {r.original_bytes:,} | "
                   f"{r.compressed_bytes:,} | {r.bits_per_byte:.3f} | {r.compress_kb_s:,.1f} | "
                   f"{r.decompress_kb_s:,.1f} | {model} |")
    return "\n".join(out + [f"\n{n}" for n in notes])

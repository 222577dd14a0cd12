"""`zlm compress` / `zlm decompress`: the .zlmz container around the model-driven coder.

Owns the file format, the model's identity (`model_id`), and `compress_bytes` /
`decompress_bytes` (and their file-level wrappers behind the CLI). The coding itself is
`zlm.inference.modelcoder`'s loop over `zlm.inference.symbols.Alphabet` symbols.

Format (version 1, little-endian):

    "ZLMZ"  u8 version  u8 flags (bit 0: --adapt)
    32 B    model id: SHA-256 of the model config, every tensor (name, dtype, shape,
            bytes) and the tokenizer file
    u64     original length in bytes      u64 symbols N      u32 streams S
    u64     length of the coded data that follows the header
    8 B     SHA-256 of the original bytes (first 8 bytes)
    u8+str  precision ("fp32")            u8+str  kernel path (see `kernel_path`)
    --adapt: f64 lr, f64 decay, u32 segment
    u32     CRC-32 of everything above
    ...     the range coder's bytes

Decoding needs the same model and the same kernel path (zlm's step kernels, torch build,
CPU instruction set, thread count): the header names both and the decoder refuses
another one with a one-line error, as it does a damaged or truncated file (header CRC,
text checksum, bytes read past the end). Nothing is written unless the whole file
decodes and checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from zlm.errors import UsageError, ZlmError
from zlm.inference.dynamic import DynamicConfig
from zlm.inference.load import LoadedModel, load_model
from zlm.inference.modelcoder import (
    PROB_BITS,
    THREADS,
    DecodeSide,
    EncodeSide,
    Layout,
    fixed_threads,
    run_coder,
)
from zlm.inference.symbols import Alphabet
from zlm.model.cells.cpu_ext import load_extension

MAGIC = b"ZLMZ"
VERSION = 1
_FIXED = struct.Struct("<4sBB32sQQIQ8s")  # magic .. text checksum
_ADAPT = struct.Struct("<ddI")
SUFFIX = ".zlmz"


class CompressedFileError(ZlmError):
    """A .zlmz file that cannot be decoded here: damaged, truncated or for another model."""


def model_id(lm: LoadedModel) -> bytes:
    """SHA-256 of what determines the model's predictions: config, tensors, tokenizer."""
    h = hashlib.sha256(b"zlm-model-v1\0")
    h.update(json.dumps(lm.model_config.to_dict(), sort_keys=True).encode())
    for name, t in sorted(lm.model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    tok = lm.path / lm.tokenizer.file_name
    h.update(tok.read_bytes() if tok.is_file() else json.dumps(lm.tokenizer.meta()).encode())
    return h.digest()


def kernel_path() -> str:
    """What the decoder's arithmetic must match to reproduce every distribution: zlm's
    step kernels and frequency tables, torch's and numpy's builds, the CPU's instruction
    set as torch dispatches it, and the thread count."""
    step = "cpp" if load_extension() is not None else "torch"  # the Stepper's two paths
    return (f"stepper-{step}/t{THREADS}/p{PROB_BITS} torch {torch.__version__} numpy "
            f"{np.__version__} {torch.backends.cpu.get_cpu_capability()}")


@dataclass(frozen=True)
class Header:
    model: bytes
    length: int  # original bytes
    symbols: int
    streams: int
    payload: int  # bytes of coded data after the header
    checksum: bytes  # first 8 bytes of SHA-256 of the original bytes
    precision: str
    kernel: str
    adapt: DynamicConfig | None

    def pack(self) -> bytes:
        flags = 1 if self.adapt else 0
        out = _FIXED.pack(MAGIC, VERSION, flags, self.model, self.length, self.symbols,
                          self.streams, self.payload, self.checksum)
        for s in (self.precision, self.kernel):
            b = s.encode("ascii")
            out += bytes((len(b),)) + b
        if self.adapt:
            out += _ADAPT.pack(self.adapt.lr, self.adapt.decay, self.adapt.segment)
        return out + struct.pack("<I", zlib.crc32(out))

    @staticmethod
    def unpack(data: bytes, name: str) -> tuple[Header, int]:
        """(header, offset of the payload), or a one-line CompressedFileError."""
        if data[:4] != MAGIC:
            raise CompressedFileError(f"{name} is not a zlm compressed file (no ZLMZ signature)")
        if len(data) < 5 or data[4] != VERSION:
            v = data[4] if len(data) > 4 else "?"
            raise CompressedFileError(f"{name} has format version {v}; this zlm reads version "
                                      f"{VERSION}: decompress it with the zlm that wrote it")
        try:
            magic, _, flags, model, length, n, streams, payload, checksum = _FIXED.unpack_from(data)
            pos, strs = _FIXED.size, []
            for _ in range(2):
                k = data[pos]
                strs.append(data[pos + 1 : pos + 1 + k].decode("ascii"))
                pos += 1 + k
            adapt = None
            if flags & 1:
                lr, decay, segment = _ADAPT.unpack_from(data, pos)
                pos += _ADAPT.size
            (crc,) = struct.unpack_from("<I", data, pos)
        except (struct.error, IndexError, UnicodeDecodeError):
            raise CompressedFileError(f"{name} is truncated (its header is incomplete)") from None
        if zlib.crc32(data[:pos]) != crc:
            raise CompressedFileError(f"{name} is damaged (its header fails its CRC)")
        try:
            adapt = DynamicConfig(lr, decay, segment) if flags & 1 else None
        except ZlmError:
            raise CompressedFileError(f"{name} is damaged (impossible --adapt settings)") from None
        return Header(model, length, n, streams, payload, checksum, *strs, adapt), pos + 4


@dataclass(frozen=True)
class CompressResult:
    """What `zlm compress` / `zlm decompress` report."""

    original_bytes: int
    compressed_bytes: int
    header_bytes: int
    characters: int  # of the original as UTF-8 (each undecodable byte counts as one)
    symbols: int
    streams: int
    seconds: float
    model_bits: float | None = None  # the model's own code length (compress only)
    adapt: DynamicConfig | None = None

    def to_dict(self) -> dict:
        bits = 8 * self.compressed_bytes
        return {
            "original_bytes": self.original_bytes, "compressed_bytes": self.compressed_bytes,
            "header_bytes": self.header_bytes, "characters": self.characters,
            "symbols": self.symbols, "streams": self.streams,
            "bits_per_char": bits / max(self.characters, 1),
            "bits_per_byte": bits / max(self.original_bytes, 1),
            "model_bits_per_char": None if self.model_bits is None
            else self.model_bits / max(self.characters, 1),
            "seconds": self.seconds, "kb_per_s": self.original_bytes / 1000 / max(self.seconds, 1e-9),
            "adapt": None if self.adapt is None else self.adapt.to_dict(),
        }


def _characters(data: bytes) -> int:
    return len(data.decode("utf-8", "surrogateescape"))


def compress_bytes(lm: LoadedModel, data: bytes, adapt: DynamicConfig | None = None,
                   streams: int | None = None,
                   progress: Callable[[float], None] | None = None) -> tuple[bytes, CompressResult]:
    """data -> the .zlmz bytes, and what it cost. lm: loaded on the CPU in fp32."""
    t0 = time.perf_counter()
    alphabet = Alphabet(lm.tokenizer)
    sym, esc = alphabet.encode(data)
    layout = Layout.choose(len(sym), streams)
    side = EncodeSide(sym, esc, layout, alphabet)
    with fixed_threads():
        bits = run_coder(lm.model, alphabet, layout, side, adapt, measure=True, progress=progress)
    payload = side.coder.finish()
    head = Header(model_id(lm), len(data), len(sym), layout.streams, len(payload),
                  hashlib.sha256(data).digest()[:8], lm.runtime.precision, kernel_path(),
                  adapt).pack()
    out = head + payload
    return out, CompressResult(len(data), len(out), len(head), _characters(data), len(sym),
                               layout.streams, time.perf_counter() - t0, bits, adapt)


def decompress_bytes(lm: LoadedModel, blob: bytes, name: str = "input",
                     progress: Callable[[float], None] | None = None) -> tuple[bytes, CompressResult]:
    """.zlmz bytes -> the original bytes, checked; a one-line CompressedFileError otherwise."""
    t0 = time.perf_counter()
    header, pos = Header.unpack(blob, name)
    if header.model != model_id(lm):
        raise CompressedFileError(
            f"{name} was compressed with a different model (id {header.model.hex()[:12]}, this "
            f"one is {model_id(lm).hex()[:12]}); pass the RUN it was compressed with")
    if header.kernel != kernel_path() or header.precision != lm.runtime.precision:
        raise CompressedFileError(
            f"{name} was compressed with kernel path '{header.precision} {header.kernel}' but "
            f"this is '{lm.runtime.precision} {kernel_path()}'; decompress with the same "
            "zlm/torch build on the same kind of CPU")
    alphabet = Alphabet(lm.tokenizer)
    layout = Layout(header.symbols, header.streams)
    if header.symbols and not 1 <= header.streams <= header.symbols:
        raise CompressedFileError(f"{name} is damaged (impossible stream layout)")
    if len(blob) - pos < header.payload:
        raise CompressedFileError(f"{name} is truncated ({len(blob) - pos:,} of "
                                  f"{header.payload:,} bytes of coded data)")
    if len(blob) - pos > header.payload:
        raise CompressedFileError(f"{name} is damaged ({len(blob) - pos - header.payload:,} "
                                  "bytes after the coded data)")
    side = DecodeSide(blob[pos:], layout, alphabet)
    with fixed_threads():
        run_coder(lm.model, alphabet, layout, side, header.adapt, progress=progress)
    data = alphabet.decode(layout.flatten(side.sym), layout.flatten(side.esc))
    if side.coder.overrun:
        raise CompressedFileError(f"{name} is damaged (the coded data ends early)")
    if len(data) != header.length or hashlib.sha256(data).digest()[:8] != header.checksum:
        raise CompressedFileError(f"{name} is damaged (the decoded text fails its checksum)")
    return data, CompressResult(len(data), len(blob), pos, _characters(data), header.symbols,
                                header.streams, time.perf_counter() - t0, None, header.adapt)


def load_for_coding(run) -> LoadedModel:
    """The model as both sides must run it: on the CPU, in fp32."""
    return load_model(run, "cpu", "fp32")


def _output(path: Path | None, default: Path, force: bool) -> Path:
    out = Path(path) if path is not None else default
    if out.exists() and not force:
        raise UsageError(f"{out} exists; pass --force to overwrite it or -o to write elsewhere")
    if not out.parent.is_dir():
        raise UsageError(f"-o {out}: the folder {out.parent} does not exist")
    return out


def compress_file(run, file: Path, out: Path | None = None, adapt: DynamicConfig | None = None,
                  streams: int | None = None, force: bool = False,
                  progress=None) -> tuple[Path, CompressResult]:
    """`zlm compress RUN FILE [-o OUT]` (OUT defaults to FILE.zlmz). progress: a factory
    (label, total_bytes) -> context manager that is called with the fraction done."""
    data = read_input(file, "FILE")
    out = _output(out, Path(str(file) + SUFFIX), force)
    lm = load_for_coding(run)
    with (progress or _no_progress)("compress", len(data)) as tick:
        blob, result = compress_bytes(lm, data, adapt, streams, tick)
    write_atomic(out, blob)
    return out, result


def decompress_file(run, file: Path, out: Path | None = None, force: bool = False,
                    progress=None) -> tuple[Path, CompressResult]:
    """`zlm decompress RUN FILE.zlmz [-o OUT]` (OUT defaults to FILE without .zlmz)."""
    blob = read_input(file, "FILE")
    name = Path(file).name
    default = Path(str(file)[: -len(SUFFIX)]) if name.endswith(SUFFIX) and name != SUFFIX \
        else Path(str(file) + ".out")
    out = _output(out, default, force)
    lm = load_for_coding(run)
    header, _ = Header.unpack(blob, str(file))
    with (progress or _no_progress)("decompress", header.length) as tick:
        data, result = decompress_bytes(lm, blob, str(file), tick)
    write_atomic(out, data)
    return out, result


class _no_progress:
    def __init__(self, label: str, total: int):
        pass

    def __enter__(self):
        return None

    def __exit__(self, *exc) -> None:
        pass


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename: never a partial file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_input(path: Path, what: str) -> bytes:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{what} {path} does not exist; pass a file")
    return path.read_bytes()

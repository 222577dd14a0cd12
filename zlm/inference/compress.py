"""`zlm compress` / `zlm decompress`: the .zlmz container around the model-driven coder.

Owns the file format, the model's identity (`model_id`), and `compress_bytes` /
`decompress_bytes` (and their file-level wrappers behind the CLI). The coding itself is
`zlm.inference.modelcoder`'s loop over `zlm.inference.symbols.Alphabet` symbols: the LSTM's
prediction mixed with an escape model, a context model and a match model, per stream
and block.

Format (version 2; integers little-endian, varint = LEB128):

    "ZLMZ"  u8 version (2)  u8 flags (bit 0: --adapt, bit 1: its settings follow)
    8 B     model id: SHA-256 of the model config, every tensor (name, dtype, shape, bytes)
            and the tokenizer file (first 8 bytes)
    4 B     kernel id: SHA-256 of the precision and kernel path (first 4 bytes)
    u32     CRC-32 of the original bytes
    varint  original length L in bytes        varint  streams S (0 when L = 0)
    --adapt with settings other than the defaults: f64 lr, f64 decay, varint segment
    bits    one per block, in block order (see `Layout`), packed 8 to a byte, bit 0 first:
            1 = model-coded, 0 = stored
    varint  each model-coded block's bytes minus its symbols, zigzag-coded (0 for ASCII
            text and a char model)
    varint  length of the range coder's bytes
    u32     CRC-32 of everything above
    ...     the stored blocks' bytes, in block order, then the range coder's bytes

The header is 29 bytes for an empty file, about 32 for a short text, and a bit and a
byte or so more for each further block (blocks: at most 64 KiB of one stream). The encoder
model-codes a block only when that is smaller than storing it, and stores everything
when the model saves nothing overall, so no file grows by more than its header.

Decoding needs the same model and the same kernel path (zlm's step kernel - the C++
Decoder on every core for static coding, the "cpp" step on one thread with `--adapt` -,
torch and numpy builds, CPU instruction set): the header names both by hash and the
decoder refuses another one with a one-line error, as it does an older format, a damaged
or truncated file (header CRC, lengths, text checksum). Nothing is written unless the
whole file decodes and checks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
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

from zlm.errors import UsageError, ZlmError, require_file
from zlm.inference.dynamic import DynamicConfig
from zlm.inference.load import LoadedModel, load_model
from zlm.inference.modelcoder import (
    BLOCK_BYTES,
    PROB_BITS,
    THREADS,
    DecodeSide,
    EncodeSide,
    Layout,
    fixed_threads,
    grid,
    run_coder,
)
from zlm.inference.symbols import Alphabet
from zlm.model.cells import compiled
from zlm.model.cells.cpu_ext import cpu_vendor, load_extension
from zlm.model.cells.decoder_tiles import table_fits

MAGIC = b"ZLMZ"
VERSION = 2
_FIXED = struct.Struct("<4sBB8s4sI")  # magic .. text checksum
_ADAPT = struct.Struct("<dd")
_FLAGS = 0b11  # the flag bits this version knows
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


def coder_kernel(adapt) -> str:
    """The Stepper kernel a new file is coded with: "decode" (the C++ Decoder, every core: its
    sums do not depend on the thread count) for static coding where it runs, else "cpp" on
    THREADS threads (`--adapt`: dynamic evaluation's torch steps must run on as many
    threads on both sides)."""
    ext = load_extension()
    return "decode" if adapt is None and ext is not None and hasattr(ext, "Decoder") else "cpp"


def kernel_path(kernel: str = "cpp", adapt: bool = False, hidden: int = 0, looked_up: bool = True) -> str:
    """What the decoder's arithmetic must match to reproduce every distribution: zlm's
    step kernel (the Decoder's product, or the "cpp" step and its thread count; " layer0-product"
    where the model's vocabulary is too large for the table of layer 0's pre-activations,
    `decoder_tiles.table_fits`, and the step multiplies the embedding instead) and
    frequency tables, torch's and numpy's builds (numpy computes every softmax, log and
    exp of the mixing) and the CPU's instruction set as torch dispatches it. With --adapt
    the dynamic-evaluation steps run the model's cell (`hidden` units) over windows too:
    where its fp32 recurrent product is MKL's packed GEMM, the path says so (" cell-mkl",
    and the vendor where the CPU is not Intel's, as MKL picks its code by CPU; oneDNN's, the
    product files were coded with before, adds nothing, so those files still decode); where
    its fp32 weight gradients are torch.mm on the window's buffers instead of oneDNN's
    products on transposed copies (CPUs without AVX-512: `compiled.transposed_grads`), it
    adds " grads-mm"."""
    ext = load_extension()
    if ext is None:
        step = "stepper-torch/t" + str(THREADS)
    elif kernel == "decode":  # fp32 weights: the AVX-512 builds share one product
        product = ext.decoder_kernel()
        step = "stepper-decode-" + ("avx512" if product.startswith("avx512") else product)
    else:
        step = "stepper-cpp/t" + str(THREADS)
    if not looked_up:
        step += " layer0-product"
    cell = ""
    product = compiled.recurrent_backend(ext, hidden=hidden) if adapt and ext is not None else None
    if product == "mkl":
        cell = " cell-mkl" if compiled.on_intel() else f" cell-mkl-{cpu_vendor() or 'unknown'}"
    if product is not None and compiled.weight_grads_by_mm(ext, hidden):
        cell += " grads-mm"
    return (f"{step}/p{PROB_BITS} torch {torch.__version__} numpy "
            f"{np.__version__} {torch.backends.cpu.get_cpu_capability()}{cell}")


def kernel_id(precision: str, kernel: str = "cpp", adapt: bool = False, hidden: int = 0,
              looked_up: bool = True) -> bytes:
    return hashlib.sha256(f"{precision} {kernel_path(kernel, adapt, hidden, looked_up)}".encode()).digest()[:4]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _zigzag(n: int) -> int:
    return 2 * n if n >= 0 else -2 * n - 1


def _unzigzag(n: int) -> int:
    return n >> 1 if not n & 1 else -((n + 1) >> 1)


class _Truncated(Exception):
    pass


class _Reader:
    def __init__(self, data: bytes, pos: int):
        self.data, self.pos = data, pos

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise _Truncated
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def varint(self) -> int:
        n = shift = 0
        while True:
            b = self.take(1)[0]
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return n
            if shift > 63:
                raise ValueError("varint too long")


@dataclass(frozen=True)
class Header:
    model: bytes  # 8 bytes of `model_id`
    kernel: bytes  # 4 bytes of `kernel_id`
    checksum: int  # CRC-32 of the original bytes
    length: int  # original bytes
    streams: int
    adapt: DynamicConfig | None
    coded: tuple[bool, ...]  # per block: model-coded (else stored)
    symbols: tuple[int, ...]  # per model-coded block
    payload: int  # bytes of range coder output

    def pack(self) -> bytes:
        explicit = self.adapt is not None and self.adapt != DynamicConfig()
        flags = (1 if self.adapt else 0) | (2 if explicit else 0)
        out = bytearray(_FIXED.pack(MAGIC, VERSION, flags, self.model, self.kernel, self.checksum))
        out += _varint(self.length) + _varint(self.streams)
        if explicit:
            out += _ADAPT.pack(self.adapt.lr, self.adapt.decay) + _varint(self.adapt.segment)
        bits = bytearray((len(self.coded) + 7) // 8)
        for j, c in enumerate(self.coded):
            bits[j >> 3] |= c << (j & 7)
        out += bits
        for n, size in zip(self.symbols, self._coded_sizes(), strict=True):
            out += _varint(_zigzag(size - n))
        out += _varint(self.payload)
        return bytes(out) + struct.pack("<I", zlib.crc32(out))

    def _coded_sizes(self) -> list[int]:
        """The byte length of each model-coded block."""
        blocks = Layout(self.length, self.streams).blocks()
        return [z - a for (_, a, z), c in zip(blocks, self.coded, strict=True) if c]

    @staticmethod
    def unpack(data: bytes, name: str) -> tuple[Header, int]:
        """(header, offset of the stored blocks), or a one-line CompressedFileError."""
        if data[:4] != MAGIC:
            raise CompressedFileError(f"{name} is not a zlm compressed file (no ZLMZ signature)")
        if len(data) < 5 or data[4] != VERSION:
            v = data[4] if len(data) > 4 else "?"
            raise CompressedFileError(f"{name} has format version {v}; this zlm reads version "
                                      f"{VERSION}: decompress it with the zlm that wrote it")
        damaged = CompressedFileError(f"{name} is damaged (its header fails its CRC)")
        r = _Reader(data, _FIXED.size)
        try:
            _, _, flags, model, kernel, checksum = _FIXED.unpack_from(data)
            length, streams = r.varint(), r.varint()
            if flags & ~_FLAGS or not (streams == 0 if length == 0 else 1 <= streams <= length):
                raise damaged
            adapt = None
            if flags & 2:
                lr, decay = _ADAPT.unpack(r.take(_ADAPT.size))
                adapt = (lr, decay, r.varint())
            elif flags & 1:
                adapt = ()
            if max(streams, length // BLOCK_BYTES) > 8 * len(data):  # more blocks than bits
                raise _Truncated
            blocks = Layout(length, streams).blocks()
            bits = r.take((len(blocks) + 7) // 8)
            coded = tuple(bool(bits[j >> 3] >> (j & 7) & 1) for j in range(len(blocks)))
            sizes = [z - a for (_, a, z), c in zip(blocks, coded, strict=True) if c]
            symbols = tuple(size - _unzigzag(r.varint()) for size in sizes)
            payload = r.varint()
            (crc,) = struct.unpack("<I", r.take(4))
        except (_Truncated, struct.error):
            raise CompressedFileError(f"{name} is truncated (its header is incomplete)") from None
        except ValueError:
            raise damaged from None
        if zlib.crc32(data[: r.pos - 4]) != crc:
            raise damaged
        try:
            adapt = None if adapt is None else DynamicConfig(*adapt)
        except ZlmError:
            raise CompressedFileError(f"{name} is damaged (impossible --adapt settings)") from None
        return Header(model, kernel, checksum, length, streams, adapt, coded, symbols, payload), r.pos


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
    model_bits: float | None = None  # the mixed prediction's code length, all symbols (compress only)
    adapt: DynamicConfig | None = None
    blocks: int = 0
    stored_blocks: int = 0
    coded_bits: float | None = None  # model_bits of the model-coded blocks only

    def to_dict(self) -> dict:
        bits = 8 * self.compressed_bytes
        return {
            "original_bytes": self.original_bytes, "compressed_bytes": self.compressed_bytes,
            "header_bytes": self.header_bytes, "characters": self.characters,
            "symbols": self.symbols, "streams": self.streams,
            "blocks": self.blocks, "stored_blocks": self.stored_blocks,
            "bits_per_char": bits / max(self.characters, 1),
            "bits_per_byte": bits / max(self.original_bytes, 1),
            "model_bits_per_char": None if self.model_bits is None
            else self.model_bits / max(self.characters, 1),
            "seconds": self.seconds, "kb_per_s": self.original_bytes / 1000 / max(self.seconds, 1e-9),
            "adapt": None if self.adapt is None else self.adapt.to_dict(),
        }


def _characters(data: bytes) -> int:
    return len(data.decode("utf-8", "surrogateescape"))


def _streams(blocks: list[tuple[int, int, int]], ext: list[np.ndarray], streams: int):
    """Blocks' extended symbols -> (steps, S) grid, the block of each cell, lengths (S,)."""
    cols = [[] for _ in range(streams)]
    ids = [[] for _ in range(streams)]
    for j, ((s, _, _), e) in enumerate(zip(blocks, ext, strict=True)):
        cols[s].append(e)
        ids[s].append(np.full(len(e), j, dtype=np.int64))
    cols = [np.concatenate(c) if c else np.zeros(0, dtype=np.int64) for c in cols]
    ids = [np.concatenate(c) if c else np.zeros(0, dtype=np.int64) for c in ids]
    return grid(cols, -1), grid(ids, -1), np.array([len(c) for c in cols], dtype=np.int64)


def compress_bytes(lm: LoadedModel, data: bytes, adapt: DynamicConfig | None = None,
                   streams: int | None = None,
                   progress: Callable[[float], None] | None = None) -> tuple[bytes, CompressResult]:
    """data -> the .zlmz bytes, and what it cost. lm: loaded on the CPU in fp32."""
    t0 = time.perf_counter()
    alphabet = Alphabet(lm.tokenizer)
    layout = Layout.choose(data, streams)
    blocks = layout.blocks()
    ext = [alphabet.extend(*alphabet.encode(data[a:z])) for _, a, z in blocks]
    cells, owner, lengths = _streams(blocks, ext, layout.streams)
    side = EncodeSide(cells, owner, alphabet)
    kernel = coder_kernel(adapt)
    with fixed_threads() if kernel == "cpp" else contextlib.nullcontext():
        bits = run_coder(lm.model, alphabet, lengths, side, adapt, progress=progress, kernel=kernel)
    # Model-code a block when its coded bits and its header entry take fewer bytes than it.
    costs = side.costs(len(blocks))
    coded = np.array([math.ceil(c / 8) + len(_varint(_zigzag(z - a - len(e)))) < z - a
                      for c, e, (_, a, z) in zip(costs, ext, blocks, strict=True)], dtype=bool)
    ids = model_id(lm)[:8], kernel_id(lm.runtime.precision, kernel, adapt is not None, lm.model_config.hidden,
                                      table_fits(lm.model)), zlib.crc32(data)

    def container(coded: np.ndarray) -> tuple[bytes, bytes]:
        """(header, stored blocks + range coder bytes)."""
        payload = side.payload(coded)
        head = Header(*ids, len(data), layout.streams, adapt, tuple(coded.tolist()),
                      tuple(len(e) for e, c in zip(ext, coded, strict=True) if c), len(payload))
        stored = b"".join(data[a:z] for (_, a, z), c in zip(blocks, coded, strict=True) if not c)
        return head.pack(), stored + payload

    head, body = container(coded)
    if coded.any():
        head_s, body_s = container(np.zeros(len(blocks), dtype=bool))
        if len(head_s) + len(body_s) <= len(head) + len(body):
            coded, head, body = np.zeros(len(blocks), dtype=bool), head_s, body_s
    owner_flat = owner[owner >= 0]
    coded_bits = float(bits[owner >= 0][coded[owner_flat]].sum()) if len(owner_flat) else 0.0
    out = head + body
    return out, CompressResult(len(data), len(out), len(head), _characters(data),
                               int(lengths.sum()), layout.streams, time.perf_counter() - t0,
                               float(bits.sum()), adapt, len(blocks), int((~coded).sum()), coded_bits)


# The cell's settings an --adapt file may have been coded under on this same machine: the
# compiled cell has both fp32 products (MKL's, oneDNN's) and both weight-gradient paths, so
# a file coded before zlm changed its choice here still decodes (first match wins).
_CELL_VARIANTS = tuple({**product, **grads} for product in ({}, {"USE_MKL": False})
                       for grads in ({}, {"TRANSPOSED_GRADS": True}, {"TRANSPOSED_GRADS": False}))


@contextlib.contextmanager
def _cell_settings(settings: dict):
    """`compiled`'s module settings (USE_MKL, TRANSPOSED_GRADS) set for the block, then
    restored: decoding a file reproduces the arithmetic it was coded with. Not for a process
    that trains in another thread meanwhile (zlm decompress is a command of its own)."""
    before = {key: getattr(compiled, key) for key in settings}
    try:
        for key, value in settings.items():
            setattr(compiled, key, value)
        yield
    finally:
        for key, value in before.items():
            setattr(compiled, key, value)


def _matching_kernel(lm: LoadedModel, header: Header, name: str) -> tuple[str, dict]:
    """The Stepper kernel and cell settings whose kernel id is the file's; else a one-line
    CompressedFileError. "cpp" also matches files coded before "decode"; an --adapt file
    also tries the cell's other products and weight-gradient paths (`_CELL_VARIANTS`)."""
    prec = lm.runtime.precision
    adapt = header.adapt is not None
    hidden, looked_up = lm.model_config.hidden, table_fits(lm.model)
    for cell in _CELL_VARIANTS if adapt else ({},):
        with _cell_settings(cell):
            kernel = next((k for k in dict.fromkeys((coder_kernel(header.adapt), "cpp"))
                           if header.kernel == kernel_id(prec, k, adapt, hidden, looked_up)), None)
        if kernel is not None:
            return kernel, cell
    mine = coder_kernel(header.adapt)
    raise CompressedFileError(
        f"{name} was compressed with another kernel path (id {header.kernel.hex()}; this is "
        f"{kernel_id(prec, mine, adapt, hidden, looked_up).hex()}: "
        f"'{prec} {kernel_path(mine, adapt, hidden, looked_up)}'); decompress with "
        "the same zlm/torch build on the same kind of CPU")


def decompress_bytes(lm: LoadedModel, blob: bytes, name: str = "input",
                     progress: Callable[[float], None] | None = None) -> tuple[bytes, CompressResult]:
    """.zlmz bytes -> the original bytes, checked; a one-line CompressedFileError otherwise."""
    t0 = time.perf_counter()
    header, pos = Header.unpack(blob, name)
    mine = model_id(lm)
    if header.model != mine[:8]:
        raise CompressedFileError(
            f"{name} was compressed with a different model (id {header.model.hex()}, this "
            f"one is {mine[:8].hex()}); pass the RUN it was compressed with")
    kernel, cell = _matching_kernel(lm, header, name)
    alphabet = Alphabet(lm.tokenizer)
    blocks = Layout(header.length, header.streams).blocks()
    stored_bytes = sum(z - a for (_, a, z), c in zip(blocks, header.coded, strict=True) if not c)
    need = stored_bytes + header.payload
    if len(blob) - pos < need:
        raise CompressedFileError(f"{name} is truncated ({len(blob) - pos:,} of {need:,} bytes "
                                  "after the header)")
    if len(blob) - pos > need:
        raise CompressedFileError(f"{name} is damaged ({len(blob) - pos - need:,} bytes after "
                                  "the coded data)")
    counts = iter(header.symbols)
    raw, ext, at = [], [], pos
    for (_, a, z), c in zip(blocks, header.coded, strict=True):
        if c:
            n = next(counts)
            if not 0 <= n <= 4 * (z - a) + 16:  # no tokenizer makes that many of z - a bytes
                raise CompressedFileError(f"{name} is damaged (impossible block length)")
            raw.append(None)
            ext.append(np.full(n, -1, dtype=np.int64))
        else:
            raw.append(blob[at : at + z - a])
            ext.append(alphabet.extend(*alphabet.encode(raw[-1])))
            at += z - a
    cells, owner, lengths = _streams(blocks, ext, header.streams)
    coded = np.array(header.coded + (False,), dtype=bool)[owner]  # owner -1 -> False
    side = DecodeSide(blob[at:], cells, coded, alphabet)
    with fixed_threads() if kernel == "cpp" else contextlib.nullcontext(), _cell_settings(cell):
        run_coder(lm.model, alphabet, lengths, side, header.adapt, progress=progress, kernel=kernel)
    parts, fill = [], [0] * header.streams
    for (s, _, _), r, e in zip(blocks, raw, ext, strict=True):
        if r is None:
            got = cells[fill[s] : fill[s] + len(e), s]
            parts.append(alphabet.decode(*alphabet.split(got)))
        else:
            parts.append(r)
        fill[s] += len(e)
    data = b"".join(parts)
    if len(data) != header.length or zlib.crc32(data) != header.checksum:
        raise CompressedFileError(f"{name} is damaged (the decoded text fails its checksum)")
    return data, CompressResult(len(data), len(blob), pos, _characters(data), int(lengths.sum()),
                                header.streams, time.perf_counter() - t0, None, header.adapt,
                                len(blocks), header.coded.count(False))


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
    require_file(path, what, "a file")
    return path.read_bytes()

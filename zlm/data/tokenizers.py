"""Tokenizers: text <-> int64 ids, for the four kinds zlm prepares data with.

Owns the `Tokenizer` interface and its four implementations, how each is trained
(`train_tokenizer`), saved next to the data and loaded back (`load_tokenizer`).

    char      Unicode code points; vocabulary = sorted set of the training split's
              characters (+ U+FFFD as the replacement entry with `--unknown replace`).
    byte      UTF-8 bytes; vocabulary 0..255, nothing is ever unknown.
    bpe       sentencepiece BPE / unigram with identity normalization, no dummy prefix,
    unigram   whitespace kept, byte fallback: decode(encode(text)) == text exactly.

Encoding is vectorised with numpy (a dense code point -> id table for char), so
`zlm.data.prepare` can tokenize large corpora chunk by chunk. Files are JSON or the
sentencepiece model proto, never pickle.
"""

from __future__ import annotations

import codecs
import io
import json
import pathlib
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import numpy as np

from zlm.errors import DataError, UsageError

KINDS = ("char", "byte", "bpe", "unigram")
UNKNOWN_POLICIES = ("error", "replace")
REPLACEMENT = "\ufffd"
MAX_CODEPOINT = 0x110000
DEFAULT_SUBWORD_VOCAB = 1024
_SP_META = "\u2581"  # sentencepiece's space marker; escaped through byte fallback on encode


def codepoints(text: str) -> np.ndarray:
    """The code points of `text` as an unsigned array, shape (len(text),), no Python loop."""
    if text.isascii():
        return np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4")


class StreamDecoder(ABC):
    """Incremental id -> text, for streaming samples one token at a time."""

    @abstractmethod
    def feed(self, token_id: int) -> str:
        """Consume one id; return the text it completes (may be empty)."""

    def flush(self) -> str:
        """Return whatever is still buffered (an incomplete UTF-8 sequence -> U+FFFD)."""
        return ""


class Tokenizer(ABC):
    """Maps text to ids in [0, vocab_size) and back."""

    kind: str
    vocab_size: int
    file_name: str

    @abstractmethod
    def encode(self, text: str, unknown: str = "error") -> np.ndarray:
        """Text -> ids, int64 shape (N,). Unknown characters raise `DataError` naming the
        first one and its character position, or map to the replacement id with
        unknown="replace"."""

    @abstractmethod
    def decode(self, ids) -> str:
        """Ids (any int sequence or array) -> text."""

    @abstractmethod
    def stream_decoder(self) -> StreamDecoder:
        """A fresh incremental decoder."""

    @abstractmethod
    def save(self, directory) -> pathlib.Path:
        """Write the tokenizer file into `directory`; return its path."""

    def meta(self) -> dict:
        """The `tokenizer` object of dataset.json."""
        return {"kind": self.kind, "vocab_size": self.vocab_size, "file": self.file_name}


def check_unknown(unknown: str, allowed: tuple[str, ...] = UNKNOWN_POLICIES) -> None:
    """UsageError naming --unknown unless `unknown` is one of `allowed` (every command's check)."""
    if unknown not in allowed:
        choices = ", ".join(allowed[:-1]) + f" or {allowed[-1]}"
        raise UsageError(f"--unknown {unknown} is not a policy; use {choices}")


# ----------------------------------------------------------------------------- char


class _CharStream(StreamDecoder):
    def __init__(self, chars: Sequence[str]):
        self._chars = chars

    def feed(self, token_id: int) -> str:
        return self._chars[int(token_id)]


class CharTokenizer(Tokenizer):
    """One id per Unicode code point; ids follow the sorted order of the characters."""

    kind = "char"
    file_name = "tokenizer.json"

    def __init__(self, chars: Iterable[str]):
        self.chars: list[str] = sorted(set(chars))
        if not self.chars:
            raise DataError("the training text has no characters; pass a non-empty corpus")
        self.vocab_size = len(self.chars)
        self.replacement_id = (
            self.chars.index(REPLACEMENT) if REPLACEMENT in self.chars else None
        )
        # Dense code point -> id table (-1 = unknown): 4.4 MB, one gather per chunk.
        self._table = np.full(MAX_CODEPOINT, -1, dtype=np.int32)
        self._table[[ord(c) for c in self.chars]] = np.arange(self.vocab_size, dtype=np.int32)

        # ASCII text with a vocabulary under 256: bytes.translate is a C-speed lookup;
        # 255 can never be an id then, so it marks characters outside the vocabulary.
        self._ascii = None
        if self.vocab_size < 256:
            self._ascii = np.where(self._table[:256] >= 0, self._table[:256], 255).astype(
                np.uint8).tobytes()

    def ids(self, text: str, unknown: str = "error") -> np.ndarray:
        """Like `encode` but uint8 or int32: the fast path `zlm.data.prepare` uses. (len(text),)"""
        check_unknown(unknown)
        if self._ascii is not None and text.isascii():
            out = text.encode("ascii").translate(self._ascii)
            if 255 not in out:
                return np.frombuffer(out, dtype=np.uint8)
        ids = self._table[codepoints(text)]  # (N,) int32, -1 where unknown
        missing = ids < 0
        if missing.any():
            pos = int(np.argmax(missing))
            if unknown == "replace" and self.replacement_id is not None:
                ids[missing] = self.replacement_id
            elif unknown == "replace":
                raise DataError(
                    "this vocabulary has no replacement character; prepare the data with "
                    "--unknown replace to be able to map unknown characters"
                )
            else:
                ch = text[pos]
                raise DataError(
                    f"character {ch!r} (U+{ord(ch):04X}) at character {pos} is not in the "
                    "vocabulary; pass --unknown replace to map unknown characters to U+FFFD"
                )
        return ids

    def encode(self, text: str, unknown: str = "error") -> np.ndarray:
        return self.ids(text, unknown).astype(np.int64)

    def decode(self, ids) -> str:
        chars = self.chars
        return "".join(chars[i] for i in np.asarray(ids, dtype=np.int64).tolist())

    def stream_decoder(self) -> StreamDecoder:
        return _CharStream(self.chars)

    def save(self, directory) -> pathlib.Path:
        path = pathlib.Path(directory) / self.file_name
        doc = {"kind": "char", "vocab": self.chars, "replacement_id": self.replacement_id}
        path.write_text(json.dumps(doc, ensure_ascii=True, indent=1) + "\n", encoding="utf-8")
        return path


# ----------------------------------------------------------------------------- byte


class _ByteStream(StreamDecoder):
    def __init__(self):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._dec.decode(bytes((int(token_id),)))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class ByteTokenizer(Tokenizer):
    """One id per UTF-8 byte; decoding replaces invalid sequences with U+FFFD."""

    kind = "byte"
    file_name = "tokenizer.json"
    vocab_size = 256

    def encode(self, text: str, unknown: str = "error") -> np.ndarray:
        check_unknown(unknown)
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return np.asarray(ids, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return _ByteStream()

    def save(self, directory) -> pathlib.Path:
        path = pathlib.Path(directory) / self.file_name
        path.write_text(json.dumps({"kind": "byte", "vocab_size": 256}) + "\n", encoding="utf-8")
        return path


# --------------------------------------------------------------------- sentencepiece


class _PieceStream(StreamDecoder):
    def __init__(self, sp):
        self._sp = sp
        self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        sp, i = self._sp, int(token_id)
        if sp.is_byte(i):
            return self._bytes.decode(bytes((int(sp.id_to_piece(i)[3:5], 16),)))
        head = self._bytes.decode(b"", final=True)
        if sp.is_control(i):
            return head
        if sp.is_unknown(i):
            return head + " \u2047 "  # what sentencepiece itself prints for <unk>
        return head + sp.id_to_piece(i).replace(_SP_META, " ")

    def flush(self) -> str:
        return self._bytes.decode(b"", final=True)


class SentencePieceTokenizer(Tokenizer):
    """sentencepiece BPE or unigram model; lossless thanks to identity normalization and
    byte fallback. A literal U+2581 in the text is encoded as its three UTF-8 byte pieces,
    because sentencepiece would otherwise decode it as a space."""

    file_name = "tokenizer.model"

    def __init__(self, kind: str, model_proto: bytes):
        import sentencepiece as spm

        self.kind = kind
        self._proto = bytes(model_proto)
        self.sp = spm.SentencePieceProcessor(model_proto=self._proto)
        self.vocab_size = int(self.sp.get_piece_size())
        self._meta_ids = [self.sp.piece_to_id(f"<0x{b:02X}>") for b in _SP_META.encode()]

    def encode(self, text: str, unknown: str = "error") -> np.ndarray:
        check_unknown(unknown)
        parts = text.split(_SP_META)
        ids: list[int] = list(self.sp.encode(parts[0]))
        for part in parts[1:]:
            ids += self._meta_ids
            ids += self.sp.encode(part)
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self.sp.decode(np.asarray(ids, dtype=np.int64).tolist())

    def stream_decoder(self) -> StreamDecoder:
        return _PieceStream(self.sp)

    def save(self, directory) -> pathlib.Path:
        path = pathlib.Path(directory) / self.file_name
        path.write_bytes(self._proto)
        return path


def _train_sentencepiece(kind: str, lines: Iterable[str], vocab_size: int) -> bytes:
    """Train in memory from `lines` (a bounded sample, newlines removed) -> model proto."""
    import sentencepiece as spm

    def sentences():
        for line in lines:
            for start in range(0, len(line), 4096):  # sentencepiece drops over-long lines
                yield line[start:start + 4096]

    out = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(), model_writer=out, model_type=kind,
            vocab_size=vocab_size, normalization_rule_name="identity",
            add_dummy_prefix=False, remove_extra_whitespaces=False, byte_fallback=True,
            split_digits=True, allow_whitespace_only_pieces=True, character_coverage=1.0,
            user_defined_symbols=["\n"], hard_vocab_limit=False, input_sentence_size=0,
            max_sentence_length=1 << 16, num_threads=1, minloglevel=2,
        )
    except RuntimeError as e:
        need = re.search(r"required_chars\. \d+ vs (\d+)", str(e))
        if need:
            raise UsageError(
                f"--vocab-size {vocab_size} is too small for this text: {kind} with byte "
                f"fallback needs at least {need.group(1)}; pass --vocab-size {need.group(1)} "
                "or more"
            ) from None
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise DataError(
            f"sentencepiece could not train a {kind} vocabulary of {vocab_size}: {reason}; "
            "pass a different --vocab-size or more training text"
        ) from None
    return out.getvalue()


def train_tokenizer(
    kind: str,
    sample: str | Iterable[str] = "",
    vocab_size: int | None = None,
    unknown: str = "error",
) -> Tokenizer:
    """Build a tokenizer of `kind` from training text.

    sample: the training text, or an iterable of text chunks. char reads all of it (its
    vocabulary is every character seen); bpe/unigram train on it, so pass a bounded
    sample (zlm.data.prepare passes the first ~10 MB of the training split); byte ignores it.
    vocab_size: bpe/unigram only (default 1024); an upper bound, smaller corpora may give
    fewer pieces. unknown="replace" adds U+FFFD to a char vocabulary.
    """
    if kind not in KINDS:
        raise UsageError(f"--tokenizer {kind} is not a tokenizer; use one of {', '.join(KINDS)}")
    check_unknown(unknown)
    if vocab_size is not None and kind in ("char", "byte"):
        raise UsageError(f"--vocab-size applies to bpe/unigram only, not --tokenizer {kind}")
    chunks = [sample] if isinstance(sample, str) else sample
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        chars: set[str] = set()
        for chunk in chunks:
            chars.update(chunk)
        if unknown == "replace":
            chars.add(REPLACEMENT)
        return CharTokenizer(chars)
    size = DEFAULT_SUBWORD_VOCAB if vocab_size is None else int(vocab_size)
    lines = (line for chunk in chunks for line in chunk.split("\n"))
    return SentencePieceTokenizer(kind, _train_sentencepiece(kind, lines, size))


def load_tokenizer(directory, meta: dict) -> Tokenizer:
    """Load the tokenizer a DATA_DIR (or run) stores; `meta` is dataset.json's `tokenizer`."""
    directory = pathlib.Path(directory)
    kind = meta.get("kind")
    path = directory / str(meta.get("file", "tokenizer.json"))
    if kind not in KINDS:
        raise DataError(f"{directory}: unknown tokenizer kind {kind!r}; re-run zlm prepare")
    if not path.is_file():
        raise DataError(f"{path}: tokenizer file is missing; re-run zlm prepare")
    if kind in ("bpe", "unigram"):
        tok: Tokenizer = SentencePieceTokenizer(kind, path.read_bytes())
    else:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: not valid JSON ({e}); re-run zlm prepare") from None
        try:
            tok = ByteTokenizer() if kind == "byte" else CharTokenizer(doc["vocab"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{path}: not a char tokenizer file ({e.__class__.__name__}: {e}); "
                            "re-run zlm prepare") from None
    expected = meta.get("vocab_size")
    if expected is not None and (not isinstance(expected, int) or tok.vocab_size != expected):
        raise DataError(
            f"{path}: tokenizer has {tok.vocab_size} entries but dataset.json says "
            f"{expected}; re-run zlm prepare"
        )
    return tok


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest little-endian unsigned dtype that holds ids < vocab_size."""
    for dt in ("<u1", "<u2", "<u4"):
        if vocab_size <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    raise DataError(f"a vocabulary of {vocab_size} does not fit in 32 bits")


def context_ids(tokenizer: Tokenizer) -> np.ndarray | None:
    """The ids of one newline, the context every scored text and empty prime starts from.

    None when the vocabulary has no newline (a char model trained on one-line text).
    """
    try:
        ids = tokenizer.encode("\n")
    except DataError:
        return None
    return ids if len(ids) else None

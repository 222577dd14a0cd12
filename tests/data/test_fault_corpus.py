"""Hostile corpora for zlm.prepare: arbitrary bytes, chunk boundaries, BOM/CRLF, huge
vocabularies, determinism, and SIGKILL in the middle of a prepare."""

from __future__ import annotations

import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from zlm.atomic import temporary_name, temporary_of
from zlm.data.dataset import SPLITS, Dataset
from zlm.data.prepare import PrepareConfig, prepare
from zlm.errors import DataError

FAST = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
_TEXT_CHARS = st.characters(blacklist_categories=("Cs",))  # any code point UTF-8 can carry


def _mixed_bytes():
    """Mostly valid UTF-8 text with stray bytes spliced in: reaches every decoder path."""
    piece = st.one_of(st.text(_TEXT_CHARS, max_size=30).map(lambda s: s.encode("utf-8")),
                      st.binary(max_size=3))
    return st.lists(piece, max_size=12).map(b"".join)


def _files(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _decoded(ds: Dataset) -> str:
    return "".join(ds.tokenizer.decode(ds.tokens(s)) for s in SPLITS)


class _Scratch:
    """A fresh directory per hypothesis example (tmp_path is shared across examples)."""

    def __enter__(self) -> pathlib.Path:
        self.path = pathlib.Path(tempfile.mkdtemp(prefix="zlm-corpus-"))
        return self.path

    def __exit__(self, *exc):
        shutil.rmtree(self.path, ignore_errors=True)


def _is_special(raw: bytes) -> bool:
    """Inputs refused before decoding: NUL bytes, gzip magic, mostly control bytes."""
    if b"\0" in raw or raw.startswith(b"\x1f\x8b"):
        return True
    head = np.frombuffer(raw[:65536], dtype=np.uint8)
    control = (head < 32) & ~np.isin(head, list(b"\t\n\v\f\r\x1b"))
    return head.size > 0 and np.count_nonzero(control) > 0.3 * head.size


# (a) arbitrary bytes -------------------------------------------------------------------

@FAST
@given(raw=_mixed_bytes(), unknown=st.sampled_from(["error", "replace"]),
       chunk=st.sampled_from([1, 3, 7, 4 << 20]))
def test_arbitrary_bytes_char_prepare_succeeds_or_one_line_data_error(raw, unknown, chunk):
    with _Scratch() as d:
        src = d / "in.txt"
        src.write_bytes(raw)
        try:
            ds = prepare(src, d / "out", PrepareConfig(tokenizer="char", unknown=unknown,
                                                       split=(0.4, 0.3, 0.3), chunk_bytes=chunk))
        except DataError as e:
            msg = str(e)
            assert "\n" not in msg and msg
            assert not (d / "out").exists()
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as u:
                if raw.startswith((b"\xff\xfe", b"\xfe\xff")):  # a UTF-16 or UTF-32 mark
                    assert "zlm reads UTF-8: convert it first" in msg, msg
                elif not _is_special(raw):
                    assert f"invalid UTF-8 at byte offset {u.start} " in msg, msg
                    assert f"(byte 0x{raw[u.start]:02x})" in msg
                    assert "--tokenizer byte" in msg
            return
        text = raw.decode("utf-8")  # it succeeded: so the input was valid UTF-8
        assert not _is_special(raw)
        text = text.removeprefix("\ufeff")
        decoded = _decoded(ds)
        assert decoded == text if unknown == "error" else len(decoded) == len(text)


@FAST
@given(raw=_mixed_bytes().filter(lambda b: len(b) >= 10), chunk=st.sampled_from([1, 5, 4 << 20]))
def test_byte_tokenizer_accepts_every_text_input_and_round_trips(raw, chunk):
    with _Scratch() as d:
        src = d / "in.bin"
        src.write_bytes(raw)
        cfg = PrepareConfig(tokenizer="byte", split=(0.4, 0.3, 0.3), chunk_bytes=chunk)
        if _is_special(raw):
            # Refused by design (textio: NUL bytes and mostly-binary files), with one line.
            with pytest.raises(DataError) as e:
                prepare(src, d / "out", cfg)
            msg = str(e.value)
            assert "\n" not in msg
            assert any(word in msg for word in ("binary file", "gzip", "UTF-16", "UTF-32")), msg
            return
        ds = prepare(src, d / "out", cfg)
        want = raw.removeprefix(b"\xef\xbb\xbf")
        got = b"".join(np.asarray(ds.tokens(s), dtype=np.uint8).tobytes() for s in SPLITS)
        assert got == want
        assert ds.dtype == np.uint8 and ds.vocab_size == 256


def test_nul_and_binary_refusals_are_documented_one_liners(tmp_path):
    cases = {"nul": b"hello world\0 text after a NUL byte",
             "binary": bytes(range(32)) * 40}
    for name, raw in cases.items():
        src = tmp_path / f"{name}.txt"
        src.write_bytes(raw)
        for tok in ("char", "byte"):
            with pytest.raises(DataError, match="binary file; pass a text file") as e:
                prepare(src, tmp_path / f"out-{name}-{tok}", PrepareConfig(tokenizer=tok))
            assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"NUL byte at byte offset 11\b"):
        prepare(tmp_path / "nul.txt", tmp_path / "o", PrepareConfig(chunk_bytes=3))


# (b) multi-byte characters across every chunk boundary -----------------------------------

@FAST
@given(text=st.text(st.sampled_from("aé€𝄞漢\n ") | _TEXT_CHARS, min_size=20, max_size=80)
       .filter(lambda s: "\0" not in s))
def test_every_chunk_size_gives_the_ids_of_a_whole_read(text):
    raw = text.encode("utf-8")
    assume(not _is_special(raw))
    with _Scratch() as d:
        src = d / "in.txt"
        src.write_bytes(raw)
        for tok, unknown in (("char", "replace"), ("byte", None)):
            cfg = dict(tokenizer=tok, unknown=unknown, split=(0.4, 0.3, 0.3))
            whole = prepare(src, d / f"{tok}-whole", PrepareConfig(**cfg, chunk_bytes=1 << 20))
            ref = _files(whole.path)
            for chunk in range(1, 9):  # 1..8 bytes: every offset of a 2-, 3-, 4-byte character
                ds = prepare(src, d / f"{tok}-{chunk}", PrepareConfig(**cfg, chunk_bytes=chunk))
                assert _files(ds.path) == ref, (tok, chunk)


# (c) CRLF kept, BOM stripped ------------------------------------------------------------

@FAST
@given(lines=st.lists(st.text(st.sampled_from("ab é\t\ufeff"), max_size=8), min_size=8, max_size=30),
       bom=st.booleans(), chunk=st.sampled_from([1, 2, 3, 64]))
def test_crlf_is_kept_and_a_leading_bom_is_stripped(lines, bom, chunk):
    text = "\r\n".join(lines) + "\r\n"
    raw = (b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8")
    with _Scratch() as d:
        src = d / "in.txt"
        src.write_bytes(raw)
        ds = prepare(src, d / "out", PrepareConfig(unknown="replace", split=(0.8, 0.1, 0.1),
                                                   chunk_bytes=chunk))
        # A BOM is stripped once, at the start of the file, whether or not we wrote it as one.
        want = text if bom else text.removeprefix("\ufeff")
        decoded = _decoded(ds)
        assert len(decoded) == len(want)
        assert decoded.count("\r\n") == want.count("\r\n")
        chars = set(ds.tokenizer.decode(range(ds.vocab_size)))
        assert "\r" in chars
        # Only the first BOM of the file is stripped; one inside the text is a character.
        train = ds.tokenizer.decode(ds.tokens("train"))
        assert train == want[:len(train)]


# (d) more than 65,536 distinct characters -> uint32 --------------------------------------

def _many_chars(n: int) -> str:
    cps = [c for c in range(0x100, 0x100 + n + 2048) if not 0xD800 <= c <= 0xDFFF][:n]
    return "".join(map(chr, cps))


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=st.sampled_from([0, 1, 4000]))
def test_vocabulary_over_65536_is_stored_as_uint32_and_round_trips(extra):
    distinct = _many_chars(65535 + extra)  # + the newline below: 65,536 + extra characters
    text = distinct + "\n" + distinct[:10000]  # everything appears in the 90% train split
    with _Scratch() as d:
        src = d / "in.txt"
        src.write_text(text, encoding="utf-8")
        ds = prepare(src, d / "out", PrepareConfig(split=(0.9, 0.05, 0.05), chunk_bytes=1000))
        assert ds.vocab_size == 65536 + extra
        assert ds.dtype == (np.dtype("<u2") if extra == 0 else np.dtype("<u4"))
        assert ds.meta["dtype"] == ("uint16" if extra == 0 else "uint32")
        assert _decoded(ds) == text
        train = ds.tokens("train")
        assert (pathlib.Path(ds.path) / "train.bin").stat().st_size == train.size * ds.dtype.itemsize
        assert int(train.max()) == ds.vocab_size - 1 or extra == 0


# (e) determinism -----------------------------------------------------------------------

@FAST
@given(text=st.text(_TEXT_CHARS, min_size=10, max_size=200).filter(lambda s: "\0" not in s),
       tok=st.sampled_from(["char", "byte"]))
def test_prepare_twice_is_byte_identical(text, tok):
    assume(not _is_special(text.encode("utf-8")))
    with _Scratch() as d:
        src = d / "in.txt"
        src.write_text(text, encoding="utf-8", newline="")
        cfg = PrepareConfig(tokenizer=tok, unknown="replace" if tok == "char" else None,
                            split=(0.5, 0.25, 0.25))
        a = prepare(src, d / "a", cfg)
        first = _files(a.path)
        b = prepare(src, d / "b", cfg)
        assert _files(b.path) == first
        prepare(src, d / "a", cfg, force=True)
        assert _files(a.path) == first


# (f) SIGKILL in the middle of a prepare ---------------------------------------------------

_CHILD = """
import sys
from zlm.data.prepare import PrepareConfig, prepare
prepare(sys.argv[1], sys.argv[2], PrepareConfig(chunk_bytes=4096), force=True)
print("done", flush=True)
"""


def _big_corpus(path: pathlib.Path, n_bytes: int) -> None:
    rng = random.Random(3)
    words = ["zoneout", "lstm", "héllo", "wörld", "漢字", "𝄞", "naïve", "cell", "state", "\n"]
    out, size = [], 0
    while size < n_bytes:
        w = rng.choice(words)
        out.append(w + " ")
        size += len(w.encode("utf-8")) + 1
    path.write_text("".join(out), encoding="utf-8")


def _stopped_mid_write(child: subprocess.Popen, out: pathlib.Path) -> bool:
    """Wait until the child has written part of a split into its hidden temporary, then
    stop it there (SIGSTOP) and say whether it was caught mid-write: the temporary still
    there, without its dataset.json (written last). False if it finished first."""
    pattern = f".{out.name}.tmp-{child.pid}-*"
    while child.poll() is None:
        try:
            started = any(p.stat().st_size > 0 for t in out.parent.glob(pattern) for p in t.glob("*.bin"))
        except FileNotFoundError:  # renamed into place while we looked
            started = False
        if started:
            child.send_signal(signal.SIGSTOP)
            tmp = list(out.parent.glob(pattern))
            return len(tmp) == 1 and not (tmp[0] / "dataset.json").exists()
        time.sleep(0.001)
    return False


def test_a_whole_temporary_left_by_a_kill_before_the_rename_is_refused(tmp_path):
    """A kill between prepare's last write and its rename leaves a complete directory under
    the hidden temporary name: still not a DATA_DIR (the rename is the commit), so opening it
    is a one-line DataError that names the target; the target itself opens as usual."""
    src = tmp_path / "small.txt"
    src.write_text("hello world\n" * 500, encoding="utf-8")
    done = prepare(src, tmp_path / "data", PrepareConfig()).path
    for kind in ("tmp", "old"):
        left = temporary_name(done, kind)
        shutil.copytree(done, left)
        assert temporary_of(left) == "data"
        with pytest.raises(DataError) as e:
            Dataset.open(left)
        assert "\n" not in str(e.value) and "interrupted zlm prepare" in str(e.value)
        assert str(done) in str(e.value)
    assert temporary_of(done) is None and Dataset.open(done).vocab_size > 0
    # Names that only look alike are ordinary directories.
    for name in (".data.tmp-12", "data.tmp-1-0123abcd", ".data.tmp-1-0123ABCD", ".data.tmp-x-0123abcd"):
        assert temporary_of(tmp_path / name) is None


def test_sigkill_midway_never_leaves_an_accepted_incomplete_data_dir(tmp_path):
    src = tmp_path / "big.txt"
    _big_corpus(src, 3 << 20)
    clean = prepare(src, tmp_path / "clean", PrepareConfig(chunk_bytes=4096))
    ref = _files(clean.path)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", _CHILD, str(src), str(tmp_path / "timing")], check=True,
                   capture_output=True)
    full = time.perf_counter() - t0
    rng = random.Random(11)
    outcomes = {"refused": 0, "complete": 0, "absent": 0}
    mid_write = 0  # kills that left the child's half-written temporary behind
    out = tmp_path / "out"
    # Kills at random times (from interpreter start-up to the final rename, sometimes after),
    # then kills aimed at the write: the child is stopped once part of a split is on disk,
    # so they land mid-write however fast or loaded the machine is.
    plan = [("random", rng.uniform(0.05, full * 1.05)) for _ in range(8)] + [("mid-write", None)] * 2
    for i, (how, delay) in enumerate(plan):
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(src), str(out)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if how == "random":
            time.sleep(delay)
        else:
            assert _stopped_mid_write(child, out), f"kill {i}: the child finished before it was caught writing"
        child.send_signal(signal.SIGKILL)
        child.communicate()
        if list(tmp_path.glob(f".out.tmp-{child.pid}-*")):
            mid_write += 1
        if not out.exists():
            outcomes["absent"] += 1
            continue
        try:
            ds = Dataset.open(out)
        except DataError as e:
            assert "\n" not in str(e)
            outcomes["refused"] += 1
            continue
        assert _files(ds.path) == ref, f"kill {i} ({how}, {delay}) left a wrong DATA_DIR"
        outcomes["complete"] += 1
    # Leftover hidden temporaries are the only trace; they never look like a DATA_DIR.
    for p in tmp_path.iterdir():
        if p.name.startswith(".out.tmp-"):
            with pytest.raises(DataError):
                Dataset.open(p)
    assert sum(outcomes.values()) == len(plan)
    assert mid_write >= 2, f"only {mid_write} kills landed mid-write"

"""Reading sources: chunked strict UTF-8, gzip, directories, BOM/CRLF, binary, PTB-char."""

from __future__ import annotations

import gzip
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import PTB_SYMBOLS, ptb_char_format, ptb_char_text
from zlm.data.textio import PtbCharDecoder, iter_bytes, iter_text, resolve_files
from zlm.errors import DataError, UsageError


def _read(files, chunk=7, fmt="text") -> str:
    return "".join(iter_text(files, chunk_bytes=chunk, fmt=fmt))


@given(text=st.text(min_size=1).filter(lambda t: "\x00" not in t), chunk=st.integers(1, 9))
@settings(max_examples=100, deadline=None)
def test_chunked_decoding_equals_whole(tmp_path_factory, text, chunk):
    path = tmp_path_factory.mktemp("t") / "a.txt"
    path.write_bytes(text.encode("utf-8"))
    if sum(c < " " and c not in "\t\n\v\f\r\x1b" for c in text) > 0.3 * len(text.encode()):
        return  # looks binary; covered below
    assert _read([path], chunk) == text.removeprefix("\ufeff")


def test_bom_stripped_crlf_kept(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"\xef\xbb\xbfline one\r\nline two\r\n")
    assert _read([path]) == "line one\r\nline two\r\n"
    assert b"".join(iter_bytes([path], 4)) == b"line one\r\nline two\r\n"


def test_gzip_is_read_transparently(tmp_path):
    path = tmp_path / "a.txt.gz"
    path.write_bytes(gzip.compress("héllo\nwörld\n".encode()))
    assert _read([path], 3) == "héllo\nwörld\n"
    bad = tmp_path / "bad.gz"
    bad.write_bytes(gzip.compress(b"hello")[:-6])
    with pytest.raises(DataError, match="corrupt gzip"):
        _read([bad])


def test_directory_recursive_sorted_hidden_skipped(tmp_path):
    for rel in ["b.txt", "a/z.txt", "a/b/c.txt", ".hidden.txt", ".git/x.txt", "a10.txt"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel + "\n")
    files = resolve_files(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in files] == [
        "a/b/c.txt", "a/z.txt", "a10.txt", "b.txt"]
    assert resolve_files([tmp_path / "b.txt", tmp_path / "a10.txt"])[0].name == "b.txt"


def test_resolve_errors(tmp_path):
    with pytest.raises(UsageError, match="no such file.*corpus name \\(x, y\\)"):
        resolve_files(tmp_path / "missing.txt", names=["x", "y"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="has no files"):
        resolve_files(tmp_path / "empty")
    with pytest.raises(UsageError):
        resolve_files([])


@pytest.mark.parametrize("chunk", [1, 2, 5, 4096])
def test_invalid_utf8_names_byte_offset(tmp_path, chunk):
    path = tmp_path / "a.txt"
    path.write_bytes("héllo ".encode() + b"\xff" + " wörld".encode())
    with pytest.raises(DataError) as e:
        _read([path], chunk)
    msg = str(e.value)
    assert "byte offset 7" in msg and "0xff" in msg and "--tokenizer byte" in msg
    assert "\n" not in msg


def test_truncated_utf8_at_end_of_file(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes("ab€".encode()[:-1])
    with pytest.raises(DataError, match="byte offset 2"):
        _read([path], 2)


def test_nul_and_binary_refused(tmp_path):
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"hello" * 100 + b"\x00world")
    with pytest.raises(DataError, match="NUL byte at byte offset 500.*binary"):
        _read([nul])
    with pytest.raises(DataError, match="NUL byte"):
        list(iter_bytes([nul]))
    binary = tmp_path / "bin.dat"
    binary.write_bytes(bytes(range(1, 32)) * 20)
    with pytest.raises(DataError, match="binary"):
        list(iter_bytes([binary]))


WIDE = [("utf-16", "UTF-16"), ("utf-16-le", "UTF-16LE"), ("utf-16-be", "UTF-16BE"), ("utf-32", "UTF-32")]


@pytest.mark.parametrize("encoding,name", WIDE)
@pytest.mark.parametrize("text", ["hello world\n" * 300, "中文字 " * 300])
@pytest.mark.parametrize("gz", [False, True])
def test_wide_encodings_are_named_with_their_conversion(tmp_path, encoding, name, text, gz):
    """UTF-16/32 text is refused as before (NUL bytes, or not UTF-8), but the one-line error
    names the encoding and the iconv command that converts it, which this test runs."""
    path = tmp_path / "wide.txt"
    raw = text.encode(encoding)
    path.write_bytes(gzip.compress(raw) if gz else raw)
    with pytest.raises(DataError) as e:
        _read([path])
    msg = str(e.value)
    assert f"{name} text; zlm reads UTF-8" in msg and f"iconv -f {name} -t UTF-8 {path}" in msg
    assert "\n" not in msg
    if not gz and shutil.which("iconv"):
        out = tmp_path / "wide-utf8.txt"
        subprocess.run(f"iconv -f {name} -t UTF-8 {path} > {out}", shell=True, check=True)
        assert _read([out]) == text


def test_utf16_without_mark_or_nul_is_reported_as_invalid_utf8(tmp_path):
    path = tmp_path / "wide.txt"
    path.write_bytes("中文字".encode("utf-16-be") * 100)  # 4e 2d 65 87 ...: 0x87 cannot start a character
    with pytest.raises(DataError, match="invalid UTF-8 at byte offset 3"):
        _read([path])


def test_binary_with_nul_bytes_is_not_taken_for_utf16(tmp_path):
    path = tmp_path / "bin.dat"
    path.write_bytes(bytes(range(256)) * 40)
    with pytest.raises(DataError, match="binary") as e:
        _read([path])
    assert "UTF-16" not in str(e.value)


def test_ptb_char_decoder_streaming():
    raw = "a _ c a t \n < u n k > _ N \n"
    whole = PtbCharDecoder().feed(raw)
    assert whole == "a cat\n<unk> N\n"
    dec = PtbCharDecoder()
    assert "".join(dec.feed(c) for c in raw) + dec.flush() == whole
    dec = PtbCharDecoder()
    assert dec.feed("x _ y") + dec.flush() == "x y\n"  # no final newline


def test_ptb_char_rejects_plain_text(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello world\n")
    with pytest.raises(DataError, match="line 1 is not in ptb-char format"):
        _read([path], fmt="ptb-char")


def test_ptb_char_file_decodes_to_the_50_symbols(tmp_path):
    """A PTB-char file (written from tiny Shakespeare in PTB's alphabet: 3,370 lines, as
    many as ptb.char.valid.txt) decodes, in 64 KB chunks, to exactly its text."""
    want = ptb_char_text(3370)
    path = tmp_path / "ptb.char.valid.txt"
    path.write_text(ptb_char_format(want), encoding="utf-8")
    assert path.read_text(encoding="utf-8").startswith(" # _ $ _ &")
    text = _read([path], chunk=1 << 16, fmt="ptb-char")
    assert text == want
    assert text.count("\n") == 3370
    assert "_" not in text
    assert set(text) == set(PTB_SYMBOLS) | {" ", "\n"}
    assert len(set(text)) == 50  # 48 published symbols, the space (for "_") and end of line

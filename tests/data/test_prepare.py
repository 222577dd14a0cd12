"""zlm.prepare: splits, tokenizers, streaming invariants, named corpora and bad input."""

from __future__ import annotations

import gzip
import hashlib
import json
import pathlib

import numpy as np
import pytest

from conftest import CORPORA, PTB_FILES, need_corpus, write_ptb_char
from zlm.corpora import load_catalog
from zlm.data import catalog
from zlm.data.dataset import Dataset
from zlm.data.prepare import PrepareConfig, prepare
from zlm.errors import DataError, UsageError

SPLITS = ("train", "valid", "test")
TEXT = "".join(f"line {i}: héllo wörld — ünïcode 漢字 {i * 7 % 13}\n" for i in range(400))


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(catalog.ENV_MIRROR, raising=False)


def _text_file(tmp_path, text=TEXT, name="corpus.txt") -> pathlib.Path:
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return path


def _decoded(ds: Dataset) -> str:
    return "".join(ds.tokenizer.decode(ds.tokens(s)) for s in SPLITS)


def _files(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_tinyshakespeare_char(tmp_path):
    need_corpus(CORPORA / "tinyshakespeare")
    ds = prepare("tinyshakespeare", tmp_path / "d", PrepareConfig(mirror=CORPORA))
    info = {s: ds.split_info(s) for s in SPLITS}
    assert ds.vocab_size == 65 and ds.dtype == np.uint8
    assert sum(i.characters for i in info.values()) == 1_115_394
    assert [i.tokens for i in info.values()] == [1_003_855, 55_769, 55_770]
    text = (CORPORA / "tinyshakespeare" / "input.txt").read_text()
    assert _decoded(ds) == text
    meta = json.loads((tmp_path / "d" / "dataset.json").read_text())
    assert meta["format"] == "zlm-dataset" and meta["version"] == 1
    assert meta["tokenizer"] == {"kind": "char", "vocab_size": 65, "file": "tokenizer.json"}
    assert meta["dtype"] == "uint8" and meta["unit"] == "character"
    assert meta["source"]["name"] == "tinyshakespeare"
    assert meta["source"]["sha256"] == load_catalog()["corpora"]["tinyshakespeare"][
        "files"]["input.txt"]["sha256"]
    tokens = ds.tokens("train")
    assert isinstance(tokens, np.memmap) and not tokens.flags.writeable


def test_rerun_is_byte_identical_and_chunk_size_does_not_matter(tmp_path):
    src = _text_file(tmp_path)
    a = prepare(src, tmp_path / "a", PrepareConfig())
    b = prepare(src, tmp_path / "b", PrepareConfig(chunk_bytes=17))
    assert _files(a.path) == _files(b.path)
    assert _decoded(a) == TEXT
    prepare(src, tmp_path / "a", PrepareConfig(), force=True)
    assert _files(a.path) == _files(b.path)


def test_split_fractions_by_characters(tmp_path):
    ds = prepare(_text_file(tmp_path), tmp_path / "d", PrepareConfig(split=(0.5, 0.25, 0.25)))
    n = len(TEXT)
    assert [ds.split_info(s).characters for s in SPLITS] == [
        round(n * 0.5), round(n * 0.75) - round(n * 0.5), n - round(n * 0.75)]
    train = ds.tokenizer.decode(ds.tokens("train"))
    assert train == TEXT[:round(n * 0.5)]
    assert ds.split_info("train").bytes == len(train.encode())


@pytest.mark.parametrize("chunk", [5, 1 << 20])
def test_byte_tokenizer(tmp_path, chunk):
    ds = prepare(_text_file(tmp_path), tmp_path / "d",
                 PrepareConfig(tokenizer="byte", chunk_bytes=chunk))
    assert ds.vocab_size == 256 and ds.meta["unit"] == "character"
    raw = TEXT.encode()
    assert b"".join(ds.tokens(s).tobytes() for s in SPLITS) == raw
    assert sum(ds.split_info(s).characters for s in SPLITS) == len(TEXT)
    assert ds.split_info("valid").tokens == ds.split_info("valid").bytes
    # split by characters: every split decodes cleanly
    assert _decoded(ds) == TEXT


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_subword_tokenizers(tmp_path, kind):
    ds = prepare(_text_file(tmp_path), tmp_path / "d",
                 PrepareConfig(tokenizer=kind, vocab_size=400))
    assert ds.tokenizer.kind == kind and (tmp_path / "d" / "tokenizer.model").is_file()
    assert ds.dtype == np.uint16
    assert _decoded(ds) == TEXT
    assert ds.split_info("train").tokens < ds.split_info("train").characters


def test_gzip_directory_and_several_files(tmp_path):
    gz = tmp_path / "c.txt.gz"
    gz.write_bytes(gzip.compress(TEXT.encode()))
    assert _decoded(prepare(gz, tmp_path / "g", PrepareConfig())) == TEXT
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text(TEXT[:5000])
    (folder / "sub" / "a.txt").write_text(TEXT[5000:])
    (folder / "a.txt").write_text(TEXT[:100])
    ds = prepare(folder, tmp_path / "f", PrepareConfig())
    assert _decoded(ds) == TEXT[:100] + TEXT[:5000] + TEXT[5000:]
    ds = prepare([folder / "sub" / "a.txt", folder / "b.txt"], tmp_path / "s", PrepareConfig())
    assert _decoded(ds) == TEXT[5000:] + TEXT[:5000]


def test_bom_stripped_crlf_kept(tmp_path):
    path = tmp_path / "w.txt"
    path.write_bytes(b"\xef\xbb\xbf" + b"one\r\ntwo\r\n" * 50)
    ds = prepare(path, tmp_path / "d", PrepareConfig())
    assert _decoded(ds) == "one\r\ntwo\r\n" * 50


def test_explicit_valid_test_and_unknown_characters(tmp_path):
    train = _text_file(tmp_path, "abc abc\n" * 20, "train.txt")
    valid = _text_file(tmp_path, "cab\n", "valid.txt")
    test = _text_file(tmp_path, "ab\ncaé\n", "test.txt")
    with pytest.raises(DataError) as e:
        prepare(train, tmp_path / "d", PrepareConfig(valid=valid, test=test))
    msg = str(e.value)
    assert "'é'" in msg and "character 5 of the test split" in msg
    assert "--unknown replace" in msg
    assert not (tmp_path / "d").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    ds = prepare(train, tmp_path / "d", PrepareConfig(valid=valid, test=test, unknown="replace"))
    assert ds.tokenizer.decode(ds.tokens("test")) == "ab\nca\ufffd\n"
    assert ds.split_info("valid").characters == 4 and ds.meta["unknown"] == "replace"
    ds = prepare(train, tmp_path / "i", PrepareConfig(valid=valid, test=test, unknown="include"))
    assert ds.tokenizer.decode(ds.tokens("test")) == "ab\ncaé\n"  # the whole corpus's vocabulary
    assert ds.vocab_size == 6 and ds.meta["unknown"] == "include"


def test_ptb_char_files_decode_to_50_symbols(tmp_path):
    symbols = "#$&'*-./0123456789<>N\\abcdefghijklmnopqrstuvwxyz"
    line = " ".join(symbols) + " _ " + " ".join("<unk>")
    train = _text_file(tmp_path, (line + " \n") * 10, "ptb.char.train.txt")
    texts = write_ptb_char(tmp_path / "ptb", lines=(1, 3370, 500))  # PTB-char files written here
    ptb = tmp_path / "ptb"
    ds = prepare(train, tmp_path / "d",
                 PrepareConfig(valid=ptb / "ptb.char.valid.txt", test=ptb / "ptb.char.test.txt",
                               format="ptb-char"))
    assert ds.vocab_size == 50
    assert set(ds.tokenizer.chars) == set(symbols) | {" ", "\n"}
    valid = ds.tokenizer.decode(ds.tokens("valid"))
    assert valid == texts["valid"] and ds.tokenizer.decode(ds.tokens("test")) == texts["test"]
    assert valid.count("\n") == 3370


def test_ptb_char_corpus_from_mirror(tmp_path, monkeypatch):
    mirror = tmp_path / "m" / "ptb-char"
    texts = write_ptb_char(mirror)  # PTB-char files written here, from tiny Shakespeare
    # The catalog pins the real files' digests: pin these files' instead (still checked).
    cat = load_catalog()
    for name in PTB_FILES.values():
        digest = hashlib.sha256((mirror / name).read_bytes()).hexdigest()
        cat["corpora"]["ptb-char"]["files"][name]["sha256"] = digest
    monkeypatch.setattr(catalog, "load_catalog", lambda: cat)
    ds = prepare("ptb-char", tmp_path / "d", PrepareConfig(mirror=tmp_path / "m"))
    assert ds.vocab_size == 50 and ds.meta["source"]["name"] == "ptb-char"
    assert _decoded(ds) == texts["train"] + texts["valid"] + texts["test"]
    with pytest.raises(UsageError, match="three files; drop --split"):
        prepare("ptb-char", tmp_path / "e", PrepareConfig(mirror=tmp_path / "m",
                                                          split=(0.8, 0.1, 0.1)))
    (mirror / PTB_FILES["test"]).write_bytes(b" a\n" + (mirror / PTB_FILES["test"]).read_bytes())
    with pytest.raises(DataError, match="ptb.char.test.txt: SHA-256 .* does not match ptb-char's"):
        prepare("ptb-char", tmp_path / "f", PrepareConfig(mirror=tmp_path / "m"))


def test_counts_split_and_byte_unit(tmp_path, monkeypatch):
    cat = load_catalog()
    for name in ("text8", "enwik8"):
        cat["corpora"][name]["split"]["counts"] = [90, 5, 5]
    monkeypatch.setattr(catalog, "load_catalog", lambda: cat)
    for name, data in (("text8", b"abcdefghij" * 10), ("enwik8", "é".encode() * 50)):
        (tmp_path / "m" / name).mkdir(parents=True)
        (tmp_path / "m" / name / name).write_bytes(data)
    ds = prepare("text8", tmp_path / "t", PrepareConfig(mirror=tmp_path / "m"))
    assert [ds.split_info(s).tokens for s in SPLITS] == [90, 5, 5]
    ds = prepare("enwik8", tmp_path / "e", PrepareConfig(mirror=tmp_path / "m"))
    assert ds.tokenizer.kind == "byte" and ds.meta["unit"] == "byte"
    assert [ds.split_info(s).bytes for s in SPLITS] == [90, 5, 5]
    assert ds.split_info("train").characters == 45
    with pytest.raises(UsageError, match="bits per byte; use --tokenizer byte"):
        prepare("enwik8", tmp_path / "x", PrepareConfig(mirror=tmp_path / "m", tokenizer="char"))
    cat["corpora"]["text8"]["split"]["counts"] = [900, 50, 50]
    with pytest.raises(DataError, match="fewer than the 1,000 its split needs"):
        prepare("text8", tmp_path / "y", PrepareConfig(mirror=tmp_path / "m"))


def test_stdlib_offline_with_size_cap(tmp_path):
    ds = prepare("stdlib", tmp_path / "d", PrepareConfig(max_source_bytes=300_000))
    assert ds.meta["source"]["name"] == "stdlib" and ds.meta["unknown"] == "replace"
    assert "def " in ds.tokenizer.decode(ds.tokens("train")[:20000])
    assert 0 < len(ds.meta["source"]["paths"]) < 100


@pytest.mark.parametrize("content, match", [
    (b"", "is empty"),
    (b"text\x00more text", "NUL byte at byte offset 4"),
    (bytes(range(1, 9)) * 100, "binary"),
    (b"abc\n" * 10 + b"\xc3\x28 tail", "invalid UTF-8 at byte offset 40.*--tokenizer byte"),
    (b"ab", "the valid split of --split 0.9,0.05,0.05 would be empty; .* zlm prepare TRAIN --valid VALID"),
])
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, content, match):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(DataError, match=match) as e:
        prepare(path, tmp_path / "out", PrepareConfig())
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt"]


def test_invalid_utf8_works_with_byte_tokenizer(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café crème\n".encode("latin-1") * 20)
    ds = prepare(path, tmp_path / "d", PrepareConfig(tokenizer="byte"))
    assert b"".join(ds.tokens(s).tobytes() for s in SPLITS) == path.read_bytes()


def test_out_directory_rules(tmp_path):
    src = _text_file(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    prepare(src, out, PrepareConfig())  # an empty directory is fine
    with pytest.raises(UsageError, match="exists and is not empty; pass --force"):
        prepare(src, out, PrepareConfig())
    prepare(src, out, PrepareConfig(tokenizer="byte"), force=True)
    assert Dataset.open(out).tokenizer.kind == "byte"
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(UsageError, match="refusing"):
        prepare(src, foreign, PrepareConfig(), force=True)
    with pytest.raises(UsageError, match="is a file"):
        prepare(src, src, PrepareConfig())
    with pytest.raises(UsageError, match="no such file"):
        prepare(tmp_path / "missing.txt", tmp_path / "x", PrepareConfig())


def test_config_checks():
    with pytest.raises(UsageError, match="pass --valid/--test or --split, not both"):
        PrepareConfig(split=(0.8, 0.1, 0.1), valid="v", test="t")
    with pytest.raises(UsageError, match="both --valid and --test"):
        PrepareConfig(valid="v")
    with pytest.raises(UsageError, match="summing to 1"):
        PrepareConfig(split=(0.8, 0.1, 0.2))
    with pytest.raises(UsageError, match="bpe or unigram only"):
        PrepareConfig(vocab_size=100)
    with pytest.raises(UsageError):
        PrepareConfig(tokenizer="word")
    with pytest.raises(UsageError):
        PrepareConfig(unknown="ignore")


def test_dataset_open_errors(tmp_path):
    with pytest.raises(DataError, match="no dataset.json"):
        Dataset.open(tmp_path)
    ds = prepare(_text_file(tmp_path), tmp_path / "d", PrepareConfig())
    meta = json.loads((ds.path / "dataset.json").read_text())
    (ds.path / "dataset.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(DataError, match="newer zlm"):
        Dataset.open(ds.path)
    (ds.path / "dataset.json").write_text(json.dumps(meta))
    (ds.path / "valid.bin").write_bytes(b"\x00")
    with pytest.raises(DataError, match="incomplete"):
        Dataset.open(ds.path)


def test_progress_callback(tmp_path):
    seen = []
    prepare(_text_file(tmp_path), tmp_path / "d", PrepareConfig(chunk_bytes=1024),
            on_progress=lambda done, total: seen.append((done, total)))
    size = len(TEXT.encode())
    assert seen[-1] == (2 * size, 2 * size)
    assert all(a <= b for (a, _), (b, _) in zip(seen, seen[1:], strict=False))


def test_interrupted_while_writing_leaves_no_data_dir(tmp_path):
    src = _text_file(tmp_path)

    def interrupt(done, total):
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(src, tmp_path / "out", PrepareConfig(chunk_bytes=1024), on_progress=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]

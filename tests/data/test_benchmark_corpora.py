"""The benchmark corpora: deterministic text assembly from (fake) package trees, SHA-256
checks that fail in one line, idempotent fetching. No network: packages are faked."""

from __future__ import annotations

import gzip
import json
import re
import struct
import zlib

import pytest

from conftest import TINY_SHAKESPEARE, need_corpus
from zlm.data import benchmark_corpora as bm
from zlm.errors import DataError, UsageError


def write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))


def fake_fortunes(root):
    base = root / "usr/share/games/fortunes/xx"
    write(base / "b", "second\r\n%\nзвезда\n")
    write(base / "a", "\ufefffirst without newline")
    write(base / "a.dat", b"\x00\x01binary index")
    write(base / "sub" / "c", "in a folder\n")
    (base / "a.u8").symlink_to("a")
    return {"method": "files", "root": "usr/share/games/fortunes/xx", "exclude_suffixes": [".dat"]}


def fake_sword(root, blocks):
    module = root / "mod"
    data, index = b"", b""
    for text in blocks:
        packed = zlib.compress(text.encode("utf-8"))
        index += struct.pack("<III", len(data), len(packed), len(text.encode("utf-8")))
        data += packed
    write(module / "ot.czs", index)
    write(module / "ot.czz", data)
    write(module / "nt.czs", b"")
    write(module / "nt.czz", b"")
    return {"method": "sword", "root": "mod", "testaments": ["ot", "nt"], "ext": "cz"}


def test_files_rule_is_sorted_filtered_and_normalised(tmp_path):
    rule = fake_fortunes(tmp_path)
    names = [p.relative_to(tmp_path / rule["root"]).as_posix() for p in bm.rule_files(tmp_path, rule)]
    assert names == ["a", "b", "sub/c"]  # .dat excluded, the .u8 link skipped, sorted by parts
    text = bm.assemble(tmp_path, rule)
    assert text == "first without newline\nsecond\n%\nзвезда\nin a folder\n"  # BOM gone, CRLF -> LF
    assert bm.assemble(tmp_path, rule) == text  # the same bytes every time
    stats = bm.text_stats(text)
    assert stats["characters"] == len(text) and stats["bytes"] == len(text.encode()) > len(text)
    assert stats["vocabulary"] == len(set(text))


def test_files_rule_without_subfolders_and_cut_to_whole_characters(tmp_path):
    rule = fake_fortunes(tmp_path)
    flat = {**rule, "recursive": False}
    assert [p.name for p in bm.rule_files(tmp_path, flat)] == ["a", "b"]  # sub/c left out
    whole = bm.assemble(tmp_path, flat)
    assert whole == "first without newline\nsecond\n%\nзвезда\n"
    at = whole.encode().index("звезда".encode())
    for cap, expect in ((at + 3, whole[:whole.index("звезда") + 1]),  # 1.5 Cyrillic letters: back to 1
                        (at + 4, whole[:whole.index("звезда") + 2]), (10**6, whole), (1, "f")):
        cut = bm.assemble(tmp_path, {**flat, "max_bytes": cap})
        assert cut == expect and len(cut.encode()) <= cap
    for bad, words in (({"recursive": "no"}, "recursive 'no'"), ({"max_bytes": 0}, "max_bytes 0"),
                       ({"max_bytes": 1.5}, "max_bytes 1.5"), ({"max_bytes": True}, "max_bytes True")):
        with pytest.raises(DataError, match=words):
            bm.assemble(tmp_path, {**rule, **bad})


def test_files_rule_errors_are_one_line(tmp_path):
    rule = fake_fortunes(tmp_path)
    write(tmp_path / rule["root"] / "bad", b"caf\xe9\n")
    with pytest.raises(DataError, match=r"xx/bad: not UTF-8 at byte 3") as e:
        bm.assemble(tmp_path, rule)
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="not a folder"):
        bm.assemble(tmp_path, {"method": "files", "root": "nope"})
    with pytest.raises(DataError, match="no files"):
        bm.assemble(tmp_path, {**rule, "suffix": ".rst.txt"})
    with pytest.raises(DataError, match="assemble method"):
        bm.assemble(tmp_path, {"method": "zip"})


def fake_man(root):
    """A man-page tree as manpages-dev ships it: gzipped troff, aliases as symbolic links,
    a dictzip-like file (gzip with an extra header field) in another folder."""
    man = root / "usr/share/man"
    write(man / "man3" / "puts.3.gz", gzip.compress(b'.TH PUTS 3\n.SH NAME\nputs \\- output\n', mtime=0))
    write(man / "man2" / "write.2.gz", gzip.compress(b".TH WRITE 2\r\n.B write\n", mtime=0))
    write(man / "man2" / "zero.2.gz", gzip.compress(b"no newline", mtime=0))
    (man / "man3" / "fputs.3.gz").symlink_to("puts.3.gz")
    write(man / "man2" / "README", "not a page\n")
    # gzip header with FEXTRA (dictzip keeps its chunk index there); members concatenated.
    member = gzip.compress("entry\n  définition\n".encode(), mtime=0)
    extra = b"RA" + struct.pack("<H", 2) + b"\x00\x00"
    dz = member[:3] + bytes([member[3] | 4]) + member[4:10] + struct.pack("<H", len(extra)) \
        + extra + member[10:]
    write(root / "usr/share/dictd" / "x.dict.dz", dz + gzip.compress(b"second member\n", mtime=0))
    return {"method": "files", "root": "usr/share/man", "suffix": ".gz", "decompress": "gzip"}


def test_files_rule_decompresses_gzip(tmp_path):
    rule = fake_man(tmp_path)
    assert bm.source_files(tmp_path, rule) == [  # the package's names, .gz kept; links skipped
        "usr/share/man/man2/write.2.gz", "usr/share/man/man2/zero.2.gz",
        "usr/share/man/man3/puts.3.gz"]
    text = bm.assemble(tmp_path, rule)
    assert text == ".TH WRITE 2\n.B write\nno newline\n.TH PUTS 3\n.SH NAME\nputs \\- output\n"
    assert bm.assemble(tmp_path, rule) == text
    dz = {"method": "files", "root": "usr/share/dictd", "suffix": ".dict.dz", "decompress": "gzip"}
    assert bm.assemble(tmp_path, dz) == "entry\n  définition\nsecond member\n"
    # Without "decompress" the same files are read as they are: gzip is not UTF-8.
    with pytest.raises(DataError, match="not UTF-8"):
        bm.assemble(tmp_path, {**rule, "decompress": None})


def test_decompress_errors_are_one_line_and_name_the_file(tmp_path):
    rule = fake_man(tmp_path)
    write(tmp_path / "usr/share/man/man2/plain.2.gz", ".TH PLAIN 2\n")  # not gzip
    with pytest.raises(DataError, match=r"^usr/share/man/man2/plain\.2\.gz: not gzip data") as e:
        bm.assemble(tmp_path, rule)
    assert "\n" not in str(e.value)
    (tmp_path / "usr/share/man/man2/plain.2.gz").unlink()
    write(tmp_path / "usr/share/man/man2/cut.2.gz", gzip.compress(b".TH CUT 2\n")[:-6])  # truncated
    with pytest.raises(DataError, match=r"man2/cut\.2\.gz: not gzip data") as e:
        bm.assemble(tmp_path, rule)
    assert "\n" not in str(e.value)
    (tmp_path / "usr/share/man/man2/cut.2.gz").unlink()
    write(tmp_path / "usr/share/man/man3/bad.3.gz", gzip.compress(b".TH caf\xe9\n"))
    with pytest.raises(DataError, match=r"^usr/share/man/man3/bad\.3\.gz: not UTF-8 at byte 7") as e:
        bm.assemble(tmp_path, rule)
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="decompress 'xz'; use gzip"):
        bm.assemble(tmp_path, {**rule, "decompress": "xz"})
    with pytest.raises(DataError, match="assemble option 'gunzip' of method files"):
        bm.assemble(tmp_path, {**rule, "gunzip": True})


def test_strip_ansi_removes_colour_sequences(tmp_path):
    base = tmp_path / "usr/share/games/fortunes"
    write(base / "tang", "\x1b[32m《静夜思》\x1b[m\n\x1b[33m作者：李白\x1b[m\n床前明月光\n%\n")
    write(base / "tang.dat", b"\x00\x02")
    # A sequence split by another: removed until none is left, the text kept whole.
    write(base / "zh", "通过\x1b[35;1m“~/.bashrc”\x1b[;\x1b[34;1mm来定制\n")
    rule = {"method": "files", "root": "usr/share/games/fortunes", "exclude_suffixes": [".dat"],
            "strip_ansi": True}
    text = bm.assemble(tmp_path, rule)
    assert text == "《静夜思》\n作者：李白\n床前明月光\n%\n通过“~/.bashrc”来定制\n"
    assert "\x1b" in bm.assemble(tmp_path, {**rule, "strip_ansi": False})
    assert bm.strip_ansi("a\x1b[0;1mb\x1b[mc [m d") == "abc [m d"  # only ESC [ ... m goes


def test_sword_module_decodes_to_plain_lines(tmp_path):
    rule = fake_sword(tmp_path, [
        '<milestone type="x-importer"/><title type="x-s">Psalm 1</title><div sID="p1" type="x-p"/>'
        '<hi type="bold">Verse 1.</hi>  Blessed &amp; happy<note>a note</note> is\tthe man.'
        '<div eID="p1" type="x-p"/>',
        '<l sID="l1"/>The law of the LORD<l eID="l1"/><l sID="l2"/>is perfect &gt; all<l eID="l2"/>',
    ])
    assert bm.assemble(tmp_path, rule) == (
        "Psalm 1\nVerse 1. Blessed & happy is the man.\nThe law of the LORD\nis perfect > all\n")


def test_sword_block_size_mismatch(tmp_path):
    rule = fake_sword(tmp_path, ["<p>text</p>"])
    index = tmp_path / "mod" / "ot.czs"
    off, size, _ = struct.unpack("<III", index.read_bytes())
    index.write_bytes(struct.pack("<III", off, size, 99))
    with pytest.raises(DataError, match="its index says 99"):
        bm.assemble(tmp_path, rule)


def test_wrong_digest_is_a_one_line_error():
    bm.verify_sha256("ab" * 32, "ab" * 32, "x", "fix")  # equal: fine
    with pytest.raises(DataError) as e:
        bm.verify_sha256("ab" * 32, "cd" * 32, "pkg_1.0_all.deb", "update its pin")
    msg = str(e.value)
    assert "\n" not in msg and "pkg_1.0_all.deb" in msg and "abababab" in msg and "cdcdcdcd" in msg
    assert "update its pin" in msg


def spec_file(tmp_path, text_pin: dict, deb_sha: str = "0" * 64):
    spec = {"format": "zlm-benchmark", "version": 1, "corpora": {
        "quotes": {"kind": "quotations", "license": "GPL-2",
                   "source": {"type": "deb", "package": "fortunes-xx", "version": "1.0-1",
                              "sha256": deb_sha},
                   "assemble": {"method": "files", "root": "usr/share/games/fortunes/xx",
                                "exclude_suffixes": [".dat"]},
                   "text": text_pin}}}
    path = tmp_path / "benchmark.json"
    path.write_text(json.dumps(spec))
    return path


def test_fetch_writes_verified_text_and_manifest_then_keeps_it(tmp_path):
    tree = tmp_path / "tree"
    rule = fake_fortunes(tree)
    pin = bm.text_stats(bm.assemble(tree, rule))
    calls = []

    def fetcher(source, workdir):  # stands in for apt-get download + dpkg-deb -x
        calls.append((source["package"], source["version"]))
        return tree

    out = tmp_path / "out"
    manifest = bm.fetch_corpora(out, spec=spec_file(tmp_path, pin), fetcher=fetcher)
    text = (out / "quotes" / "input.txt").read_bytes()
    assert bm.sha256_bytes(text) == pin["sha256"] and calls == [("fortunes-xx", "1.0-1")]
    entry = json.loads((out / "manifest.json").read_text())["corpora"][0]
    assert entry == manifest["corpora"][0]
    assert entry["text"]["vocabulary"] == pin["vocabulary"] and entry["license"] == "GPL-2"
    assert entry["files"] == ["usr/share/games/fortunes/xx/a", "usr/share/games/fortunes/xx/b",
                              "usr/share/games/fortunes/xx/sub/c"]
    assert sorted(p.name for p in (out / "quotes").iterdir()) == ["files.json", "input.txt"]

    bm.fetch_corpora(out, spec=spec_file(tmp_path, pin), fetcher=fetcher)  # present, verified
    assert len(calls) == 1
    (out / "quotes" / "input.txt").write_text("tampered")
    bm.fetch_corpora(out, spec=spec_file(tmp_path, pin), fetcher=fetcher)  # made again
    assert len(calls) == 2 and (out / "quotes" / "input.txt").read_bytes() == text


def test_fetch_refuses_a_text_that_is_not_the_pinned_one(tmp_path):
    tree = tmp_path / "tree"
    fake_fortunes(tree)
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"quotes text: SHA-256 .* is not the pinned") as e:
        bm.fetch_corpora(out, spec=spec_file(tmp_path, {"sha256": "f" * 64}),
                         fetcher=lambda source, workdir: tree)
    assert "\n" not in str(e.value) and not (out / "quotes" / "input.txt").exists()


def test_shipped_benchmark_set():
    corpora = bm.load_benchmark()
    names = [c.name for c in corpora]
    assert len(names) >= 5 and {"tinyshakespeare", "stdlib"} <= set(names)
    for c in corpora:
        if c.source["type"] == "deb":
            assert len(c.source["sha256"]) == 64 and c.source["version"] and c.assemble
            assert len(c.text["sha256"]) == 64 and c.text["characters"] > 1_000_000
        assert c.license and c.kind
    big = [c for c in corpora if c.kind.startswith("prose")]
    assert big and big[0].text["characters"] >= 10_000_000
    assert any(c.text and c.text["bytes"] > 1.5 * c.text["characters"] for c in corpora)  # non-ASCII
    assert [c.name for c in bm.select(corpora, "stdlib,tinyshakespeare")] == \
        [n for n in names if n in ("stdlib", "tinyshakespeare")]
    with pytest.raises(UsageError, match="--only nope: no such benchmark corpus"):
        bm.select(corpora, "nope")


HEX64 = re.compile(r"[0-9a-f]{64}")


def test_unseen_texts_are_pinned_and_in_no_benchmark():
    """corpora/unseen.json: the texts the defaults are checked on out of sample."""
    from importlib import resources

    unseen = bm.load_benchmark(resources.files("zlm.corpora").joinpath("unseen.json"))
    assert len(unseen) >= 6
    assert not {c.name for c in unseen} & {c.name for c in bm.load_benchmark()}
    packages = {c.source.get("package") for c in bm.load_benchmark()}
    for c in unseen:
        assert c.source["type"] == "deb" and c.source["package"] not in packages, c.name
        assert HEX64.fullmatch(c.source["sha256"]) and HEX64.fullmatch(c.text["sha256"]), c.name
        # a small text is one of the kinds checked (dozens of passes in 10 minutes), not a toy
        assert c.text["bytes"] >= c.text["characters"] > 200_000 and c.license and c.kind
        bm.check_files_rule(c.assemble)


def test_shipped_set_covers_the_kinds_of_text():
    corpora = bm.load_benchmark()
    assert len(corpora) >= 8 and len({c.name for c in corpora}) == len(corpora)
    for c in corpora:
        if c.source["type"] == "deb":
            assert HEX64.fullmatch(c.source["sha256"]), c.name
            assert HEX64.fullmatch(c.text["sha256"]), c.name
            assert c.text["bytes"] >= c.text["characters"] > 0 and c.text["vocabulary"] > 0
            assert c.text["bytes"] <= 60_000_000, c.name  # a benchmark text, not a dump
            if c.assemble["method"] == "files":
                bm.check_files_rule(c.assemble)  # only options the rule knows
    kinds = [c.kind for c in corpora]
    assert any(k.startswith("dictionary") for k in kinds)
    assert any(k.startswith("markup") for k in kinds)
    assert any(k.startswith("source code") and "Python" not in k for k in kinds)
    cjk = [c for c in corpora if re.search(r"Chinese|Japanese|Korean", c.kind)]
    assert cjk and all(c.text["vocabulary"] >= 1000 for c in cjk)  # thousands of symbols


def test_corpus_source(tmp_path, monkeypatch):
    corpora = {c.name: c for c in bm.load_benchmark()}
    assert bm.corpus_source(corpora["stdlib"], tmp_path) == "stdlib"
    need_corpus(TINY_SHAKESPEARE)
    # Not fetched: the copy this repository ships.
    assert bm.corpus_source(corpora["tinyshakespeare"], tmp_path) == str(TINY_SHAKESPEARE.resolve())
    write(tmp_path / "python-docs" / "input.txt", "x")
    assert bm.corpus_source(corpora["python-docs"], tmp_path) == str(tmp_path / "python-docs" / "input.txt")
    with pytest.raises(UsageError, match="run scripts/fetch-corpora"):
        bm.corpus_source(corpora["fortunes-ru"], tmp_path)

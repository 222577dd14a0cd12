"""The corpus catalog: package data, mirrors, cache, SHA-256 checks, downloads, stdlib."""

from __future__ import annotations

import hashlib
import pathlib
import sysconfig
import zipfile

import pytest

from conftest import TINY_SHAKESPEARE, need_corpus
from zlm.corpora import load_catalog
from zlm.data import catalog
from zlm.errors import DataError, UsageError


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(catalog.ENV_MIRROR, raising=False)


def test_catalog_loads_from_package_data():
    cat = load_catalog()
    assert cat["format"] == "zlm-catalog"
    assert set(cat["corpora"]) == {"tinyshakespeare", "ptb-char", "text8", "enwik8", "stdlib"}
    for name, spec in cat["corpora"].items():
        assert spec["split"]["kind"] in ("fractions", "counts", "files"), name
        assert spec["unit"] in ("character", "byte")
        if "builtin" not in spec:
            assert spec["download"]["url"].startswith("http")
            for info in spec["files"].values():
                assert info["sha256"] is None or len(info["sha256"]) == 64
    assert cat["corpora"]["enwik8"]["unit"] == "byte"


def test_tinyshakespeare_digest_matches_shared_copy():
    path = need_corpus(TINY_SHAKESPEARE)
    expected = load_catalog()["corpora"]["tinyshakespeare"]["files"]["input.txt"]["sha256"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == expected


def test_cache_dir_follows_xdg(tmp_path):
    assert catalog.cache_dir() == tmp_path / "cache" / "zlm" / "corpora"


def test_mirror_and_env(tmp_path, monkeypatch):
    (tmp_path / "m" / "text8").mkdir(parents=True)
    (tmp_path / "m" / "text8" / "text8").write_text("anarchism originated")
    corpus = catalog.locate("text8", mirror=tmp_path / "m")
    assert corpus.files == (tmp_path / "m" / "text8" / "text8",)
    assert corpus.split == {"kind": "counts", "counts": [90000000, 5000000, 5000000]}
    monkeypatch.setenv(catalog.ENV_MIRROR, str(tmp_path / "m"))
    assert catalog.locate("text8").files == corpus.files
    with pytest.raises(UsageError, match="not a directory"):
        catalog.locate("text8", mirror=tmp_path / "nope")


def test_mirror_with_wrong_digest_is_refused(tmp_path):
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text("not shakespeare")
    with pytest.raises(DataError, match="SHA-256 .* does not match tinyshakespeare"):
        catalog.locate("tinyshakespeare", mirror=tmp_path)


def test_unknown_name():
    with pytest.raises(UsageError, match="not a corpus in the catalog"):
        catalog.entry("wikitext-103")


def _fake_catalog(url: str, sha: str | None, archive: str | None, member_sha=None) -> dict:
    cat = load_catalog()
    cat["corpora"]["fake"] = {
        "download": {"url": url, "archive": archive, "sha256": sha},
        "files": {"fake.txt": {"member": "fake.txt", "sha256": member_sha}},
        "format": "text", "unit": "character", "tokenizer": "char",
        "split": {"kind": "fractions", "fractions": [0.8, 0.1, 0.1]},
    }
    return cat


def test_download_unpacks_verifies_and_records(tmp_path, monkeypatch):
    archive = tmp_path / "fake.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("fake/fake.txt", "hello zip\n")
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    monkeypatch.setattr(catalog, "load_catalog",
                        lambda: _fake_catalog(archive.as_uri(), sha, "zip"))
    seen = []
    corpus = catalog.locate("fake", on_progress=lambda d, t: seen.append(d))
    cached = catalog.cache_dir() / "fake" / "fake.txt"
    assert corpus.files == (cached,) and cached.read_text() == "hello zip\n"
    assert seen and seen[-1] == archive.stat().st_size
    record = cached.with_name("fake.txt.sha256")
    assert record.read_text().split()[0] == hashlib.sha256(b"hello zip\n").hexdigest()
    cached.write_text("tampered\n")  # trusted on first use, checked afterwards
    with pytest.raises(DataError, match="does not match"):
        catalog.locate("fake")


def test_download_with_bad_digest_or_offline(tmp_path, monkeypatch):
    src = tmp_path / "fake.txt"
    src.write_text("hello\n")
    monkeypatch.setattr(catalog, "load_catalog",
                        lambda: _fake_catalog(src.as_uri(), "0" * 64, None))
    with pytest.raises(DataError, match="does not match its SHA-256"):
        catalog.locate("fake")
    assert not (catalog.cache_dir() / "fake" / "fake.txt").exists()
    monkeypatch.setattr(catalog, "load_catalog",
                        lambda: _fake_catalog((tmp_path / "gone.txt").as_uri(), None, None))
    with pytest.raises(DataError, match="could not download fake.*--mirror"):
        catalog.locate("fake")


def test_stdlib_files_sorted_without_tests():
    files = catalog.stdlib_files()
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).parts for f in files]
    assert rel == sorted(rel) and len(files) > 100
    assert all(f.suffix == ".py" for f in files)
    assert not any({"site-packages", "test", "tests"} & set(r) for r in rel)
    assert ("os.py",) in rel

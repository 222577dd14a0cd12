"""`zlm prepare` in-process: output, exit codes and one-line errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import CORPORA, need_corpus, write_ptb_char
from zlm.cli import app


@pytest.fixture
def run(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("ZLM_CORPORA", raising=False)
    runner = CliRunner()
    return lambda *args, env=None: runner.invoke(app, ["prepare", *map(str, args)], env=env)


def _error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_help(run):
    result = run("--help")
    assert result.exit_code == 0
    assert "--tokenizer" in result.stdout and "--mirror" in result.stdout


def test_tinyshakespeare_from_mirror(run, tmp_path):
    need_corpus(CORPORA / "tinyshakespeare")
    result = run("tinyshakespeare", "--out", tmp_path / "d", "--mirror", CORPORA)
    assert result.exit_code == 0, result.output
    assert "vocabulary 65" in result.stdout and "1,003,855 tokens" in result.stdout
    assert "MB/s" in result.stdout
    result = run("tinyshakespeare", "--out", tmp_path / "e", env={"ZLM_CORPORA": str(CORPORA)})
    assert result.exit_code == 0, result.output


def test_stdlib_offline(run, tmp_path):
    result = run("stdlib", "--out", tmp_path / "d")
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "d" / "dataset.json").read_text())
    assert meta["source"]["name"] == "stdlib" and meta["splits"]["train"]["tokens"] > 1_000_000


def test_ptb_char_valid_test_files(run, tmp_path):
    symbols = "#$&'*-./0123456789<>N\\abcdefghijklmnopqrstuvwxyz"
    train = tmp_path / "train.txt"
    train.write_text((" ".join(symbols) + " _ a \n") * 5)
    ptb = tmp_path / "ptb"
    write_ptb_char(ptb)  # PTB-char files written here, from tiny Shakespeare
    result = run(train, "--valid", ptb / "ptb.char.valid.txt", "--test", ptb / "ptb.char.test.txt",
                 "--format", "ptb-char", "--out", tmp_path / "d")
    assert result.exit_code == 0, result.output
    assert "vocabulary 50" in result.stdout


def test_tokenizer_options(run, tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("the cat sat on the mat\n" * 300)
    result = run(src, "--tokenizer", "bpe", "--vocab-size", "300", "--split", "0.8,0.1,0.1",
                 "--out", tmp_path / "d")
    assert result.exit_code == 0, result.output
    assert "bpe tokenizer" in result.stdout


@pytest.mark.parametrize("args, code, fragment", [
    (["missing.txt"], 2, "no such file or directory"),
    (["a.txt", "--split", "0.8,0.1,0.1", "--valid", "a.txt", "--test", "a.txt"], 2,
     "pass --valid/--test or --split, not both"),
    (["a.txt", "--split", "0.8,x"], 2, "not three fractions"),
    (["a.txt", "--tokenizer", "words"], 2, "not a tokenizer"),
    (["a.txt", "--vocab-size", "100"], 2, "bpe or unigram only"),
    (["latin1.txt"], 1, "invalid UTF-8 at byte offset 3"),
    (["empty.txt"], 1, "is empty"),
    (["a.txt", "--valid", "a.txt", "--test", "b.txt"], 1, "--unknown replace"),
    (["nosuchcorpus"], 2, "corpus name (tinyshakespeare, ptb-char"),
])
def test_errors(run, tmp_path, monkeypatch, args, code, fragment):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("abc\n" * 100)
    (tmp_path / "b.txt").write_text("abcd\n")
    (tmp_path / "latin1.txt").write_bytes("abcé".encode("latin-1"))
    (tmp_path / "empty.txt").write_bytes(b"")
    result = run(*args, "--out", tmp_path / "out")
    assert result.exit_code == code, result.output
    assert fragment in _error_line(result)
    assert not (tmp_path / "out").exists()


def test_existing_out_needs_force(run, tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("abc\n" * 100)
    assert run(src, "--out", tmp_path / "d").exit_code == 0
    result = run(src, "--out", tmp_path / "d")
    assert result.exit_code == 2 and "--force" in _error_line(result)
    result = run(src, "--out", tmp_path / "d", "--force", "--tokenizer", "byte")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "d" / "dataset.json").read_text())["tokenizer"]["kind"] == "byte"


def test_plain_output_with_no_color(run, tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("abc\n" * 100)
    result = run(src, "--out", tmp_path / "d", env={"NO_COLOR": "1"})
    assert result.exit_code == 0
    assert "\x1b[" not in result.stdout
    assert result.stdout.splitlines()[0].startswith("prepared ")


def test_rich_rendering(tmp_path, capsys):
    from zlm.cli import prepare as cli_prepare
    from zlm.data.prepare import PrepareConfig

    src = tmp_path / "a.txt"
    src.write_text("abc\n" * 100)
    ds = cli_prepare._with_progress_bar(str(src), tmp_path / "d", PrepareConfig(), False)
    cli_prepare._render(ds, 0.5, rich=True)
    out = capsys.readouterr().out
    assert "characters" in out and "vocabulary 4" in out and "MB/s" in out

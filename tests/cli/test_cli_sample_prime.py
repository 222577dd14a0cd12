"""`zlm sample --prime-file FILE`, `--prime -` (stdin) and `--unknown replace`, in-process."""

from __future__ import annotations

import pytest
from cli_tiny_run import train_tiny
from typer.testing import CliRunner

from conftest import shakespeare_text
from zlm.cli import app

runner = CliRunner()
PRIME = "ROMEO:\nIs the day so young?\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    # U+FFFD in the text gives the char vocabulary its replacement entry.
    return train_tiny(tmp_path_factory.mktemp("prime"), shakespeare_text(30_000) + "\ufffd")


def invoke(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def ok(*args, input=None):
    res = invoke(*args, input=input)
    assert res.exit_code == 0, res.output
    return res.stdout


def one_line_error(res, code, words):
    assert res.exit_code == code, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], res.output


def test_prime_file_stdin_and_text_give_the_same_sample(run, tmp_path):
    f = tmp_path / "prime.txt"
    f.write_text(PRIME, encoding="utf-8")
    opts = ["--length", "40", "--seed", "3"]
    direct = ok("sample", run, "--prime", PRIME, *opts)
    assert direct.startswith(PRIME) and len(direct) == len(PRIME) + 40 + 1
    assert ok("sample", run, "--prime-file", f, *opts) == direct
    assert ok("sample", run, "--prime", "-", *opts, input=PRIME) == direct


def test_unknown_prime_characters(run, tmp_path):
    f = tmp_path / "prime.txt"
    f.write_text("Caf\u00e9 \u20ac", encoding="utf-8")
    one_line_error(invoke("sample", run, "--prime-file", f, "--length", "5"), 2,
                   f"--prime-file {f}: character '\u00e9' (U+00E9) at character 3")
    assert "or pass --unknown replace" in invoke("sample", run, "--prime-file", f).output  # it has U+FFFD
    one_line_error(invoke("sample", run, "--prime", "-", "--length", "5", input="x\u00e9"), 2,
                   "--prime - (standard input): character '\u00e9' (U+00E9) at character 1")
    out = ok("sample", run, "--prime-file", f, "--unknown", "replace", "--length", "10", "--seed", "1")
    assert out.startswith("Caf\u00e9 \u20ac") and len(out) == len("Caf\u00e9 \u20ac") + 10 + 1
    one_line_error(invoke("sample", run, "--unknown", "drop"), 2, "--unknown drop")


def test_bad_prime_input(run, tmp_path):
    one_line_error(invoke("sample", run, "--prime-file", tmp_path / "nope.txt"), 2, "does not exist")
    one_line_error(invoke("sample", run, "--prime", "-", input=""), 2, "standard input is empty")
    (tmp_path / "empty.txt").write_text("")
    one_line_error(invoke("sample", run, "--prime-file", tmp_path / "empty.txt"), 2, "is empty")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe")
    one_line_error(invoke("sample", run, "--prime-file", tmp_path / "bin.txt"), 1, "not UTF-8")
    one_line_error(invoke("sample", run, "--prime", "x", "--prime-file", tmp_path / "empty.txt"), 2,
                   "not both")
    bare = tmp_path / "bare"
    bare.mkdir()
    one_line_error(invoke("sample", bare, "--prime", "ab"), 1, "checkpoint")


def test_no_replacement_entry_no_replace_suggestion(tmp_path):
    """A vocabulary without U+FFFD: the error does not suggest --unknown replace, which would fail too."""
    plain = train_tiny(tmp_path, shakespeare_text(30_000))
    res = invoke("sample", plain, "--prime", "caf\u00e9", "--length", "5")
    one_line_error(res, 2, "remove or replace it in the prime")
    assert "--unknown replace" not in res.output
    one_line_error(invoke("sample", plain, "--prime", "caf\u00e9", "--unknown", "replace"), 2,
                   "no replacement character")

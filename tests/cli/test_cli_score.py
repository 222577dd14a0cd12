"""`zlm score RUN [FILE | -]` in-process: totals equal `zlm eval --file`, JSON, HTML, errors."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import pytest
from cli_tiny_run import train_tiny
from typer.testing import CliRunner

from conftest import shakespeare_text
from zlm.cli import app
from zlm.cli.heatmap import print_rich
from zlm.inference.score import score

runner = CliRunner()
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("score"))


@pytest.fixture
def text_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(TEXT, encoding="utf-8")
    return f


def ok(*args, input=None):
    res = runner.invoke(app, [str(a) for a in args], input=input)
    assert res.exit_code == 0, res.output
    return res


def fails(*args, code, words, input=None):
    res = runner.invoke(app, [str(a) for a in args], input=input)
    assert res.exit_code == code, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], res.output
    return res


def json_lines(res):
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    return rows[:-1], rows[-1]["summary"]


@pytest.mark.parametrize("opts", [[], ["--batch-size", "3", "--bptt", "7"], ["--cache"],
                                  ["--cache", "--batch-size", "3", "--cache-size", "50", "--cache-lambda", "0.2"]])
def test_totals_equal_eval_file(run, tmp_path, opts):
    f = tmp_path / "long.txt"
    f.write_text(shakespeare_text(3000), encoding="utf-8")
    chars, summary = json_lines(ok("score", run, f, "--json", *opts))
    ev = json.loads(ok("eval", run, "--file", f, "--json", *(opts or ["--batch-size", "1"])).stdout)
    for key in ("characters", "tokens", "bytes"):
        assert summary[key] == ev[key]
    assert summary["bpc"] == pytest.approx(ev["bpc"], rel=1e-6)
    assert summary["nats"] == pytest.approx(ev["nats"], rel=1e-6)
    assert sum(c["bits"] for c in chars) == pytest.approx(summary["bits"], rel=1e-9)
    assert summary["protocol"] == ev["protocol"]


def test_json_one_object_per_character(run, text_file):
    chars, summary = json_lines(ok("score", run, text_file, "--json", "--top-k", "5"))
    assert "".join(c["char"] for c in chars) == TEXT
    assert [c["i"] for c in chars] == list(range(len(TEXT)))
    for c in chars:
        assert c["bits"] > 0 and len(c["top"]) == 5
        ps = [t["p"] for t in c["top"]]
        assert ps == sorted(ps, reverse=True) and 0 < sum(ps) <= 1 + 1e-9
    assert summary["attribution"] == "one token per character" and summary["characters"] == len(TEXT)


def test_stdin_and_plain_rendering(run, text_file):
    piped = ok("score", run, "-", "--json", input=TEXT)
    assert piped.stdout == ok("score", run, text_file, "--json").stdout.replace(
        json.dumps(str(text_file)), json.dumps("standard input"))
    plain = ok("score", run, text_file).stdout  # not a terminal: one line per line of text
    lines = plain.splitlines()
    assert lines[0].endswith("| First Citizen:") and " bits " in lines[0] and " bpc " in lines[0]
    assert any(line.startswith("BPC: ") for line in lines) and "protocol: 1 parallel" in plain


def test_terminal_heat_map_has_colours_and_legend(run, capsys, monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")
    print_rich(score(run, TEXT))
    out = capsys.readouterr().out
    assert "\x1b[" in out and "bits/char:" in out and ">=8" in out
    assert "First Citizen:" in out.replace("\x1b[0m", "")


class _Spans(HTMLParser):
    """The character spans of the page's #text element: (char, data-bits, data-top)."""

    def __init__(self):
        super().__init__()
        self.spans, self.depth, self.cur = [], 0, None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id") == "text":
            self.depth = 1
        elif self.depth and tag == "span":
            self.cur = ["", a["data-bits"], json.loads(a["data-top"])]

    def handle_endtag(self, tag):
        if self.cur is not None and tag == "span":
            self.spans.append(tuple(self.cur))
            self.cur = None
        elif self.depth and tag == "div":
            self.depth = 0

    def handle_data(self, data):
        if self.cur is not None:
            self.cur[0] += data


def test_html_page_has_every_character_with_bits_and_top5(run, text_file, tmp_path):
    out = tmp_path / "page.html"
    res = ok("score", run, text_file, "--html", out)
    assert "wrote" in res.stdout and out.is_file()
    page = out.read_text(encoding="utf-8")
    assert "<script>" in page and "http" not in page.split("<body>")[1]  # self-contained
    parser = _Spans()
    parser.feed(page)
    chars, _ = json_lines(ok("score", run, text_file, "--json"))
    assert "".join(s[0] for s in parser.spans) == TEXT
    for (ch, bits, top), want in zip(parser.spans, chars, strict=True):
        assert ch == want["char"]
        assert float(bits) == pytest.approx(want["bits"], abs=1e-4)
        assert [t for t, _ in top] == [t["token"] for t in want["top"]] and len(top) == 5
        assert [p for _, p in top] == pytest.approx([t["p"] for t in want["top"]], abs=1e-4)
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_unknown_characters(run, tmp_path):
    f = tmp_path / "u.txt"
    f.write_text("Speak \u20ac now", encoding="utf-8")
    fails("score", run, f, code=1, words="'\u20ac' (U+20AC) at character 6")
    fails("score", run, f, "--unknown", "replace", code=1, words="no replacement character")


def test_bad_input_is_one_line_and_writes_nothing(run, text_file, tmp_path):
    fails("score", run, tmp_path / "missing.txt", code=2, words="does not exist")
    fails("score", run, "-", input="", code=2, words="standard input is empty")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    fails("score", run, empty, code=2, words="is empty")
    fails("score", run, tmp_path, code=2, words="is not a file")
    (tmp_path / "bad.txt").write_bytes(b"ab\xffc")
    fails("score", run, tmp_path / "bad.txt", code=1, words="not UTF-8")
    bare = tmp_path / "bare_run"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    fails("score", bare, text_file, code=1, words="checkpoint")
    fails("score", run, text_file, "--html", tmp_path / "no" / "p.html", code=2, words="does not exist")
    fails("score", run, text_file, "--html", tmp_path, code=2, words="is a directory")
    out = tmp_path / "out"
    out.mkdir()
    too_long = out / ("x" * 240 + ".html")  # the page fits, its temporary name does not
    fails("score", run, text_file, "--html", too_long, code=2, words="cannot be written")
    assert list(out.iterdir()) == []
    fails("score", run, text_file, "--batch-size", "0", code=2, words="--batch-size")

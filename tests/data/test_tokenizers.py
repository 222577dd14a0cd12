"""Tokenizers: lossless round trips (hypothesis), unknown characters, save/load."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import shakespeare_text
from zlm.data.tokenizers import (
    ByteTokenizer,
    CharTokenizer,
    load_tokenizer,
    token_dtype,
    train_tokenizer,
)
from zlm.errors import DataError, UsageError


def _training_text() -> str:
    return shakespeare_text(200_000)


@pytest.fixture(scope="module")
def subword():
    text = _training_text()
    return {kind: train_tokenizer(kind, text, vocab_size=400) for kind in ("bpe", "unigram")}


def _stream(tok, ids) -> str:
    dec = tok.stream_decoder()
    return "".join(dec.feed(int(i)) for i in ids) + dec.flush()


@given(st.text())
@settings(max_examples=200, deadline=None)
def test_char_round_trip(text):
    tok = train_tokenizer("char", text + "x")
    ids = tok.encode(text)
    assert ids.dtype == np.int64 and ids.shape == (len(text),)
    assert tok.decode(ids) == text
    assert _stream(tok, ids) == text


@given(st.text())
@settings(max_examples=200, deadline=None)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.shape == (len(text.encode("utf-8")),)
    assert tok.decode(ids) == text
    assert _stream(tok, ids) == text


@given(st.lists(st.integers(0, 255), max_size=50))
@settings(deadline=None)  # (hypothesis's default 200 ms deadline fails a loaded machine)
def test_byte_stream_decoder_matches_decode_on_any_bytes(ids):
    tok = ByteTokenizer()
    assert _stream(tok, ids) == tok.decode(ids)


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
@given(text=st.text())
@settings(max_examples=150, deadline=None)
def test_subword_round_trip(subword, kind, text):
    tok = subword[kind]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert _stream(tok, ids) == text


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_subword_awkward_text(subword, kind):
    tok = subword[kind]
    for text in ["  two  spaces  ", "\n\n", "tab\tcr\r\n", "\u2581 marker \u2581\u2581",
                 "\x00nul", "emoji \U0001F600 and 漢字", ""]:
        assert tok.decode(tok.encode(text)) == text


def test_subword_training_is_deterministic():
    text = _training_text()[:50_000]
    a = train_tokenizer("unigram", text, vocab_size=400)
    b = train_tokenizer("unigram", text, vocab_size=400)
    assert a._proto == b._proto


def test_char_vocabulary_is_sorted_set():
    tok = train_tokenizer("char", ["hello ", "world"])
    assert tok.chars == sorted(set("hello world"))
    assert tok.vocab_size == 8
    assert tok.encode("dole").tolist() == [tok.chars.index(c) for c in "dole"]


def test_char_unknown_error_names_character_and_position():
    tok = CharTokenizer("abc")
    with pytest.raises(DataError) as e:
        tok.encode("abcaé!")
    msg = str(e.value)
    assert "'é'" in msg and "U+00E9" in msg and "character 4" in msg
    assert "--unknown replace" in msg and "\n" not in msg


def test_char_unknown_replace():
    tok = train_tokenizer("char", "abc", unknown="replace")
    assert "\ufffd" in tok.chars
    ids = tok.encode("aé€b", unknown="replace")
    assert tok.decode(ids) == "a\ufffd\ufffdb"
    with pytest.raises(DataError, match="--unknown replace"):
        CharTokenizer("abc").encode("é", unknown="replace")


def test_char_fast_ascii_path_matches_general_path():
    tok = CharTokenizer("abc \n\u00e9")
    assert tok.ids("ab c\n").dtype == np.uint8
    # ASCII text takes bytes.translate; one non-ASCII character sends the same text through
    # the code point table (int32 ids): both must give the same ids for the ASCII part.
    text = "ab c\ncab \n"
    general = tok.ids(text + "\u00e9")
    assert general.dtype == np.int32 and tok.ids(text).dtype == np.uint8
    assert tok.ids(text).tolist() == general[:-1].tolist()
    assert tok.encode(text).tolist() == tok.encode(text + "\u00e9").tolist()[:-1]
    # An ASCII character outside the vocabulary leaves the fast path: refused the same way.
    for unknown in ("abx", "abx\u00e9"):
        with pytest.raises(DataError, match=r"'x' \(U\+0078\) at character 2 "):
            tok.ids(unknown)
    big = CharTokenizer([chr(i) for i in range(300)])
    assert big.encode("abc").tolist() == [97, 98, 99]


@pytest.mark.parametrize("kind", ["char", "byte", "bpe", "unigram"])
def test_save_and_load(tmp_path, subword, kind):
    tok = subword[kind] if kind in subword else train_tokenizer(kind, "hello world\n")
    path = tok.save(tmp_path)
    assert path.name == ("tokenizer.model" if kind in subword else "tokenizer.json")
    back = load_tokenizer(tmp_path, tok.meta())
    text = "hello world\n"
    assert back.kind == kind and back.vocab_size == tok.vocab_size
    assert back.encode(text).tolist() == tok.encode(text).tolist()
    with pytest.raises(DataError, match="re-run zlm prepare"):
        load_tokenizer(tmp_path, {**tok.meta(), "vocab_size": tok.vocab_size + 1})


def test_load_errors(tmp_path):
    with pytest.raises(DataError, match="missing"):
        load_tokenizer(tmp_path, {"kind": "char", "vocab_size": 3, "file": "tokenizer.json"})
    with pytest.raises(DataError, match="unknown tokenizer kind"):
        load_tokenizer(tmp_path, {"kind": "wordpiece", "file": "x"})


def test_train_errors():
    with pytest.raises(UsageError, match="not a tokenizer"):
        train_tokenizer("words", "abc")
    with pytest.raises(UsageError, match="bpe/unigram only"):
        train_tokenizer("char", "abc", vocab_size=100)
    with pytest.raises(DataError, match="no characters"):
        train_tokenizer("char", "")


def test_token_dtype():
    assert token_dtype(65) == np.uint8 and token_dtype(256) == np.uint8
    assert token_dtype(257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_subword_vocab_too_small_says_the_minimum():
    with pytest.raises(UsageError, match=r"--vocab-size 100 is too small.*at least \d+"):
        train_tokenizer("bpe", "some text\n", vocab_size=100)

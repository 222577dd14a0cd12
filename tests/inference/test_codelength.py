"""zlm.inference.codelength: per-token and per-character bits, against `zlm eval --file`'s totals."""

from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest
import torch

from conftest import shakespeare_text
from zlm.core.eval_protocol import EvalProtocol
from zlm.core.precision import resolve_runtime
from zlm.data.tokenizers import ByteTokenizer, CharTokenizer, train_tokenizer
from zlm.inference.codelength import char_bits, char_tokens, token_bits, token_predictions, token_spans
from zlm.inference.evaluate import evaluate_text
from zlm.inference.load import LoadedModel
from zlm.model.cells import choose_cell
from zlm.model.lm import ModelConfig, ZoneoutLM

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll: Speak, speak.\n"
UNICODE = "na\u00efve caf\u00e9 \u2014 \u20ac5 \U0001f600 ok\n"


def loaded(tokenizer, seed=0, hidden=16) -> LoadedModel:
    """A randomly initialised model around `tokenizer` (a fake checkpoint: nothing on disk)."""
    torch.manual_seed(seed)
    rt = resolve_runtime("cpu", "fp32")
    choice = choose_cell("auto", rt.device)
    model = ZoneoutLM(ModelConfig(vocab_size=tokenizer.vocab_size, hidden=hidden, embed=8,
                                  layers=2, zoneout_cell=0.3, zoneout_hidden=0.1), choice.fn).eval()
    return LoadedModel(model, tokenizer, rt, pathlib.Path("fake"), {}, choice)


@pytest.fixture(scope="module")
def bpe():
    return train_tokenizer("bpe", shakespeare_text(40_000), vocab_size=400)  # UNICODE: byte fallback


@pytest.mark.parametrize("streams,bptt", [(1, 256), (1, 7), (4, 16), (16, 5)])
def test_token_bits_sum_to_eval_file_total(streams, bptt):
    lm = loaded(CharTokenizer(TEXT))
    protocol = EvalProtocol(streams, bptt)
    bits = token_bits(lm, lm.tokenizer.encode(TEXT), protocol)
    assert bits.shape == (len(TEXT),) and bits.dtype == np.float64 and np.all(bits > 0)
    score = evaluate_text(lm, TEXT, protocol)
    assert bits.sum() == pytest.approx(score.nats / math.log(2), rel=1e-6)


def test_single_stream_bits_are_the_model_own_conditionals():
    lm = loaded(CharTokenizer(TEXT))
    ids = lm.tokenizer.encode(TEXT)
    pred = token_predictions(lm, ids, EvalProtocol(1, 10), top_k=5)
    tokens = torch.from_numpy(np.concatenate([lm.tokenizer.encode("\n"), ids]))[:, None]
    with torch.no_grad():
        logits, _ = lm.model(tokens[:-1])  # (N, 1, V) one window
    logp = torch.log_softmax(logits[:, 0].double(), -1)
    want = -logp.gather(1, tokens[1:]).squeeze(1) / math.log(2)
    np.testing.assert_allclose(pred.bits, want.numpy(), rtol=1e-5)
    top = logp.topk(5, -1)
    np.testing.assert_array_equal(pred.top_ids, top.indices.numpy())
    np.testing.assert_allclose(pred.top_probs, top.values.exp().numpy(), rtol=1e-5)
    assert np.all(np.diff(pred.top_probs, axis=1) <= 0)


def test_vocabulary_without_newline_leaves_the_first_token_unpredicted():
    text = "abcabcabba"
    lm = loaded(CharTokenizer(text))
    bits = token_bits(lm, lm.tokenizer.encode(text))
    assert math.isnan(bits[0]) and np.all(np.isfinite(bits[1:]))
    assert np.nansum(bits) == pytest.approx(evaluate_text(lm, text).nats / math.log(2), rel=1e-6)


def test_byte_chars_sum_their_utf8_bytes():
    tok = ByteTokenizer()
    lm = loaded(tok)
    ids = tok.encode(UNICODE)
    bits = token_bits(lm, ids)
    per_char = char_bits(tok, UNICODE, bits)
    assert per_char.shape == (len(UNICODE),)
    k = 0
    for i, ch in enumerate(UNICODE):
        n = len(ch.encode("utf-8"))
        assert per_char[i] == pytest.approx(bits[k : k + n].sum())
        k += n
    assert per_char.sum() == pytest.approx(evaluate_text(lm, UNICODE).nats / math.log(2), rel=1e-6)
    first = char_tokens(tok, UNICODE, len(ids))
    assert first[0] == 0 and first[-1] == len(ids) - 1
    assert first[UNICODE.index("\U0001f600") + 1] - first[UNICODE.index("\U0001f600")] == 4


def test_subword_chars_share_their_token_evenly(bpe):
    text = shakespeare_text(400) + UNICODE + "\u2581 literal meta"
    ids = bpe.encode(text)
    assert len(ids) < len(text)  # real merges
    bits = np.arange(1, len(ids) + 1, dtype=np.float64)  # any numbers will do
    per_char = char_bits(bpe, text, bits)
    assert per_char.sum() == pytest.approx(bits.sum())
    lo, hi = token_spans(bpe, text, len(ids))
    for t in range(len(ids)):
        if hi[t] - lo[t] > 1:  # a merged piece: every character gets the same share
            np.testing.assert_allclose(per_char[lo[t]:hi[t]], bits[t] / (hi[t] - lo[t]))
            break
    else:
        pytest.fail("no multi-character token")
    # The emoji is spelled by 4 byte-fallback tokens: its character carries all four.
    e = text.index("\U0001f600")
    mine = np.flatnonzero(lo == e)
    assert len(mine) == 4 and per_char[e] == pytest.approx(bits[mine].sum())
    lm = loaded(bpe)
    real = token_bits(lm, ids)
    assert char_bits(bpe, text, real).sum() == pytest.approx(
        evaluate_text(lm, text).nats / math.log(2), rel=1e-6)


def test_char_is_identity_and_mismatches_are_refused(bpe):
    tok = CharTokenizer(TEXT)
    bits = np.linspace(0.5, 3, len(TEXT))
    np.testing.assert_array_equal(char_bits(tok, TEXT, bits), bits)
    np.testing.assert_array_equal(char_tokens(tok, TEXT, len(TEXT)), np.arange(len(TEXT)))
    with pytest.raises(ValueError):
        char_bits(tok, TEXT, bits[:-1])
    with pytest.raises(ValueError):
        char_bits(ByteTokenizer(), UNICODE, np.ones(len(UNICODE)))
    with pytest.raises(ValueError):
        char_bits(bpe, TEXT, np.ones(len(TEXT) + 3))


def test_empty_text():
    lm = loaded(CharTokenizer(TEXT))
    assert token_bits(lm, np.zeros(0, dtype=np.int64)).shape == (0,)
    assert char_bits(lm.tokenizer, "", np.zeros(0)).shape == (0,)

"""zlm.inference.score: per-character bits with the model's top-k, for char, byte and context-only cases."""

from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest
import torch

from zlm.core.precision import resolve_runtime
from zlm.data.tokenizers import ByteTokenizer, CharTokenizer
from zlm.errors import DataError, UsageError
from zlm.inference.adapt_config import CacheConfig
from zlm.inference.evaluate import evaluate_text
from zlm.inference.load import LoadedModel
from zlm.inference.score import ScoreConfig, score_text_chars, token_label
from zlm.model.cells import choose_cell
from zlm.model.lm import ModelConfig, ZoneoutLM


def fake_lm(tokenizer, seed=0) -> LoadedModel:
    torch.manual_seed(seed)
    rt = resolve_runtime("cpu", "fp32")
    choice = choose_cell("auto", rt.device)
    model = ZoneoutLM(ModelConfig(vocab_size=tokenizer.vocab_size, hidden=16, embed=8), choice.fn)
    return LoadedModel(model.eval(), tokenizer, rt, pathlib.Path("fake"), {}, choice)


def test_byte_model_scores_characters_and_labels_bytes():
    text = "caf\u00e9 \u2603\n"
    lm = fake_lm(ByteTokenizer())
    scored = score_text_chars(lm, text, ScoreConfig(top_k=256))
    assert scored.bits.shape == (len(text),) and len(scored.top_tokens) == len(text)
    assert scored.score.characters == len(text) and scored.score.bytes == len(text.encode())
    assert scored.score.tokens == len(text.encode())
    assert scored.score.nats == pytest.approx(evaluate_text(lm, text).nats, rel=1e-6)
    assert "sum over its UTF-8 bytes" in scored.attribution
    labels = set(scored.top_tokens[0])
    assert {"a", "\n", "<0xE2>", "<0xFF>"} <= labels and len(labels) == 256
    d = scored.char_dict(3)
    assert d["char"] == "\u00e9" and d["bits"] == pytest.approx(scored.bits[3]) and len(d["top"]) == 256


def test_vocabulary_without_newline_marks_the_first_character_as_context():
    lm = fake_lm(CharTokenizer("abc"))
    scored = score_text_chars(lm, "abcab", ScoreConfig(top_k=2))
    assert math.isnan(scored.bits[0]) and np.all(np.isfinite(scored.bits[1:]))
    assert scored.char_dict(0) == {"i": 0, "char": "a", "bits": None, "top": []}
    assert len(scored.char_dict(1)["top"]) == 2
    ref = evaluate_text(lm, "abcab")
    assert (scored.score.characters, scored.score.tokens) == (ref.characters, ref.tokens) == (4, 4)
    assert scored.score.nats == pytest.approx(ref.nats, rel=1e-6)


def test_labels_and_config_checks():
    tok = CharTokenizer("ab\n")
    assert token_label(tok, 2) == "b"
    assert token_label(ByteTokenizer(), 0xC3) == "<0xC3>"
    with pytest.raises(DataError, match="empty"):
        score_text_chars(fake_lm(tok), "")
    for bad in (dict(top_k=-1), dict(unknown="drop"), dict(streams=0), dict(bptt=0)):
        with pytest.raises(UsageError):
            ScoreConfig(**bad)


def test_subword_labels():
    from conftest import shakespeare_text
    from zlm.data.tokenizers import train_tokenizer

    sp = train_tokenizer("bpe", shakespeare_text(20_000), vocab_size=400)
    labels = [token_label(sp, i) for i in range(sp.vocab_size)]
    assert "<0xE2>" in labels and " the" in labels and "\n" in labels and "a" in labels
    assert all(labels)


@pytest.mark.parametrize("streams", [1, 3])
def test_the_cache_scores_what_zlm_eval_cache_scores_over_a_whole_distribution(streams):
    """--cache: the totals are `zlm eval --file --cache`'s (the tail of the last stream
    included, at 3 streams); every position's distribution over all tokens sums to 1 and
    holds the target's bits; a fixed share of 0 is the plain model."""
    text = "To be, or not to be: that is the question.\n" * 12
    tok = CharTokenizer(text)
    lm = fake_lm(tok)
    with torch.no_grad():
        lm.model.embedding.weight.mul_(10)  # distinct states, so the cache matters
    cache = CacheConfig(200, 5.0)
    protocol = ScoreConfig(streams=streams).protocol
    scored = score_text_chars(lm, text, ScoreConfig(streams=streams, top_k=tok.vocab_size, cache=cache))
    ref = evaluate_text(lm, text, protocol, cache=cache)
    plain = score_text_chars(lm, text, ScoreConfig(streams=streams))
    assert scored.score.nats == pytest.approx(ref.nats, rel=1e-6) and scored.score.nats < 0.95 * plain.score.nats  # 0.90 when written
    assert "continuous cache" in scored.protocol
    np.testing.assert_allclose(scored.top_probs.sum(1), 1.0, atol=1e-6)
    target = [row.index(c) for row, c in zip(scored.top_tokens, text, strict=True)]
    np.testing.assert_allclose(-np.log2(scored.top_probs[np.arange(len(text)), target]), scored.bits, rtol=1e-9)
    zero = score_text_chars(lm, text, ScoreConfig(streams=streams, top_k=3, cache=CacheConfig(200, 5.0, 0.0)))
    np.testing.assert_allclose(zero.bits, plain.bits, rtol=1e-6)

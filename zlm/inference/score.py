"""`zlm score`: where in a text the model is surprised — bits per character, and what it expected.

Owns `ScoreConfig` -> `score_text_chars` -> `ScoredText`: per-character bits (from
`zlm.inference.codelength`), the model's top-k next tokens before each character, and the
totals, which are `zlm eval --file`'s under the same protocol (`--batch-size`, `--bptt`).
The library returns numbers; colouring and the HTML page live in the CLI.

One stream by default (`zlm eval --file` defaults to 16): a heat map should not show
cold starts in the middle of the text. With a char vocabulary that has no newline the
first character is context only; its bits are NaN (null in JSON) and it is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from zlm.core.eval_protocol import STREAM_CONTEXT, EvalProtocol
from zlm.core.metrics import LN2, Score
from zlm.data.tokenizers import Tokenizer, check_unknown
from zlm.errors import DataError, UsageError
from zlm.inference.adapt_config import CacheConfig
from zlm.inference.codelength import ATTRIBUTION, char_bits, char_tokens, token_predictions
from zlm.inference.load import load_model


@dataclass(frozen=True)
class ScoreConfig:
    """How `zlm score` scores a text."""

    streams: int = 1  # parallel streams (--batch-size); 1: the whole text in one stream
    bptt: int = 256  # window length in tokens (--bptt); the state is carried across windows
    top_k: int = 5  # the model's most likely next tokens kept per character (--top-k)
    unknown: str = "error"  # error | replace: characters outside a char vocabulary (--unknown)
    device: str = "auto"
    precision: str = "fp32"
    cell: str = "auto"
    cache: CacheConfig | None = None  # --cache: the continuous cache's mixture, as zlm eval --cache
    stream_context: int = STREAM_CONTEXT  # --stream-context: tokens read before each later stream

    def __post_init__(self):
        check_unknown(self.unknown)
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0, got {self.top_k}")
        EvalProtocol(self.streams, self.bptt, stream_context=self.stream_context)  # checks the three options

    @property
    def protocol(self) -> EvalProtocol:
        return EvalProtocol(self.streams, self.bptt, stream_context=self.stream_context)


@dataclass(frozen=True)
class ScoredText:
    """A text with the bits the model spent on each character."""

    text: str
    bits: np.ndarray  # (C,) float64 bits per character; NaN: context only, not predicted
    top_tokens: list[list[str]]  # (C, k) the model's k most likely next tokens, as text
    top_probs: np.ndarray  # (C, k) float64 their probabilities
    score: Score  # totals: those of `zlm eval --file` under the same protocol
    protocol: str
    attribution: str  # how token bits became character bits
    tokenizer: str  # tokenizer kind
    checkpoint: str
    source: str

    def summary(self) -> dict:
        """The totals, with `zlm eval --json`'s keys."""
        s = self.score
        return {"bpc": s.bpc, "bits": s.nats / LN2, "bits_per_byte": s.bits_per_byte,
                "perplexity": s.perplexity, "nats": s.nats, "tokens": s.tokens,
                "characters": s.characters, "bytes": s.bytes, "protocol": self.protocol,
                "attribution": self.attribution, "tokenizer": self.tokenizer,
                "checkpoint": self.checkpoint, "source": self.source}

    def char_dict(self, i: int) -> dict:
        """Character i as {"i", "char", "bits", "top": [{"token", "p"}, ...]} (bits None: context)."""
        b = float(self.bits[i])
        if math.isnan(b):  # context only: nothing was predicted here
            return {"i": i, "char": self.text[i], "bits": None, "top": []}
        return {"i": i, "char": self.text[i], "bits": b,
                "top": [{"token": t, "p": float(p)}
                        for t, p in zip(self.top_tokens[i], self.top_probs[i], strict=True)]}


def token_label(tokenizer: Tokenizer, token_id: int) -> str:
    """A token as text: its characters, or `<0xNN>` for a byte that is not a character alone."""
    i = int(token_id)
    if tokenizer.kind == "byte" and i >= 0x80:
        return f"<0x{i:02X}>"
    if tokenizer.kind in ("bpe", "unigram"):
        sp = tokenizer.sp
        if sp.is_control(i) or sp.is_unknown(i) or (sp.is_byte(i) and int(sp.id_to_piece(i)[3:5], 16) >= 0x80):
            return sp.id_to_piece(i)
    return tokenizer.stream_decoder().feed(i)


def score_text_chars(lm, text: str, config: ScoreConfig = ScoreConfig(), source: str = "") -> ScoredText:
    """Per-character bits of `text` under a loaded model (`zlm.inference.load.LoadedModel`)."""
    if not text:
        raise DataError(f"{source or 'the text'} is empty; there is nothing to score")
    tok = lm.tokenizer
    ids = tok.encode(text, unknown=config.unknown)  # (N,)
    pred = token_predictions(lm, ids, config.protocol, config.top_k, config.cache)
    bits = char_bits(tok, text, pred.bits)  # (C,)
    first = char_tokens(tok, text, len(ids))  # (C,) the prediction each character is read from
    labels = {int(i): token_label(tok, i) for i in np.unique(pred.top_ids)}
    top_tokens = [[labels[int(i)] for i in row] for row in pred.top_ids[first]]
    top_probs = pred.top_probs[first]  # (C, k)
    context = np.isnan(bits)  # only a char vocabulary without a newline has any
    counted = text if not context.any() else "".join(c for c, x in zip(text, context, strict=True) if not x)
    predicted = int(np.isfinite(pred.bits).sum())
    score = Score(nats=float(np.nansum(pred.bits)) * LN2, tokens=predicted,
                  characters=len(counted), bytes=len(counted.encode("utf-8")))
    ctx = ("the text is preceded by one newline as context" if not context.any()
           else "the text's first token is context")
    if config.cache is not None:
        ctx = f"{ctx}; {config.cache.describe()}"
    return ScoredText(text, bits, top_tokens, top_probs, score,
                      config.protocol.describe(predicted, ctx), ATTRIBUTION[tok.kind], tok.kind,
                      str(lm.path), source)


def score(path, text: str, config: ScoreConfig = ScoreConfig(), source: str = "") -> ScoredText:
    """`zlm score`: load a RUN_DIR or checkpoint and score `text` character by character."""
    if not text:
        raise DataError(f"{source or 'the text'} is empty; there is nothing to score")
    lm = load_model(path, config.device, config.precision, config.cell)
    return score_text_chars(lm, text, config, source)

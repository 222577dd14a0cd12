"""Code lengths: how many bits the model spends on each token and each character of a text.

Owns the per-prediction side of per-character scoring, shared by `zlm score` and `zlm compress`:

    token_predictions(lm, ids, protocol, top_k)  -> TokenPredictions: bits (N,), top-k
    token_bits(lm, ids, protocol)                -> bits (N,) float64, one per token of ids
    char_bits(tokenizer, text, token_bits)       -> bits (len(text),) float64
    char_tokens(tokenizer, text, n_tokens)       -> (len(text),) the first token of each character

The protocol is `zlm eval --file`'s (`zlm.inference.evaluate.evaluate_text`): the text's
tokens are preceded by one newline token as context, so every token is predicted, and
the predictions are cut into streams and windows exactly as `zlm.core.eval_protocol` cuts them
(state carried, never reset). The sum of `token_bits` is therefore `zlm eval --file`'s
total under the same protocol, up to float summation order. A vocabulary without a
newline has no context token: the text's first token is context and its bits are NaN.

Characters (`char_bits`, see `ATTRIBUTION`): for a char tokenizer a character's bits are
its token's; for byte tokens the sum over its UTF-8 bytes; for subword (bpe/unigram)
tokens an even share of the token's bits over the characters the token spells (a
character spelled by several byte-fallback tokens gets the sum of their shares). Either
way the characters' bits sum to the tokens' bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from zlm.core.eval_protocol import EvalProtocol, warm_states
from zlm.core.metrics import LN2
from zlm.data.tokenizers import Tokenizer, context_ids
from zlm.inference.adapt_config import CacheConfig
from zlm.inference.cache import CacheScorer

ATTRIBUTION = {
    "char": "one token per character",
    "byte": "a character's bits are the sum over its UTF-8 bytes",
    "bpe": "a character's bits are an even share of its token's bits",
    "unigram": "a character's bits are an even share of its token's bits",
}


@dataclass(frozen=True)
class TokenPredictions:
    """What the model said before each token of a text."""

    bits: np.ndarray  # (N,) float64: -log2 p(token n | everything before it); NaN if unpredicted
    top_ids: np.ndarray  # (N, k) int64: the k most likely tokens at that position, best first
    top_probs: np.ndarray  # (N, k) float64: their probabilities


def _targets(lm, ids: np.ndarray) -> tuple[np.ndarray, int]:
    """The token sequence the protocol runs over and how many leading ids are context only."""
    ctx = context_ids(lm.tokenizer)
    if ctx is None:  # no newline in the vocabulary: the first token is the context
        return ids, 1
    return np.concatenate([ctx[-1:], ids]), 0


def _run_stream(model, tokens, starts, length, bptt, state, runtime, out: TokenPredictions,
                offset: int, cache: CacheScorer | None = None):
    """Run streams starting at `starts` for `length` predictions, writing into `out`; with
    `cache`, the predictions are its mixture's."""
    dev, k = runtime.device, out.top_ids.shape[1]
    for s in range(0, length, bptt):
        T = min(bptt, length - s)
        pos = starts[None, :] + s + np.arange(T + 1)[:, None]  # (T+1, B)
        window = torch.from_numpy(np.asarray(tokens[pos], dtype=np.int64)).to(dev)
        with runtime.autocast():
            x, state = model.features(window[:-1], state)  # (T, B, H)
            logits = model.decoder(x)  # (T, B, V)
        logp = F.log_softmax(logits.float(), -1)  # (T, B, V)
        if cache is not None:
            logp = cache.log_probs(x.float(), logp, window[1:])
        nll = -logp.gather(-1, window[1:, :, None]).squeeze(-1)  # (T, B)
        at = pos[:-1] + offset  # (T, B): index of the predicted token in ids
        out.bits[at] = nll.double().cpu().numpy() / LN2
        if k:
            top = logp.topk(k, -1)  # (T, B, k)
            out.top_ids[at] = top.indices.cpu().numpy()
            out.top_probs[at] = top.values.double().exp().cpu().numpy()
    return state


@torch.no_grad()
def token_predictions(lm, ids: np.ndarray, protocol: EvalProtocol = EvalProtocol(1),
                      top_k: int = 0, cache: CacheConfig | None = None) -> TokenPredictions:
    """Bits of each of the N tokens of `ids` and the model's top-k tokens before each.

    lm: a `zlm.inference.load.LoadedModel`. ids: (N,) the text's token ids (as
    `lm.tokenizer.encode(text)`); the newline context is prepended here. top_k: 0 for
    bits only; capped at the vocabulary size. cache: the predictions are mixed with the
    continuous cache (`zlm.inference.cache`), as `zlm eval --file --cache` scores them.
    """
    model = lm.model
    was_training = model.training
    model.eval()
    ids = np.asarray(ids, dtype=np.int64)
    k = min(max(int(top_k), 0), model.config.vocab_size)
    out = TokenPredictions(np.full(len(ids), np.nan), np.zeros((len(ids), k), dtype=np.int64),
                           np.zeros((len(ids), k)))
    tokens, skip = _targets(lm, ids)
    n = len(tokens) - 1  # predictions
    if n < 1:
        return out
    offset = skip  # prediction p predicts tokens[p + 1] = ids[p + skip]
    S = protocol.streams_for(n)
    L = n // S
    rt = lm.runtime
    scorer = None if cache is None else CacheScorer(S, model.config.hidden, cache, rt.device)
    state = warm_states(model, tokens, np.arange(S) * L, protocol, rt)
    state = _run_stream(model, tokens, np.arange(S) * L, L, protocol.bptt, state, rt, out, offset, scorer)
    tail = n - S * L
    if tail:  # the last stream continues, state carried, to the end (as zlm.core.eval_protocol)
        last = (state[0][:, -1:].contiguous(), state[1][:, -1:].contiguous())
        if scorer is not None:
            scorer.keep_last()
        _run_stream(model, tokens, np.array([S * L]), tail, protocol.bptt, last, rt, out, offset, scorer)
    model.train(was_training)
    return out


def token_bits(lm, ids: np.ndarray, protocol: EvalProtocol = EvalProtocol(1)) -> np.ndarray:
    """(N,) float64 bits of each token of `ids` under `zlm eval --file`'s protocol."""
    return token_predictions(lm, ids, protocol).bits


# ------------------------------------------------------------------- tokens -> characters


def token_spans(tokenizer: Tokenizer, text: str, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The characters each of the n_tokens tokens of `text` is charged to: [lo, hi).

    A token that completes no character on its own (a leading byte of a multi-byte
    character) is charged to the next character completed. Raises ValueError when the
    tokens do not spell `text` (a token count from another text or tokenizer).
    """
    n_chars = len(text)
    if tokenizer.kind == "char":
        if n_tokens != n_chars:
            raise ValueError(f"{n_tokens} char tokens for {n_chars} characters")
        lo = np.arange(n_chars, dtype=np.int64)
        return lo, lo + 1
    if tokenizer.kind == "byte":
        lens = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
        lens = 1 + (lens >= 0x80) + (lens >= 0x800) + (lens >= 0x10000)  # UTF-8 bytes per char
        if n_tokens != int(lens.sum()):
            raise ValueError(f"{n_tokens} byte tokens for {int(lens.sum())} UTF-8 bytes")
        lo = np.repeat(np.arange(n_chars, dtype=np.int64), lens)
        return lo, lo + 1
    return _stream_spans(tokenizer, text, n_tokens)


def _stream_spans(tokenizer: Tokenizer, text: str, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Spans from the tokenizer's own incremental decoder (subword tokenizers)."""
    ids = tokenizer.encode(text, unknown="replace")
    if len(ids) != n_tokens:
        raise ValueError(f"{n_tokens} tokens given but the text has {len(ids)}")
    dec = tokenizer.stream_decoder()
    lo = np.zeros(n_tokens, dtype=np.int64)
    hi = np.zeros(n_tokens, dtype=np.int64)
    pos, pending = 0, []
    for t, i in enumerate(ids.tolist()):
        piece = dec.feed(i)
        if not piece:
            pending.append(t)
            continue
        if text[pos : pos + len(piece)] != piece:
            raise ValueError(f"token {t} spells {piece!r}, the text has {text[pos:pos + len(piece)]!r}")
        lo[t], hi[t] = pos, pos + len(piece)
        lo[pending], hi[pending] = pos, pos + 1  # charged to the first character completed
        pending = []
        pos += len(piece)
    if pending or pos != len(text) or dec.flush():
        raise ValueError("the tokens do not spell the whole text")
    return lo, hi


def _expand(lo: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """lo (N,), counts (N,) -> concatenated ranges lo[t] .. lo[t] + counts[t] - 1."""
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(lo, counts) + (np.arange(int(counts.sum())) - starts)


def char_bits(tokenizer: Tokenizer, text: str, token_bits: np.ndarray) -> np.ndarray:
    """(len(text),) float64 bits of each character of `text`, from its tokens' bits.

    token_bits: (N,) one per token of `tokenizer.encode(text)` (NaN stays NaN).
    char: identity; byte: sum over the character's UTF-8 bytes; bpe/unigram: an even share
    of each token's bits over the characters it spells. The result sums to token_bits' sum.
    """
    token_bits = np.asarray(token_bits, dtype=np.float64)
    lo, hi = token_spans(tokenizer, text, len(token_bits))
    if tokenizer.kind == "char":
        return token_bits.copy()
    counts = hi - lo  # (N,) >= 1
    chars = _expand(lo, counts)  # (sum(counts),) character index of each (token, char) pair
    share = np.repeat(token_bits / counts, counts)
    return np.bincount(chars, weights=share, minlength=len(text)).astype(np.float64)


def char_tokens(tokenizer: Tokenizer, text: str, n_tokens: int) -> np.ndarray:
    """(len(text),) int64: the index of the first token charged to each character (the
    prediction a character's top-k next tokens are read from)."""
    lo, hi = token_spans(tokenizer, text, n_tokens)
    counts = hi - lo
    chars = _expand(lo, counts)  # (sum(counts),) character index of each (token, char) pair
    first = np.full(len(text), n_tokens, dtype=np.int64)
    np.minimum.at(first, chars, np.repeat(np.arange(n_tokens), counts))
    return first

"""`zlm eval`: bits per character of a text file or of a split of the training data.

Owns `EvalConfig` -> `evaluate` -> `EvalResult`, and scoring a loaded model on a text
(`evaluate_text`) or a split of the DATA_DIR it was trained on (`evaluate_split`). The
protocol and the scoring loop are `zlm.core.eval_protocol`'s, shared with training's validation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zlm.core.eval_protocol import STREAM_CONTEXT, EvalProtocol, evaluate_predictions, split_score
from zlm.core.metrics import Score
from zlm.data.dataset import Dataset
from zlm.data.tokenizers import check_unknown, context_ids
from zlm.errors import DataError, UsageError, require_file
from zlm.inference.adapt_config import CacheConfig
from zlm.inference.cache import cache_score_predictions
from zlm.inference.dynamic import DynamicConfig, dynamic_score_predictions
from zlm.inference.load import load_model


def evaluate_text(lm, text: str, protocol: EvalProtocol = EvalProtocol(1), unknown: str = "error",
               dynamic: DynamicConfig | None = None, cache: CacheConfig | None = None) -> Score:
    """Score every character of `text`, preceded by one newline token as context.

    lm: a `zlm.inference.load.LoadedModel`. Characters outside a char vocabulary raise
    DataError naming the first one and its position, or map to U+FFFD with
    unknown="replace" (byte and sentencepiece tokenizers never fail). dynamic: score with
    dynamic evaluation (`zlm.inference.dynamic`) instead of the fixed weights; cache: mix
    the predictions with the continuous cache (`zlm.inference.cache`); either, or both.
    """
    return _text_scores(lm, text, protocol, unknown, dynamic, cache)[0]


def _text_scores(lm, text: str, protocol: EvalProtocol, unknown: str, dynamic: DynamicConfig | None,
                 cache: CacheConfig | None) -> tuple[Score, Score | None]:
    """`evaluate_text`'s score, and the plain one where the same pass gave it (`_predict`)."""
    ids = lm.tokenizer.encode(text, unknown=unknown)  # (N,) int64
    ctx = context_ids(lm.tokenizer)
    n_bytes = len(text.encode("utf-8"))
    if ctx is None:  # no newline in the vocabulary: the first token is the context
        return _token_scores(lm, ids, lm.tokenizer, len(text), n_bytes, protocol, dynamic, cache)
    tokens = np.concatenate([ctx[-1:], ids])  # (N+1,)
    nats, count, plain = _predict(lm, tokens, protocol, dynamic, cache)

    def score(total):
        return Score(nats=float(total), tokens=int(count), characters=len(text), bytes=n_bytes)

    return score(nats), None if plain is None else score(plain)


def _predict(lm, tokens, protocol: EvalProtocol, dynamic: DynamicConfig | None,
             cache: CacheConfig | None) -> tuple[float, int, float | None]:
    """Summed nats and count of the predictions, static, dynamic or cached; and the plain
    summed nats where the same pass gave them (the cache alone), else None."""
    if dynamic is not None:
        return *dynamic_score_predictions(lm.model, tokens, lm.runtime, protocol, dynamic, cache), None
    if cache is not None:
        return cache_score_predictions(lm.model, tokens, lm.runtime, protocol, cache)
    return *evaluate_predictions(lm.model, tokens, lm.runtime, protocol), None


def _token_scores(lm, tokens, tokenizer, characters: int, n_bytes: int, protocol: EvalProtocol,
                  dynamic: DynamicConfig | None, cache: CacheConfig | None) -> tuple[Score, Score | None]:
    """`evaluate_tokens` (the first token is context only), static, dynamic or cached; and the
    plain score where the same pass gave it."""
    nats, count, plain = _predict(lm, tokens, protocol, dynamic, cache)

    def score(total):
        return split_score(total, count, tokens, tokenizer, characters, n_bytes)

    return score(nats), None if plain is None else score(plain)


def open_training_data(lm):
    """The DATA_DIR a checkpoint was trained on, checked to use the checkpoint's tokenizer."""
    path = lm.data_path
    if path is None or not (path / "dataset.json").is_file():
        raise DataError(
            f"the training data {path or '(not recorded)'} named in {lm.path}/config.json is "
            "gone; evaluate a text file instead with --file TEXT")
    data = Dataset.open(path)
    name = data.meta["tokenizer"].get("file", "tokenizer.json")
    ours = lm.path / name
    if not ours.is_file() or ours.read_bytes() != (data.path / name).read_bytes():
        raise DataError(
            f"{path} was re-prepared with a different tokenizer than {lm.path} was trained "
            "with; evaluate a text file instead with --file TEXT")
    return data


def evaluate_split(lm, split: str, protocol: EvalProtocol = EvalProtocol(),
                     dynamic: DynamicConfig | None = None, cache: CacheConfig | None = None) -> Score:
    """Score a split of the training DATA_DIR (its first token is context only); dynamic
    and cache as for `evaluate_text`."""
    return _split_scores(lm, split, protocol, dynamic, cache)[0]


def _split_scores(lm, split: str, protocol: EvalProtocol, dynamic: DynamicConfig | None,
                  cache: CacheConfig | None) -> tuple[Score, Score | None]:
    data = open_training_data(lm)
    info = data.split_info(split)
    return _token_scores(lm, data.tokens(split), data.tokenizer, info.characters, info.bytes,
                         protocol, dynamic, cache)


# ------------------------------------------------------------------------- zlm eval

SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True)
class EvalConfig:
    """What `zlm eval` scores, and how."""

    split: str | None = "valid"  # a split of the training DATA_DIR, or None with `file`
    file: Path | None = None  # a UTF-8 text file scored instead of a split
    streams: int = 16  # parallel streams (--batch-size)
    bptt: int = 256  # window length (--bptt)
    unknown: str = "error"  # error | replace: characters of `file` outside a char vocabulary
    device: str = "auto"
    precision: str = "fp32"  # exact by default; auto/bf16/fp16 autocast the forward pass
    cell: str = "auto"  # auto | fused | reference
    dynamic: DynamicConfig | None = None  # --dynamic: also score with dynamic evaluation
    cache: CacheConfig | None = None  # --cache: also score with the continuous cache
    sample: int = 0  # --eval-tokens: score at most this many predictions, spread over the text (0: all)
    stream_context: int = STREAM_CONTEXT  # --stream-context: tokens read before each later stream

    def __post_init__(self):
        if self.dynamic is not None and self.precision != "fp32":
            raise UsageError("--dynamic runs in fp32; drop --precision")
        if self.dynamic is not None and self.sample:
            raise UsageError("--dynamic adapts to all the text before each segment; drop --eval-tokens")
        if (self.split is None) == (self.file is None):
            raise UsageError("pass one of --split or --file, not both")
        if self.split is not None and self.split not in SPLIT_NAMES:
            raise UsageError(f"--split {self.split} is not a split; use valid, test or train")
        check_unknown(self.unknown)
        EvalProtocol(self.streams, self.bptt, self.sample, self.stream_context)  # checks the four options

    @property
    def protocol(self) -> EvalProtocol:
        return EvalProtocol(self.streams, self.bptt, self.sample, self.stream_context)


@dataclass(frozen=True)
class EvalResult:
    """A score with everything needed to reproduce and read it."""

    score: Score
    protocol: str  # EvalProtocol.describe(...)
    source: str  # "valid split of DATA_DIR" or the file's path
    checkpoint: str
    tokenizer: str  # tokenizer kind
    seconds: float
    split: str | None = None
    file: str | None = None
    static: Score | None = None  # with --dynamic or --cache: the plain score under the same streams
    dynamic: DynamicConfig | None = None
    cache: CacheConfig | None = None

    @property
    def chars_per_s(self) -> float:
        return self.score.characters / max(self.seconds, 1e-9)

    def to_dict(self) -> dict:
        s = self.score
        return {
            "bpc": s.bpc, "bits_per_byte": s.bits_per_byte, "perplexity": s.perplexity,
            "char_perplexity": s.char_perplexity, "nats": s.nats, "tokens": s.tokens,
            "characters": s.characters, "bytes": s.bytes, "chars_per_s": self.chars_per_s,
            "seconds": self.seconds, "protocol": self.protocol, "source": self.source,
            "checkpoint": self.checkpoint, "tokenizer": self.tokenizer, "split": self.split,
            "file": self.file,
            "dynamic": None if self.dynamic is None else self.dynamic.to_dict(),
            "cache": None if self.cache is None else self.cache.to_dict(),
            "static_bpc": None if self.static is None else self.static.bpc,
            "static_bits_per_byte": None if self.static is None else self.static.bits_per_byte,
        }


def read_text_file(path: Path) -> str:
    """A UTF-8 text file, or a one-line error."""
    path = Path(path)
    require_file(path, "--file", "a UTF-8 text file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"--file {path} is not UTF-8 text (byte {e.start}); convert it to "
                        "UTF-8") from None


def evaluate_loaded(lm, config: EvalConfig) -> EvalResult:
    """Score `config`'s split or file with a loaded `LanguageModel`; with --dynamic or
    --cache, also the plain score over the same streams and windows (with --cache alone,
    from the same pass: the cached pass computes every prediction of the model's own)."""
    protocol, dyn, cache = config.protocol, config.dynamic, config.cache
    adapt = dyn is not None or cache is not None
    if dyn is not None:  # static and dynamic scored over the same segments as windows
        protocol = EvalProtocol(config.streams, dyn.segment, stream_context=config.stream_context)
    text = None if config.file is None else read_text_file(config.file)
    t0 = time.perf_counter()
    if text is not None:
        score, static = _text_scores(lm, text, protocol, config.unknown, dyn, cache)
        seconds = time.perf_counter() - t0  # of the reported (dynamic or cached, if asked) score only
        if adapt and static is None:  # over the same streams and windows
            static = evaluate_text(lm, text, protocol, config.unknown)
        source, context = str(config.file), "the text is preceded by one newline as context"
    else:
        score, static = _split_scores(lm, config.split, protocol, dyn, cache)
        seconds = time.perf_counter() - t0
        if adapt and static is None:
            static = evaluate_split(lm, config.split, protocol)
        source = f"{config.split} split of {lm.data_path}"
        context = "the split's first token is context"
    for how in (dyn, cache):
        if how is not None:
            context = f"{context}; {how.describe()}"
    if config.sample:
        context = (f"{context}; --eval-tokens {config.sample:,}: each stream scores the first piece of its "
                   "stretch, spread over the text (the whole text when it has no more)")
    return EvalResult(score, protocol.describe(score.tokens, context), source, str(lm.path),
                      lm.tokenizer.kind, seconds, config.split,
                      None if config.file is None else str(config.file), static, dyn, cache)


def evaluate(path, config: EvalConfig = EvalConfig()) -> EvalResult:
    """`zlm eval`: load a RUN_DIR or checkpoint and score a split or a text file."""

    if config.file is not None:  # before loading the model
        require_file(Path(config.file), "--file", "a UTF-8 text file")
    lm = load_model(path, config.device, config.precision, config.cell)
    return evaluate_loaded(lm, config)

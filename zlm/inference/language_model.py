"""The Python API: `zlm.load(path)` -> a `LanguageModel` with evaluate and sample methods.

    lm = zlm.load("runs/shakespeare")          # RUN_DIR (best/, else latest) or checkpoint
    lm.evaluate_text("To be, or not to be")    # -> zlm.core.metrics.Score (bpc, perplexity, ...)
    lm.evaluate_split("test")                  # the split of the DATA_DIR it was trained on
    lm.evaluate_split("test", cache=True)      # ... with the continuous cache (zlm eval --cache)
    lm.sample(prime="ROMEO:", length=200, temperature=0.8, seed=1)   # -> str

The commands call the same library functions (`zlm.inference.evaluate`, `.sample`).
"""

from __future__ import annotations

from zlm.core.eval_protocol import STREAM_CONTEXT, EvalProtocol
from zlm.core.metrics import Score
from zlm.inference.adapt_config import CacheConfig
from zlm.inference.evaluate import evaluate_split, evaluate_text
from zlm.inference.load import LoadedModel, load_model
from zlm.inference.sample import Sample, SampleConfig, generate, sample_text


class LanguageModel(LoadedModel):
    """A loaded checkpoint (`LoadedModel`) with the methods users call."""

    def evaluate_text(self, text: str, *, streams: int = 1, bptt: int = 256,
                      unknown: str = "error", cache: bool | CacheConfig = False,
                      stream_context: int = STREAM_CONTEXT) -> Score:
        """BPC of `text` (every character predicted; a newline is the context).

        One stream by default: the whole text with its state carried. cache: True or a
        `CacheConfig` scores with the continuous cache (`zlm eval --cache`). stream_context:
        with several streams, the tokens each after the first reads before its stretch.
        """
        return evaluate_text(self, text, EvalProtocol(streams, bptt, stream_context=stream_context),
                             unknown, cache=_cache(cache))

    def evaluate_split(self, split: str = "valid", *, streams: int | None = None,
                       bptt: int = 256, cache: bool | CacheConfig = False,
                       stream_context: int = STREAM_CONTEXT) -> Score:
        """BPC of a split of the training DATA_DIR: 16 streams by default, the protocol
        `zlm train` validates with; with the cache (as for `evaluate_text`) one, as
        `zlm eval --cache` scores. stream_context: as for `evaluate_text`."""
        cache = _cache(cache)
        streams = (1 if cache else 16) if streams is None else streams
        return evaluate_split(self, split, EvalProtocol(streams, bptt, stream_context=stream_context),
                              cache=cache)

    def sample(self, prime: str = "", length: int = 200, *, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None,
               seed: int | None = None) -> str:
        """prime + `length` generated tokens (characters for a char model), as text."""
        return sample_text(self, SampleConfig(length=length, prime=prime, temperature=temperature,
                                              top_k=top_k, top_p=top_p, seed=seed))

    def samples(self, prime: str = "", length: int = 200, num_samples: int = 1, **options):
        """`num_samples` continuations generated as one batch -> list of `Sample`."""
        return generate(self, SampleConfig(length=length, prime=prime, num_samples=num_samples,
                                           **options))


def _cache(cache: bool | CacheConfig) -> CacheConfig | None:
    return cache if isinstance(cache, CacheConfig) else CacheConfig() if cache else None


def load(path, device: str = "auto", precision: str = "fp32", cell: str = "auto") -> LanguageModel:
    """Load a RUN_DIR (its best/, else latest complete checkpoint) or a checkpoint directory.

    precision: fp32 by default, so evaluation is exact; "auto"/"bf16"/"fp16" autocast the
    evaluation forward pass. cell: auto | fused | reference (all give the same numbers).
    """
    return load_model(path, device, precision, cell, cls=LanguageModel)


__all__ = ["LanguageModel", "Sample", "load"]

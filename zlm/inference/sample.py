"""Sampling text from a trained model, one token at a time with the state carried.

Owns `SampleConfig`, token selection (`Chooser`: temperature, top-k, top-p, greedy) and
`generate`, the library function behind `zlm sample` and
`zlm.inference.language_model.LanguageModel.sample`; the step itself is `zlm.inference.stepper`.

The prime (or, without one, a single newline as context) runs through the model once,
as one window, to get the state and the first distribution; the state is copied to the
B = num_samples streams, and from then on each step feeds only the token just drawn —
the prefix is never re-run. Per token the loop makes two calls on the CPU: the draw
(tempered softmax and inverse CDF in one C++ call, written straight into the token buffer;
a few torch ops elsewhere or with top-k/top-p) and the `Stepper` (one C++ call),
which writes the next logits into a ring of CHUNK rows; the likelihood of the drawn
tokens is one log_softmax and one gather per CHUNK tokens. Draws come from a
torch.Generator seeded with `seed`: the same seed gives the same text on the same
machine. Each sample's log-likelihood is that of the model itself (temperature 1, no
truncation).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from zlm.core.metrics import LN2
from zlm.data.tokenizers import check_unknown, context_ids
from zlm.errors import UsageError, ZlmError
from zlm.inference.load import load_model
from zlm.inference.stepper import Stepper

PRIME_WINDOW = 512  # the prime runs through the model in windows of this many tokens
CHUNK = 256  # logits rows kept between likelihood updates
# Streaming reads drawn tokens back every this many steps: on the CPU each token as it is
# drawn; on CUDA a read is a sync that idles the device, so once per chunk of text.
STREAM_EVERY = {"cpu": 1, "cuda": 64}


@dataclass(frozen=True)
class SampleConfig:
    """What to generate."""

    length: int = 500  # tokens to generate after the prime (characters for a char model)
    prime: str = ""  # text to continue; empty: start after a newline
    temperature: float = 1.0  # divides the logits; 0 = greedy (argmax)
    top_k: int | None = None  # keep the k most likely tokens (None or 0: all)
    top_p: float | None = None  # keep the smallest set with probability >= p (None or 1: all)
    seed: int | None = None  # None: a fresh random seed (reported with the samples)
    num_samples: int = 1  # generated together as one batch
    unknown: str = "error"  # error | replace: prime characters outside a char vocabulary
    prime_flag: str = "--prime"  # how the user passed the prime, for error messages

    def __post_init__(self):
        if self.length < 1:
            raise UsageError(f"--length must be >= 1, got {self.length}")
        if not self.temperature >= 0:
            raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise UsageError(f"--top-k must be >= 1 (0 = off), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.num_samples < 1:
            raise UsageError(f"--num-samples must be >= 1, got {self.num_samples}")
        check_unknown(self.unknown)


@dataclass(frozen=True)
class Sample:
    """One generated continuation and how likely the model finds it."""

    prime: str
    text: str  # the continuation only (prime + text is what was printed)
    tokens: int  # generated tokens
    nats: float  # -log p(text | prime) under the model, natural log
    seed: int

    @property
    def log_likelihood_per_token(self) -> float:
        """Average log-likelihood, nats per generated token (<= 0)."""
        return -self.nats / max(self.tokens, 1)

    @property
    def bits_per_char(self) -> float:
        """Negative log-likelihood in bits per generated character."""
        return self.nats / max(len(self.text), 1) / LN2

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(characters=len(self.text), log_likelihood_nats_per_token=self.log_likelihood_per_token,
                 bits_per_char=self.bits_per_char)
        return d


class Chooser:
    """Turns logits into the next tokens: temperature, top-k, top-p, then a draw.

    A draw is an inverse CDF: token j when cum_{j-1} <= u * total < cum_j, with u uniform
    in [0, 1) from the generator (fp64, drawn CHUNK x B at a time) and the cumulative sums
    in fp64 - on the CPU one C++ call (`draw` in zlm/model/cells/csrc/decoder.cpp) that also does the
    softmax, elsewhere a few torch ops. The same seed gives the same tokens.
    """

    def __init__(self, cfg: SampleConfig, vocab: int, generator: torch.Generator, batch: int = 1,
                 ext=None):
        self.greedy = cfg.temperature == 0
        self.inv_t = 1.0 / cfg.temperature if cfg.temperature > 0 else 1.0
        self.top_k = cfg.top_k if cfg.top_k and cfg.top_k < vocab else None
        self.top_p = cfg.top_p if cfg.top_p is not None and cfg.top_p < 1 else None
        self.gen = generator
        self.ext = ext if ext is not None and hasattr(ext, "draw") and generator.device.type == "cpu" else None
        self.u = torch.empty(CHUNK, batch, dtype=torch.float64, device=generator.device)  # (CHUNK, B)
        self.k = CHUNK  # next row of self.u to use

    def uniforms(self) -> Tensor:
        """(B,) fp64 uniforms in [0, 1), a fresh row per call."""
        if self.k == self.u.shape[0]:
            torch.rand(self.u.shape, generator=self.gen, dtype=torch.float64, device=self.u.device, out=self.u)
            self.k = 0
        self.k += 1
        return self.u[self.k - 1]

    def __call__(self, logits: Tensor, out: Tensor | None = None) -> Tensor:
        """logits (B, V) (left unchanged) -> tokens (B, 1) int64 (into `out` if given)."""
        if self.greedy:
            return torch.argmax(logits, -1, keepdim=True, out=out)
        out = torch.empty(logits.shape[0], 1, dtype=torch.long, device=logits.device) if out is None else out
        u = self.uniforms()
        if self.top_k is None and self.top_p is None:
            if self.ext is not None and logits.dtype == torch.float32 and logits.is_contiguous():
                self.ext.draw(logits, u, self.inv_t, True, out)
                return out
            weights = ((logits.double() - logits.max(-1, keepdim=True).values) * self.inv_t).exp()
            return _inverse_cdf(weights, u, out)
        z = logits * self.inv_t  # (B, V)
        if self.top_k is not None:
            kth = z.topk(self.top_k, -1).values[:, -1:]  # (B, 1)
            z.masked_fill_(z < kth, -torch.inf)
        probs = torch.softmax(z, -1)  # (B, V)
        if self.top_p is not None:
            sorted_p, order = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > self.top_p  # the first is always kept
            probs = probs.scatter(-1, order, sorted_p.masked_fill_(drop, 0.0))
        if self.ext is not None and probs.dtype == torch.float32:
            self.ext.draw(probs.contiguous(), u, 1.0, False, out)
            return out
        return _inverse_cdf(probs.double(), u, out)


def _inverse_cdf(weights: Tensor, u: Tensor, out: Tensor) -> Tensor:
    """The torch form of the C++ draw: weights (B, V) >= 0 fp64, u (B,) -> out (B, 1)."""
    cdf = weights.cumsum(-1)  # (B, V)
    below = (cdf <= u[:, None] * cdf[:, -1:]).sum(-1, keepdim=True)  # tokens wholly below the target
    last = (weights > 0).cumsum(-1).argmax(-1, keepdim=True)  # the last token with weight
    return torch.minimum(below, last, out=out)


def encode_prime(lm, prime: str, unknown: str = "error", flag: str = "--prime") -> Tensor:
    """The prime's ids (P,), or the newline context (or id 0) when it is empty.

    unknown="replace" maps characters outside a char vocabulary to its U+FFFD entry; a
    vocabulary without one, or unknown="error", makes them a one-line UsageError naming
    the first one (`flag` says where the prime came from).
    """
    if not prime:
        ctx = context_ids(lm.tokenizer)
        return torch.from_numpy(ctx[-1:]) if ctx is not None else torch.zeros(1, dtype=torch.long)
    try:
        ids = lm.tokenizer.encode(prime, unknown=unknown)
    except ZlmError as e:
        reason = str(e).split(";")[0]
        has_replacement = _encodes(lm.tokenizer, "\ufffd")
        if unknown == "replace":
            fix = "prepare the data with --unknown replace to have one"
        elif has_replacement:
            fix = "remove or replace it in the prime, or pass --unknown replace"
        else:  # --unknown replace would fail too: this vocabulary has no U+FFFD
            fix = "remove or replace it in the prime"
        raise UsageError(f"{flag}: {reason}; {fix}") from None
    return torch.from_numpy(ids)


def _encodes(tokenizer, text: str) -> bool:
    try:
        tokenizer.encode(text, unknown="error")
    except ZlmError:
        return False
    return True


@torch.no_grad()  # not inference_mode: the fused cell reuses workspaces across calls
def generate(lm, cfg: SampleConfig, on_text: Callable[[str], None] | None = None,
             kernel: str = "auto") -> list[Sample]:
    """Generate cfg.num_samples continuations of cfg.prime as one batch.

    lm: a `zlm.inference.load.LoadedModel`. on_text: with one sample, called with the prime
    and then with each piece of text as soon as its token is drawn (streaming); with
    several it is not called (the samples are returned when all are done). kernel: the
    `Stepper`'s (benchmarks; "auto" is the fastest available).
    """
    model, tok = lm.model, lm.tokenizer
    model.eval()
    B, n, dev = cfg.num_samples, cfg.length, lm.runtime.device
    seed = cfg.seed if cfg.seed is not None else secrets.randbits(31)
    gen = torch.Generator(device=dev).manual_seed(seed)
    prime_ids = encode_prime(lm, cfg.prime, cfg.unknown, cfg.prime_flag).to(dev)[:, None]  # (P, 1)
    state = None
    for s in range(0, prime_ids.shape[0], PRIME_WINDOW):  # the prime, once
        logits, state = model(prime_ids[s : s + PRIME_WINDOW], state)
    step = Stepper(model, B, lp=lm.runtime.precision == "bf16" and dev.type == "cpu", kernel=kernel)
    step.set_state(*state)
    choose = Chooser(cfg, model.config.vocab_size, gen, B, step.ext)
    dt = model.decoder.weight.dtype
    ring = torch.empty(min(n, CHUNK), B, model.config.vocab_size, device=dev, dtype=dt)  # (C, B, V) logits
    ring[0].copy_(logits[-1].float().expand(B, -1))  # the first distribution
    ids = torch.empty(n, B, 1, dtype=torch.long, device=dev)  # (n, B, 1) generated tokens
    logp = torch.empty(n, B, 1, device=dev, dtype=dt)  # (n, B, 1) log p of each drawn token (temperature 1)
    stream = on_text if B == 1 else None
    decoder = tok.stream_decoder() if stream else None
    if stream and cfg.prime:
        stream(cfg.prime)
    C, every, shown = ring.shape[0], STREAM_EVERY.get(dev.type, 1), 0
    for t in range(n):
        r = t % C
        choose(ring[r], out=ids[t])  # (B, 1)
        if stream and ((t + 1) % every == 0 or t == n - 1):
            piece = "".join(decoder.feed(i) for i in ids[shown : t + 1, 0, 0].tolist())  # one read
            shown = t + 1
            if piece:
                stream(piece)
        if r == C - 1 or t == n - 1:  # log p before any truncation or temperature
            torch.gather(torch.log_softmax(ring[: r + 1], -1), 2, ids[t - r : t + 1], out=logp[t - r : t + 1])
        if t + 1 < n:
            step(ids[t].view(B), out=ring[(t + 1) % C])
    if stream:
        tail = decoder.flush()
        if tail:
            stream(tail)
    cols = ids.squeeze(2).t().cpu().tolist()  # B lists of n ids
    nats = -logp.squeeze(2).double().sum(0)  # (B,) -log p, summed in fp64
    out = []
    for b in range(B):
        d = tok.stream_decoder()
        text = "".join(d.feed(i) for i in cols[b]) + d.flush()
        out.append(Sample(cfg.prime, text, n, float(nats[b]), seed))
    return out


def sample_checkpoint(path, cfg: SampleConfig, device: str = "auto",
                      on_text: Callable[[str], None] | None = None, precision: str = "auto") -> list[Sample]:
    """`zlm sample`: load a RUN_DIR or checkpoint and `generate`.

    precision: "auto" (bf16 weights in the step on CPUs with native bf16, see
    `zlm.core.precision.resolve_precision`), "fp32" or "bf16".
    """
    return generate(load_model(path, device, precision), cfg, on_text)


def sample_text(lm, cfg: SampleConfig) -> str:
    """The prime followed by the first sample's continuation."""
    return cfg.prime + generate(lm, cfg)[0].text

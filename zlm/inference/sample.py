"""Sampling text from a trained model, one token at a time with the state carried.

Owns `SampleConfig`, the lean single-step path (`Stepper`), token selection
(temperature, top-k, top-p, greedy) and `generate`, the library function behind
`zlm sample` and `zlm.inference.api.LanguageModel.sample`.

The prime (or, without one, a single newline as context) runs through the model once,
as one window, to get the state and the first distribution; the state is copied to the
B = num_samples streams, and from then on each step feeds only the token just drawn —
the prefix is never re-run. The step is the model's own arithmetic (eval mode: zoneout
uses its expectation, dropout is off) laid out for T = 1:

    layer 0   gates = table[tok] + h W_hh^T          table = E W_ih^T + b, (V, 4H), once
    layer k   gates = b + x W_ih^T + h W_hh^T        (B, 4H), gate rows i, f, o, g
    all       i, f, o = sigmoid, g = tanh;  c~ = f c + i g;  h~ = o tanh(c~)
              c = z_c c + (1 - z_c) c~;  h = z_h h + (1 - z_h) h~
    decoder   logits = h W_d^T + b_d                 (B, V)

into buffers allocated once, so a step allocates almost nothing: on the CPU three calls
per layer with the compiled C++ step (bf16 weights when bf16 is chosen), else ~20 small
kernel calls (tests/test_sample.py and tests/inference/ check it against the model's
forward). The likelihood of each drawn token is one log_softmax and one gather. Draws come
from a torch.Generator seeded with `seed`: the same seed gives the same text on the same
machine. Each sample's log-likelihood is that of the model itself (temperature 1, no
truncation), accumulated as it is drawn.
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
from zlm.model.cells.cpu_ext import load_extension
from zlm.model.lm import ZoneoutLM

PRIME_WINDOW = 512  # the prime runs through the model in windows of this many tokens


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


class Stepper:
    """The model's eval-mode step for T = 1 and B streams, into preallocated buffers.

    On the CPU with the compiled step (`zlm.model.cells.cpu_ext`) a layer is three calls:
    the input part (a table row or one multiply), the recurrent multiply, and the C++ step
    that does every element-wise op and updates h, c in place. lp=True (bf16 chosen on
    the CPU): the recurrent and inter-layer multiplies read bf16 weights and a bf16 copy
    of h (fp32 accumulation); h, c, the gates and the decoder stay fp32. Without the
    compiled step, the same arithmetic runs as ~20 small torch ops (gates i, f, o, g).
    """

    def __init__(self, model: ZoneoutLM, batch: int, lp: bool = False):
        cfg = model.config
        H, B = cfg.hidden, batch
        dev, dt = model.decoder.weight.device, model.decoder.weight.dtype
        self.ext = load_extension() if dev.type == "cpu" and dt in (torch.float32, torch.float64) else None
        self.lp = lp and self.ext is not None and dt == torch.float32
        wd = torch.bfloat16 if self.lp else dt
        self.load_weights(model)
        self.keep_c = [layer.zoneout_cell for layer in model.layers]
        self.keep_h = [layer.zoneout_hidden for layer in model.layers]
        self.h = torch.zeros(cfg.layers, B, H, device=dev, dtype=dt)  # (L, B, H)
        self.c = torch.zeros_like(self.h)
        self.h_lp = self.h.to(torch.bfloat16) if self.lp else None  # (L, B, H) bf16 copy of h
        self.rec = torch.empty(B, 4 * H, device=dev, dtype=wd)  # (B, 4H) recurrent part (lp)
        self.logits = torch.empty(B, cfg.vocab_size, device=dev, dtype=dt)  # (B, V)
        self.gates = [torch.empty(B, 4 * H, device=dev, dtype=dt) for _ in model.layers]
        self.c_new, self.tanh_c, self.h_new = (torch.empty(B, H, device=dev, dtype=dt) for _ in range(3))
        # Views fixed once: sigmoid over i, f, o (B, 3H), tanh over g (B, H).
        self.views = [(g[:, : 3 * H], g[:, 3 * H :], g[:, :H], g[:, H : 2 * H], g[:, 2 * H : 3 * H],
                       g[:, 3 * H :]) for g in self.gates]

    @torch.no_grad()
    def load_weights(self, model: ZoneoutLM) -> None:
        """(Re)derive the step's weight layouts from `model` (after its weights changed)."""
        H, dev = model.config.hidden, model.decoder.weight.device
        wd = torch.bfloat16 if self.lp else model.decoder.weight.dtype
        if self.ext is None:  # i, f, g, o -> i, f, o, g: one sigmoid over (B, 3H)
            perm = torch.cat([torch.arange(0, 2 * H), torch.arange(3 * H, 4 * H),
                              torch.arange(2 * H, 3 * H)]).to(dev)
        else:
            perm = torch.arange(4 * H, device=dev)
        first = model.layers[0]
        emb = model.embedding.weight  # (V, E)
        self.table = torch.addmm(first.bias, emb, first.weight_ih.t())[:, perm].contiguous()
        self.w_hh = [layer.weight_hh[perm].t().to(wd).contiguous() for layer in model.layers]  # (H, 4H)
        self.w_ih = [layer.weight_ih[perm].t().to(wd).contiguous() for layer in model.layers]  # (I, 4H)
        self.bias = [layer.bias[perm].to(wd).contiguous() for layer in model.layers]  # (4H,)
        self.dec_w = model.decoder.weight.t().contiguous()  # (H, V)
        self.dec_b = model.decoder.bias.detach().clone()  # (V,)

    def set_state(self, h: Tensor, c: Tensor) -> None:
        """h, c: (L, 1 or B, H), broadcast over the B streams."""
        self.h.copy_(h.expand_as(self.h))
        self.c.copy_(c.expand_as(self.c))
        if self.lp:
            self.h_lp.copy_(self.h)

    def __call__(self, tok: Tensor) -> Tensor:
        """tok: (B,) int64 -> logits (B, V), a buffer overwritten by the next call."""
        x = self._layers_compiled(tok) if self.ext is not None else self._layers_torch(tok)
        return torch.addmm(self.dec_b, x, self.dec_w, out=self.logits)

    def _layers_compiled(self, tok: Tensor) -> Tensor:
        for k, g in enumerate(self.gates):
            h, c = self.h[k], self.c[k]  # (B, H), updated in place by the C++ step
            if k == 0:
                torch.index_select(self.table, 0, tok, out=g)  # (B, 4H) = E[tok] W_ih^T + b
            elif self.lp:
                g.copy_(torch.addmm(self.bias[k], self.h_lp[k - 1], self.w_ih[k]))
            else:
                torch.addmm(self.bias[k], self.h[k - 1], self.w_ih[k], out=g)
            if self.lp:
                rec = torch.mm(self.h_lp[k], self.w_hh[k], out=self.rec)  # (B, 4H) bf16
                h_lp = self.h_lp[k]
            else:
                rec, h_lp = None, None
                g.addmm_(h, self.w_hh[k])
            self.ext.forward_step(g, rec, g, c, h, None, self.keep_c[k], None, self.keep_h[k],
                                  c, self.tanh_c, h, h_lp)
        return self.h[-1]

    def _layers_torch(self, tok: Tensor) -> Tensor:
        x = None
        for k, g in enumerate(self.gates):
            h, c = self.h[k], self.c[k]  # (B, H)
            sig, tnh, i, f, o, gg = self.views[k]
            if k == 0:
                torch.index_select(self.table, 0, tok, out=g)  # (B, 4H)
            else:
                torch.addmm(self.bias[k], x, self.w_ih[k], out=g)
            g.addmm_(h, self.w_hh[k])
            sig.sigmoid_()
            tnh.tanh_()
            torch.mul(f, c, out=self.c_new)
            self.c_new.addcmul_(i, gg)  # c~ = f c + i g
            torch.tanh(self.c_new, out=self.tanh_c)
            torch.mul(o, self.tanh_c, out=self.h_new)  # h~ = o tanh(c~)
            _zone(c, self.c_new, self.keep_c[k])
            _zone(h, self.h_new, self.keep_h[k])
            x = h
        return x


def _zone(state: Tensor, new: Tensor, keep: float) -> None:
    """state = keep * state + (1 - keep) * new, in place (eval-mode zoneout)."""
    if keep == 0.0:
        state.copy_(new)
    else:
        state.lerp_(new, 1.0 - keep)


class Chooser:
    """Turns logits into the next tokens: temperature, top-k, top-p, then a draw."""

    def __init__(self, cfg: SampleConfig, vocab: int, generator: torch.Generator):
        self.greedy = cfg.temperature == 0
        self.inv_t = 1.0 / cfg.temperature if cfg.temperature > 0 else 1.0
        self.top_k = cfg.top_k if cfg.top_k and cfg.top_k < vocab else None
        self.top_p = cfg.top_p if cfg.top_p is not None and cfg.top_p < 1 else None
        self.gen = generator

    def __call__(self, logits: Tensor) -> Tensor:
        """logits (B, V) (left unchanged) -> tokens (B, 1) int64."""
        if self.greedy:
            return logits.argmax(-1, keepdim=True)
        z = logits * self.inv_t  # (B, V)
        if self.top_k is not None:
            kth = z.topk(self.top_k, -1).values[:, -1:]  # (B, 1)
            z.masked_fill_(z < kth, -torch.inf)
        probs = torch.softmax(z, -1)  # (B, V)
        if self.top_p is not None:
            sorted_p, order = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > self.top_p  # the first is always kept
            probs = probs.scatter(-1, order, sorted_p.masked_fill_(drop, 0.0))
        return torch.multinomial(probs, 1, generator=self.gen)


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
def generate(lm, cfg: SampleConfig, on_text: Callable[[str], None] | None = None) -> list[Sample]:
    """Generate cfg.num_samples continuations of cfg.prime as one batch.

    lm: a `zlm.inference.load.LoadedModel`. on_text: with one sample, called with the prime
    and then with each piece of text as soon as its token is drawn (streaming); with
    several it is not called (the samples are returned when all are done).
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
    step = Stepper(model, B, lp=lm.runtime.precision == "bf16" and dev.type == "cpu")
    step.set_state(*state)
    choose = Chooser(cfg, model.config.vocab_size, gen)
    logits = logits[-1].float().expand(B, -1)  # (B, V) the first distribution
    ids = torch.empty(n, B, dtype=torch.long, device=dev)  # (n, B) generated tokens
    logp = torch.empty(n, B, 1, device=dev)  # (n, B, 1) log p of each drawn token (temperature 1)
    stream = on_text if B == 1 else None
    decoder = tok.stream_decoder() if stream else None
    if stream and cfg.prime:
        stream(cfg.prime)
    for t in range(n):
        nxt = choose(logits)  # (B, 1)
        # log p before any truncation or temperature: the model's own likelihood
        torch.gather(torch.log_softmax(logits, -1), 1, nxt, out=logp[t])
        ids[t] = nxt.squeeze(1)
        if stream:
            piece = decoder.feed(int(nxt))
            if piece:
                stream(piece)
        if t + 1 < n:
            logits = step(ids[t])
    if stream:
        tail = decoder.flush()
        if tail:
            stream(tail)
    cols = ids.t().cpu().tolist()  # B lists of n ids
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

"""The zoneout LSTM language model: embedding -> L zoneout LSTM layers -> decoder.

The model is pure: it knows nothing of DDP, autocast or compilation, which are applied
from outside (`zlm.training.distributed`, `zlm.core.precision`). The cell implementation is swappable
(`zlm.model.cells.choose_cell`) and every implementation uses the same parameters, so a
checkpoint loads under any of them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from zlm.errors import UsageError
from zlm.model.cells import CellFn
from zlm.model.cells.decoder_tiles import step_weights, stepped_features
from zlm.model.cells.masks import draw_keep
from zlm.model.cells.reference import zoneout_lstm_reference
from zlm.model.config import ModelConfig

State = tuple[Tensor, Tensor]  # h, c: each (L, B, H)


class ZoneoutLSTMLayer(nn.Module):
    """One zoneout LSTM layer; parameters laid out as torch.nn.LSTM's (gates i, f, g, o)."""

    def __init__(self, input_size: int, hidden: int, zoneout_cell: float, zoneout_hidden: float,
                 init: bool = True):
        super().__init__()
        self.hidden = hidden
        self.zoneout_cell = zoneout_cell
        self.zoneout_hidden = zoneout_hidden
        self.weight_ih = nn.Parameter(torch.empty(4 * hidden, input_size))
        self.weight_hh = nn.Parameter(torch.empty(4 * hidden, hidden))
        self.bias = nn.Parameter(torch.empty(4 * hidden))
        if init:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform input weights, orthogonal recurrent blocks, forget-gate bias +1."""
        H = self.hidden
        bound = 1.0 / math.sqrt(H)
        nn.init.uniform_(self.weight_ih, -bound, bound)
        with torch.no_grad():
            for k in range(4):  # one orthogonal (H, H) block per gate
                nn.init.orthogonal_(self.weight_hh[k * H : (k + 1) * H])
            self.bias.zero_()
            self.bias[H : 2 * H] = 1.0

    def forward(self, x: Tensor, h0: Tensor, c0: Tensor, cell: CellFn) -> tuple[Tensor, Tensor, Tensor]:
        """x: (T, B, I) -> y: (T, B, H), h_T, c_T: (B, H). Masks are drawn here, once."""
        T, B, _ = x.shape
        shape = (T, B, self.hidden)
        kw = dict(dtype=x.dtype, device=x.device)
        keep_c = draw_keep(self.zoneout_cell, shape, self.training, **kw)
        keep_h = draw_keep(self.zoneout_hidden, shape, self.training, **kw)
        return cell(x, h0, c0, self.weight_ih, self.weight_hh, self.bias, keep_c, keep_h)


class ZoneoutLM(nn.Module):
    """Character language model. tokens (T, B) -> logits (T, B, V)."""

    # In eval mode without gradients, a few streams on the CPU step through the C++ Decoder
    # (`zlm.model.cells.decoder_tiles`); False keeps every window on `cell`.
    stepped = True

    def __init__(self, config: ModelConfig, cell: CellFn = zoneout_lstm_reference, init: bool = True):
        """init=False leaves the LSTM weights uninitialised, for weights loaded next: the
        orthogonal initialiser's QR grows as H^3 (on 2 CPU cores 0.04 s at H 512, 0.15 s at
        H 1000, 1.3 s at H 2048), time `zlm sample` and `zlm eval` need not spend."""
        super().__init__()
        if config.vocab_size < 1:
            raise UsageError(f"vocab_size must be >= 1, got {config.vocab_size}")
        self.config = config
        self.cell = cell
        c = config
        self.embedding = nn.Embedding(c.vocab_size, c.embed)
        self.layers = nn.ModuleList(
            ZoneoutLSTMLayer(c.embed if k == 0 else c.hidden, c.hidden, c.zoneout_cell, c.zoneout_hidden, init)
            for k in range(c.layers)
        )
        self.drop = nn.Dropout(c.dropout)
        self.decoder = nn.Linear(c.hidden, c.vocab_size)
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)

    def initial_state(self, batch: int, device=None, dtype=torch.float32) -> State:
        """Zero state: h, c each (L, B, H)."""
        shape = (self.config.layers, batch, self.config.hidden)
        z = torch.zeros(shape, device=device, dtype=dtype)
        return z, z.clone()

    def forward(self, tokens: Tensor, state: State | None = None) -> tuple[Tensor, State]:
        """tokens: (T, B) int64 -> logits (T, B, V), final state (h, c) each (L, B, H)."""
        x, state = self.features(tokens, state)
        return self.decoder(x), state

    def features(self, tokens: Tensor, state: State | None = None) -> tuple[Tensor, State]:
        """tokens: (T, B) int64 -> what the decoder reads (T, B, H), final state (h, c) each
        (L, B, H). Scoring applies the decoder itself, in blocks (`zlm.core.eval_protocol`)."""
        T, B = tokens.shape
        if state is None:
            state = self.initial_state(B, tokens.device, self.embedding.weight.dtype)
        weights = step_weights(self, tokens) if self.stepped else None
        if weights is not None:  # eval mode, a few streams: the C++ Decoder
            return stepped_features(self, tokens, state, weights)
        x = self.drop(self.embedding(tokens))  # (T, B, E)
        hs, cs = [], []
        for k, layer in enumerate(self.layers):
            x, h, c = layer(x, state[0][k], state[1][k], self.cell)  # (T, B, H)
            x = self.drop(x)
            hs.append(h)
            cs.append(c)
        return x, (torch.stack(hs), torch.stack(cs))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def token_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """Summed negative log-likelihood in nats, computed in fp32. logits (T, B, V), targets (T, B)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


FUSED_NLL_MIN_VOCAB = 512  # from this vocabulary up a CPU training step takes the fused loss
SOFTMAX_ROWS_BLOCK = 1 << 18  # logits per block of rows in the fused loss's fp32 passes (1 MB)


class _FusedSoftmaxNLL(torch.autograd.Function):
    """Summed NLL of (N, V) logits (any float dtype) in fp32, with a backward that writes the
    gradient, softmax - onehot, over the logits' own memory: the fp32 work runs over blocks
    of rows while they are in cache, and no (N, V) fp32 log-probabilities or zero-filled
    gradient is ever made (what F.cross_entropy's forward and backward write). Equal to
    `token_nll` up to float rounding: tests/model/test_lm.py. It backpropagates once; the
    logits are left holding their gradient."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor) -> Tensor:
        N, V = logits.shape
        per = max(1, SOFTMAX_ROWS_BLOCK // V)
        lse = torch.empty(N, dtype=torch.float32, device=logits.device)
        for i in range(0, N, per):
            lse[i:i + per] = torch.logsumexp(logits[i:i + per].float(), 1)
        target_logit = logits.gather(1, targets[:, None]).squeeze(1).float()
        ctx.save_for_backward(logits, lse, targets)
        ctx.per, ctx.spent = per, False
        return (lse - target_logit).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        if ctx.spent:
            raise RuntimeError("the fused training loss backpropagates once (its logits now hold their "
                               "gradient); use zlm.model.lm.token_nll to backpropagate twice")
        ctx.spent = True
        logits, lse, targets = ctx.saved_tensors
        N, per = logits.shape[0], ctx.per  # the forward's blocks of rows
        rows = torch.arange(min(per, N), device=logits.device)
        for i in range(0, N, per):
            block = logits[i:i + per]
            p = block.float().sub_(lse[i:i + per, None]).exp_()  # softmax
            p[rows[:p.shape[0]], targets[i:i + per]] -= 1.0
            block.copy_(p.mul_(grad))
        return logits, None


def training_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """`token_nll` for a training step (backpropagated once). On a CPU with a vocabulary of
    FUSED_NLL_MIN_VOCAB or more, the fused loss (`_FusedSoftmaxNLL`), which makes the whole
    step faster there and more so the larger the vocabulary; below it, where F.cross_entropy
    is as fast or faster, and on CUDA, `token_nll` (docs/speed.md, "Training with a large
    vocabulary")."""
    fused = (logits.device.type == "cpu" and logits.shape[-1] >= FUSED_NLL_MIN_VOCAB
             and torch.is_grad_enabled() and logits.requires_grad)
    if not fused:
        return token_nll(logits, targets)
    return _FusedSoftmaxNLL.apply(logits.flatten(0, 1), targets.flatten())


NLL_BLOCK = 1 << 21  # logits `blocked_nll` scores at once on a CPU (8 MB in fp32)


def blocked_nll(decoder: nn.Linear, x: Tensor, targets: Tensor, block: int | None = NLL_BLOCK) -> Tensor:
    """token_nll(decoder(x), targets) over blocks of rows of at most `block` logits, so a
    large vocabulary's (T*B, V) logits never exist whole and each block is read back while
    in cache (None, or a small vocabulary: the whole window at once). x (T, B, H), targets
    (T, B) -> summed NLL in nats (fp32)."""
    rows = x.shape[0] * x.shape[1]
    per = rows if block is None else max(1, block // decoder.out_features)
    if per >= rows:
        return token_nll(decoder(x), targets)
    flat, tgt = x.flatten(0, 1), targets.flatten()  # (T*B, H), (T*B,)
    return sum(F.cross_entropy(decoder(flat[i:i + per]).float(), tgt[i:i + per], reduction="sum")
               for i in range(0, rows, per))

"""The plain LSTM cell: zlm's parameters run through torch's own LSTM kernel.

With zoneout off for both states (z_c = z_h = 0) a zoneout LSTM is a plain LSTM, and
the vendor kernel is the fastest way to run one: oneDNN on a CPU, cuDNN on CUDA, under
autocast as the user's precision asks. Same signature, same parameters and the same
checkpoint as every zlm cell; torch.nn.LSTM's two biases are zlm's one bias split as
b_ih = bias, b_hh = 0 (their sum is what the gates see). Gate order i, f, g, o is
torch's own, which is why zlm's layout matches nn.LSTM's. On a CPU without native bf16,
where oneDNN has no bf16 LSTM, a bf16 run's layer computes in fp32.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from zlm.model.cells import packed_gemm
from zlm.model.cells.compiled import compute_lp
from zlm.model.cells.masks import Keep


def zoneout_off(keep_c: Keep, keep_h: Keep) -> bool:
    """True when both keeps say "never keep": the masks a z = 0 layer draws."""
    return isinstance(keep_c, float) and isinstance(keep_h, float) and keep_c == 0.0 and keep_h == 0.0


def lstm_plain(x: Tensor, h0: Tensor, c0: Tensor, weight_ih: Tensor, weight_hh: Tensor, bias: Tensor,
               keep_c: Keep, keep_h: Keep) -> tuple[Tensor, Tensor, Tensor]:
    """x: (T, B, I), h0/c0: (B, H), weight_ih (4H, I), weight_hh (4H, H), bias (4H,) ->
    y (T, B, H), h_T, c_T (B, H). Only for z_c = z_h = 0 (ValueError otherwise)."""
    if not zoneout_off(keep_c, keep_h):
        raise ValueError("the plain LSTM cell runs without zoneout only (z_c = z_h = 0)")
    no_bias = torch.zeros_like(bias)  # (4H,): b_hh; zlm's single bias is b_ih
    # train: cuDNN keeps what its backward needs only in training mode (and refuses a
    # backward otherwise); with no dropout the forward is the same either way.
    train = torch.is_grad_enabled() and any(t.requires_grad for t in (x, h0, c0, weight_ih, weight_hh, bias))
    with torch.autocast("cpu", enabled=False) if _no_bf16_lstm(x) else contextlib.nullcontext():
        y, h, c = torch.lstm(x, (h0[None], c0[None]), [weight_ih, weight_hh, bias, no_bias],
                             True, 1, 0.0, train, False, False)  # biases, layers, dropout, train, bidir, batch_first
    return y, h[0], c[0]


def _no_bf16_lstm(x: Tensor) -> bool:
    """Whether bf16 autocast is on for a CPU tensor where oneDNN has no bf16 LSTM (a CPU
    without native bf16, where torch's LSTM under bf16 autocast fails to build its
    primitive): the layer then runs in fp32, the rest of the model under autocast as asked."""
    return compute_lp(x) and not packed_gemm.ONEDNN_BF16

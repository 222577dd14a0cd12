"""The reference zoneout LSTM cell: readable PyTorch, autograd does the backward.

Every fast cell in `zlm.model.cells` has this exact signature and must match this function
(forward and gradients) under the same pre-drawn masks; the parity tests say how closely.

Equations (Krueger et al. 2016, section 3.2), gate order i, f, g, o
as in torch.nn.LSTM:

    gates = x_t W_ih^T + h_prev W_hh^T + b              (B, 4H)
    i, f, o = sigmoid(.), g = tanh(.)
    c~ = f * c_prev + i * g
    h~ = o * tanh(c~)                                  (tanh of the new, not-zoned cell)
    c  = d_c * c_prev + (1 - d_c) * c~
    h  = d_h * h_prev + (1 - d_h) * h~

In training d_c, d_h are Bernoulli(z) masks drawn per unit, per timestep, per example
(`zlm.model.cells.masks`); in evaluation they are the constants z_c, z_h (the expectation).
"""

from __future__ import annotations

import torch
from torch import Tensor

from zlm.model.cells.masks import Keep, keep_at


def zoneout_lstm_reference(
    x: Tensor,
    h0: Tensor,
    c0: Tensor,
    weight_ih: Tensor,
    weight_hh: Tensor,
    bias: Tensor,
    keep_c: Keep,
    keep_h: Keep,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run one zoneout LSTM layer over a window.

    Args:
        x: (T, B, I) inputs.
        h0, c0: (B, H) initial hidden and cell state.
        weight_ih: (4H, I), weight_hh: (4H, H), bias: (4H,); gate blocks i, f, g, o.
        keep_c, keep_h: probability of keeping the previous value — a (T, B, H) 0/1
            mask in training, or a float z in evaluation (0.0 turns zoneout off).

    Returns:
        y: (T, B, H) the zoned hidden state at every step (fed to the next layer),
        h_T, c_T: (B, H) the final zoned states.
    """
    T, B, _ = x.shape
    H = h0.shape[1]
    # The input projection for all timesteps as one matrix multiply.
    xw = torch.addmm(bias, x.reshape(T * B, -1), weight_ih.t()).view(T, B, 4 * H)
    h, c = h0, c0
    ys = []
    for t, xw_t in enumerate(xw.unbind(0)):  # unbind, not xw[t]: cheaper backward
        gates = xw_t + h @ weight_hh.t()  # (B, 4H)
        i, f, g, o = gates.chunk(4, dim=1)
        i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
        c_new = f * c + i * g  # (B, H)
        h_new = o * c_new.tanh()
        d_c, d_h = keep_at(keep_c, t), keep_at(keep_h, t)
        c = d_c * c + (1 - d_c) * c_new
        h = d_h * h + (1 - d_h) * h_new
        ys.append(h)
    return torch.stack(ys), h, c

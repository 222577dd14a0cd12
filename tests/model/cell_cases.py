"""Inputs and a loss shared by the cell parity tests (a helper module, not a test).

Every fast cell is compared with the reference cell on the same leaf inputs, the same
keeps and the same loss, so these live in one place.
"""

from __future__ import annotations

import torch

NAMES = ["y", "h_T", "c_T", "dx", "dh0", "dc0", "dW_ih", "dW_hh", "db"]  # what cell_outputs returns


def cell_inputs(T, B, I, H, dtype, masks, seed=0):
    """Leaf inputs (x, h0, c0, w_ih, w_hh, b) and keeps: "train" masks, "eval" floats or "off"."""
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=dtype) * scale).requires_grad_()

    w = 0.3 * min(1.0, (32 / H) ** 0.5)  # pre-activations O(1) at any H
    args = [leaf(T, B, I), leaf(B, H), leaf(B, H), leaf(4 * H, I, scale=0.3),
            leaf(4 * H, H, scale=w), leaf(4 * H, scale=0.1)]  # fmt: skip
    if masks == "train":
        keeps = [(torch.rand(T, B, H, generator=g) < z).to(dtype) for z in (0.5, 0.05)]
    elif masks == "eval":
        keeps = [0.5, 0.05]
    else:
        keeps = [0.0, 0.0]
    return args, keeps


def cell_outputs(cell, args, keeps, seed=1):
    """Outputs and the gradients of a loss that uses y, h_T and c_T (in NAMES order)."""
    args = [a.detach().clone().requires_grad_() for a in args]
    y, h, c = cell(*args, *keeps)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
    ((y * w).sum() + h.pow(2).sum() + (1.5 * c).sum()).backward()
    return [y, h, c] + [a.grad for a in args]

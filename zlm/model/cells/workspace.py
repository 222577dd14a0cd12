"""Buffers of the fused CPU cells (Python and compiled), reused across windows, not allocated per window.

Allocating fresh (T, B, 4H) buffers every window makes a training step pay for page
faults on a CPU (how much: docs/kernels.md). A workspace is taken from a small pool per
(kind, shape, dtype, device) and goes back to the pool by itself: it is free again as
soon as nothing but the pool refers to it - the autograd node of a window keeps its
forward workspace until the graph is freed, so a retained graph (gradcheck, or
`backward(retain_graph=True)`) never sees its buffers overwritten by a later window.

Tensors returned to the caller (y, h_T, c_T, gradients) never live in a workspace.
"""

from __future__ import annotations

import sys

import torch

_POOL_CAP = 3  # kept per key: the window in flight, the next one, an evaluation pass
_pool: dict[tuple, list] = {}


class ForwardWorkspace:
    """One window of one layer, forward; `zlm.model.cells.fused` fills it, backward reads it.

    gates: (T, B, 4H) input projection, then the activations i, f, s_g, o per step, where
        s_g = sigmoid(2 g) (tanh(g) = 2 s_g - 1).
    c: (T+1, B, H) zoned cell state; c[0] = c0, c[t+1] after step t.
    sig_c: (T, B, H) sigmoid(2 c~_t) of the new, not-zoned cell (tanh(c~) = 2 sig_c - 1).
    c_tilde, h_tilde: (B, H) per-step scratch; pre: (B, 4H) addmm output.
    """

    def __init__(self, T: int, B: int, H: int, dtype: torch.dtype, device: torch.device):
        kw = dict(dtype=dtype, device=device)
        self.gates = torch.empty(T, B, 4 * H, **kw)
        self.c = torch.empty(T + 1, B, H, **kw)
        self.sig_c = torch.empty(T, B, H, **kw)
        self.c_tilde = torch.empty(B, H, **kw)
        self.h_tilde = torch.empty(B, H, **kw)
        self.pre = torch.empty(B, 4 * H, **kw)


class BackwardWorkspace:
    """One window of one layer, backward (`zlm.model.cells.fused_backward`).

    dgates: (T, B, 4H) local derivative factors per gate, turned in place, step by step,
        into the gradient of the gate pre-activations (i, f, g, o).
    a_c, p, q: (T, B, H) factors of the cell-state recursion (see fused_backward).
    not_c, not_h: (T, B, H) 1 - keep for mask keeps.
    dct, base: (B, H) scratch; dc, dh: two (B, H) each, used in turn.
    """

    def __init__(self, T: int, B: int, H: int, dtype: torch.dtype, device: torch.device):
        kw = dict(dtype=dtype, device=device)
        self.dgates = torch.empty(T, B, 4 * H, **kw)
        self.a_c, self.p, self.q = (torch.empty(T, B, H, **kw) for _ in range(3))
        self.not_c, self.not_h = (torch.empty(T, B, H, **kw) for _ in range(2))
        self.dct, self.base = torch.empty(B, H, **kw), torch.empty(B, H, **kw)
        self.dc = (torch.empty(B, H, **kw), torch.empty(B, H, **kw))
        self.dh = (torch.empty(B, H, **kw), torch.empty(B, H, **kw))


def take_workspace(kind: type, T: int, B: int, H: int, dtype: torch.dtype, device: torch.device):
    """A free workspace of this kind and shape from the pool, or a new one."""
    key = (kind, T, B, H, dtype, device)
    free = _pool.setdefault(key, [])
    for ws in free:
        if sys.getrefcount(ws) <= 3:  # the list, the loop variable, getrefcount's argument
            return ws
    ws = kind(T, B, H, dtype, device)
    if len(free) < _POOL_CAP:
        free.append(ws)
    return ws


def clear_workspaces() -> None:
    """Drop every pooled workspace (tests; freeing memory after a run)."""
    _pool.clear()

"""The hand-written backward through time of the fused CPU zoneout LSTM cell.

Notation (step t, gate order i, f, g, o; d = keep, n = 1 - keep; all (B, H)):

    c~ = f c_prev + i g,  h~ = o tanh(c~),  c = d_c c_prev + n_c c~,  h = d_h h_prev + n_h h~

Given dh, dc (gradients of the zoned h_t, c_t):

    dc~     = n_c dc + dh * A_c                 A_c = n_h o (1 - tanh(c~)^2)
    dpre_i  = dc~ * A_i                         A_i = g i (1 - i)
    dpre_f  = dc~ * A_f                         A_f = c_prev f (1 - f)
    dpre_g  = dc~ * A_g                         A_g = i (1 - g^2)
    dpre_o  = dh  * A_o                         A_o = n_h tanh(c~) o (1 - o)
    dc_prev = dc * P + dh * Q                   P = d_c + n_c f,  Q = A_c f
    dh_prev = d_h dh + dpre W_hh  (+ dy_{t-1}, the gradient arriving from the output)

Every factor A, P, Q depends only on the forward values, so all of them are computed
before the loop as a few large element-wise ops over (T, B, H); the sequential loop then
does one recurrent matrix multiply and seven small element-wise ops per step. The weight
gradients are one matrix multiply each over all timesteps:

    dW_ih = dpre^T x,   dW_hh = dpre^T h_prev,   db = sum dpre,   dx = dpre W_ih
"""

from __future__ import annotations

import torch
from torch import Tensor

from zlm.model.cells.masks import Keep
from zlm.model.cells.packed_gemm import recurrent_gemm
from zlm.model.cells.workspace import BackwardWorkspace, ForwardWorkspace, take_workspace


def _transpose(w: Tensor) -> tuple[Tensor, None]:
    return w.t(), None


def _scale_(t: Tensor, s: Keep) -> None:
    """t *= s for a mask tensor or a float (skipped for 1.0)."""
    if isinstance(s, Tensor) or s != 1.0:
        t.mul_(s)


def _not(keep: Keep, out: Tensor) -> Keep:
    """1 - keep, into `out` for a mask."""
    if isinstance(keep, Tensor):
        return torch.mul(keep, -1, out=out).add_(1)
    return 1.0 - keep


def _factors(ws: ForwardWorkspace, bw: BackwardWorkspace, keep_c: Keep, keep_h: Keep):
    """Fill bw.dgates with A_i, A_f, A_g, A_o and bw.a_c, bw.p, bw.q (all T at once)."""
    T, B, H4 = ws.gates.shape
    H = H4 // 4
    i, f, s_g, o = ws.gates.view(T, B, 4, H).unbind(2)  # (T, B, H) each, strided
    a_i, a_f, a_g, a_o = bw.dgates.view(T, B, 4, H).unbind(2)
    c_prev = ws.c[:-1]  # (T, B, H)
    not_c, not_h = _not(keep_c, bw.not_c), _not(keep_h, bw.not_h)
    tc = torch.mul(ws.sig_c, 2, out=bw.q).sub_(1)  # tanh(c~), in q until q is due
    a_c = torch.mul(tc, tc, out=bw.a_c).neg_().add_(1).mul_(o)  # o (1 - tanh^2)
    _scale_(a_c, not_h)
    torch.mul(o, o, out=a_o)
    torch.sub(o, a_o, out=a_o).mul_(tc)  # tanh(c~) o (1 - o)
    _scale_(a_o, not_h)
    torch.mul(a_c, f, out=bw.q)
    if isinstance(keep_c, Tensor):
        torch.addcmul(keep_c, not_c, f, out=bw.p)
    else:
        torch.mul(f, not_c, out=bw.p).add_(keep_c)
    torch.mul(f, f, out=a_f)
    torch.sub(f, a_f, out=a_f).mul_(c_prev)  # c_prev f (1 - f)
    g = torch.mul(s_g, 2, out=a_g).sub_(1)  # tanh(g), in a_g until a_g is due
    torch.mul(i, i, out=a_i)
    torch.sub(i, a_i, out=a_i).mul_(g)  # g i (1 - i)
    g.square_().neg_().add_(1).mul_(i)  # a_g = i (1 - g^2)
    return not_c


def backward_through_time(
    ws: ForwardWorkspace,
    x: Tensor,
    h0: Tensor,
    weight_ih: Tensor,
    weight_hh: Tensor,
    y: Tensor,
    keep_c: Keep,
    keep_h: Keep,
    dy: Tensor | None,
    dh_T: Tensor | None,
    dc_T: Tensor | None,
    needs: tuple[bool, ...],
) -> tuple[Tensor | None, ...]:
    """Gradients (dx, dh0, dc0, dW_ih, dW_hh, db) of one window; None where not needed.

    x: (T, B, I), h0: (B, H), y: (T, B, H) the forward output; dy (T, B, H), dh_T and
    dc_T (B, H) may be None (that output was unused). `needs` follows the input order.
    """
    T, B, _ = x.shape
    H = h0.shape[1]
    bw = take_workspace(BackwardWorkspace, T, B, H, x.dtype, x.device)
    not_c = _factors(ws, bw, keep_c, keep_h)
    gemm = recurrent_gemm((weight_hh,), B, "T", _transpose)  # dpre (B, 4H) @ W_hh -> (B, H)

    dgates = bw.dgates  # (T, B, 4H): factors, then dpre step by step
    dg_t = dgates.unbind(0)
    dg3_t = dgates[:, :, : 3 * H].view(T, B, 3, H).unbind(0)  # i, f, g blocks: (B, 3, H)
    do_t = dgates[:, :, 3 * H :].unbind(0)  # o block: (B, H)
    ac_t, p_t, q_t = bw.a_c.unbind(0), bw.p.unbind(0), bw.q.unbind(0)
    nc_t = not_c.unbind(0) if isinstance(not_c, Tensor) else None
    kh_t = keep_h.unbind(0) if isinstance(keep_h, Tensor) else None
    dy_t = dy.unbind(0) if dy is not None else None

    dh = torch.zeros_like(h0) if dh_T is None else dh_T
    if dy_t is not None:
        dh = dh + dy_t[T - 1]
    dc = torch.zeros_like(h0) if dc_T is None else dc_T
    for t in range(T - 1, -1, -1):
        # dc~ = n_c dc + dh A_c
        if nc_t is not None:
            dct = torch.mul(dc, nc_t[t], out=bw.dct).addcmul_(dh, ac_t[t])
        elif not_c == 1.0:
            dct = torch.addcmul(dc, dh, ac_t[t], out=bw.dct)
        else:
            dct = torch.mul(dc, not_c, out=bw.dct).addcmul_(dh, ac_t[t])
        dg3_t[t].mul_(dct.unsqueeze(1))  # dpre_i, dpre_f, dpre_g
        do_t[t].mul_(dh)  # dpre_o
        dc_next = torch.mul(dc, p_t[t], out=bw.dc[t % 2]).addcmul_(dh, q_t[t])
        # dh_prev = d_h dh + dy_{t-1} + dpre W_hh
        base = bw.base
        if kh_t is not None:
            if dy_t is not None and t > 0:
                torch.addcmul(dy_t[t - 1], dh, kh_t[t], out=base)
            else:
                torch.mul(dh, kh_t[t], out=base)
        elif dy_t is not None and t > 0:
            base = dy_t[t - 1] if keep_h == 0.0 else torch.add(dy_t[t - 1], dh, alpha=keep_h, out=base)
        else:
            torch.mul(dh, keep_h, out=base)
        dh = gemm.add(dg_t[t], base, out=bw.dh[t % 2])
        dc = dc_next

    dpre = dgates.view(T * B, 4 * H)
    dx = dh0 = dc0 = dw_ih = dw_hh = db = None
    if needs[0]:
        dx = torch.mm(dpre, weight_ih).view(T, B, -1)  # (T, B, I)
    if needs[1]:
        dh0 = dh.clone()
    if needs[2]:
        dc0 = dc.clone()
    if needs[3]:
        dw_ih = torch.mm(dpre.t(), x.reshape(T * B, -1))  # (4H, I)
    if needs[4]:
        dw_hh = torch.mm(dpre[:B].t(), h0)  # (4H, H): h_prev is h0, then y_0 .. y_{T-2}
        if T > 1:
            dw_hh.addmm_(dpre[B:].t(), y[:-1].reshape((T - 1) * B, H))
    if needs[5]:
        db = dpre.sum(0)  # (4H,)
    return dx, dh0, dc0, dw_ih, dw_hh, db

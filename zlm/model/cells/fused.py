"""The fused CPU zoneout LSTM cell: no per-operation autograd, hand-written backward.

Same signature, parameter layout, gate order (i, f, g, o) and pre-drawn masks as
`zlm.model.cells.reference.zoneout_lstm_reference`, and it matches it (forward and every
gradient) to 1e-5 in fp32 and 1e-10 in fp64 (tests/model/test_cells_fused.py).

How it is fast (the layout haste uses, on the CPU):
- forward: the input projection for all timesteps is one matrix multiply into a
  workspace `gates` (T, B, 4H); per step one recurrent multiply with the weight packed
  once for oneDNN (`zlm.model.cells.packed_gemm`), the input projection added inside the same
  call, then in-place element-wise ops into preallocated buffers, nothing recorded;
- backward (`zlm.model.cells.fused_backward`): through time by hand, one recurrent multiply and
  a handful of element-wise ops per step; dW_hh, dW_ih, db and dx are each one matrix
  multiply or reduction over all timesteps;
- workspaces (every buffer except the returned tensors) are reused across windows, so
  steady-state training does not page-fault fresh memory each window;
- under no_grad (evaluation, sampling one character at a time) nothing is saved and no
  autograd node is built.

tanh is computed as 2 sigmoid(2 v) - 1 (the g rows of W_hh are packed doubled): one
contiguous sigmoid over all four gates is several times faster than a strided tanh, and
torch's CPU tanh runs through MKL's vector library, whose per-call thread split for a few
thousand elements costs milliseconds when another process holds a core. The gate buffer
and `sig_c` therefore hold sigmoid(2 g) and sigmoid(2 c~); backward turns them back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zlm.model.cells.fused_backward import backward_through_time
from zlm.model.cells.masks import Keep
from zlm.model.cells.packed_gemm import recurrent_gemm
from zlm.model.cells.workspace import ForwardWorkspace, take_workspace


def _double_g_rows(w: Tensor) -> tuple[Tensor, None]:
    """W_hh with its g block (rows 2H:3H) doubled: the GEMM then yields 2 pre_g."""
    H = w.shape[0] // 4
    w2 = w.clone()
    w2[2 * H : 3 * H] *= 2
    return w2, None


def _stacked(w_ih: Tensor, w_hh: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """[W_ih | W_hh] (4H, I + H) and b: one GEMM per step for [x_t, h_prev]."""
    return torch.cat([w_ih, w_hh], 1), b


def _forward(x, h0, c0, weight_ih, weight_hh, bias, keep_c: Keep, keep_h: Keep, inference: bool):
    """Run the window without autograd. Returns y (T, B, H) (fresh) and the workspace.

    inference: no backward will follow, so packed weights may come from the cache.
    """
    T, B, _ = x.shape
    H = h0.shape[1]
    ws = take_workspace(ForwardWorkspace, T, B, H, x.dtype, x.device)
    gates = ws.gates  # (T, B, 4H)
    # The input projection for all timesteps as one matrix multiply; g pre-doubled.
    torch.addmm(bias, x.reshape(T * B, -1), weight_ih.t(), out=gates.view(T * B, 4 * H))
    gates[:, :, 2 * H : 3 * H].mul_(2)
    gemm = recurrent_gemm((weight_hh,), B, "g2", _double_g_rows, cache=inference)  # h W_hh^T, g rows x2
    y = torch.empty(T, B, H, dtype=x.dtype, device=x.device)  # returned: never pooled
    c = ws.c
    c[0].copy_(c0)
    gi, gf, sg, go = (v.unbind(0) for v in gates.view(T, B, 4, H).unbind(2))  # T x (B, H)
    g_t, c_t, sc_t, y_t = gates.unbind(0), c.unbind(0), ws.sig_c.unbind(0), y.unbind(0)
    kc_t = keep_c.unbind(0) if isinstance(keep_c, Tensor) else None
    kh_t = keep_h.unbind(0) if isinstance(keep_h, Tensor) else None
    plain_c = kc_t is None and keep_c == 0.0
    plain_h = kh_t is None and keep_h == 0.0
    ct, ht = ws.c_tilde, ws.h_tilde
    h = h0
    for t in range(T):
        pre = gemm.add(h, g_t[t], ws.pre)  # (B, 4H) = x W_ih^T + b + h W_hh^T, g doubled
        torch.sigmoid(pre, out=g_t[t])  # i, f, s_g = sigmoid(2 g), o
        c_prev = c_t[t]
        ct_ = c_t[t + 1] if plain_c else ct
        # c~ = f c + i tanh(g) = f c - i + 2 i s_g
        torch.mul(gf[t], c_prev, out=ct_).sub_(gi[t]).addcmul_(gi[t], sg[t], value=2)
        s_c = torch.mul(ct_, 2, out=sc_t[t]).sigmoid_()  # s_c = sigmoid(2 c~)
        ht_ = y_t[t] if plain_h else ht
        torch.mul(go[t], s_c, out=ht_).mul_(2).sub_(go[t])  # h~ = o tanh(c~) = 2 o s_c - o
        if not plain_c:  # c = d_c c_prev + (1 - d_c) c~
            torch.lerp(ct_, c_prev, kc_t[t] if kc_t else keep_c, out=c_t[t + 1])
        if not plain_h:
            torch.lerp(ht_, h, kh_t[t] if kh_t else keep_h, out=y_t[t])
        h = y_t[t]
    return y, ws


def _step(x, h0, c0, weight_ih, weight_hh, bias, keep_c: Keep, keep_h: Keep):
    """One timestep of inference (T = 1: a window of one token, such as `zlm sample`'s default
    one-newline prime, or a caller stepping the model one token at a time; `zlm sample` then
    steps with `zlm.inference.stepper.Stepper`): one cached GEMM for [x, h] (addmm: robust on
    a busy machine, see `zlm.model.cells.packed_gemm`) and a few small fresh tensors; no
    workspace, no per-window setup."""
    H = h0.shape[1]
    gemm = recurrent_gemm((weight_ih, weight_hh, bias), h0.shape[0], "step", _stacked, True, "addmm")
    pre = gemm.mm(torch.cat([x[0], h0], 1))  # (B, 4H) = x W_ih^T + h W_hh^T + b
    g = pre[:, 2 * H : 3 * H].tanh()  # (B, H); a few hundred elements: tanh is cheap here
    i, f, _, o = pre.sigmoid_().chunk(4, 1)
    c = torch.mul(f, c0).addcmul_(i, g)  # c~ = f c + i g
    h = torch.tanh(c).mul_(o)  # h~ = o tanh(c~)
    if isinstance(keep_c, Tensor) or keep_c != 0.0:
        c = torch.lerp(c, c0, keep_c[0] if isinstance(keep_c, Tensor) else keep_c)
    if isinstance(keep_h, Tensor) or keep_h != 0.0:
        h = torch.lerp(h, h0, keep_h[0] if isinstance(keep_h, Tensor) else keep_h)
    return h.unsqueeze(0), h.clone(), c


class _ZoneoutLSTMFunction(torch.autograd.Function):
    """Forward without autograd; backward through time by hand (not twice-differentiable)."""

    @staticmethod
    def forward(ctx, x, h0, c0, weight_ih, weight_hh, bias, keep_c, keep_h):
        y, ws = _forward(x, h0, c0, weight_ih, weight_hh, bias, keep_c, keep_h, False)
        c_T = ws.c[-1].clone()
        ctx.ws = ws  # held by the graph until it is freed, then back to the pool
        ctx.keeps = (keep_c, keep_h)
        masks = [k for k in (keep_c, keep_h) if isinstance(k, Tensor)]
        ctx.save_for_backward(x, h0, weight_ih, weight_hh, y, *masks)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*masks)
        return y, y[-1].clone(), c_T

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dh_T, dc_T):
        x, h0, weight_ih, weight_hh, y = ctx.saved_tensors[:5]
        keep_c, keep_h = ctx.keeps
        grads = backward_through_time(
            ctx.ws, x, h0, weight_ih, weight_hh, y, keep_c, keep_h, dy, dh_T, dc_T,
            ctx.needs_input_grad[:6],
        )
        return (*grads, None, None)


def zoneout_lstm_fused(
    x: Tensor,
    h0: Tensor,
    c0: Tensor,
    weight_ih: Tensor,
    weight_hh: Tensor,
    bias: Tensor,
    keep_c: Keep,
    keep_h: Keep,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run one zoneout LSTM layer over a window (the fused CPU cell).

    Args:
        x: (T, B, I) inputs.
        h0, c0: (B, H) initial hidden and cell state.
        weight_ih: (4H, I), weight_hh: (4H, H), bias: (4H,); gate blocks i, f, g, o.
        keep_c, keep_h: probability of keeping the previous value - a (T, B, H) 0/1
            mask in training, or a float z in evaluation (0.0 turns zoneout off).

    Returns:
        y: (T, B, H) the zoned hidden state at every step, h_T, c_T: (B, H).
    """
    if torch.is_autocast_enabled(x.device.type):  # the recurrence runs in fp32 here
        with torch.autocast(x.device.type, enabled=False):
            args = (x, h0, c0, weight_ih, weight_hh, bias)
            return zoneout_lstm_fused(*(a.float() for a in args), *_float_keeps(keep_c, keep_h))
    x, h0, c0 = x.contiguous(), h0.contiguous(), c0.contiguous()
    if isinstance(keep_c, Tensor):
        keep_c = keep_c.to(x.dtype).contiguous()
    if isinstance(keep_h, Tensor):
        keep_h = keep_h.to(x.dtype).contiguous()
    if not torch.is_grad_enabled() or not any(
        t.requires_grad for t in (x, h0, c0, weight_ih, weight_hh, bias)
    ):
        # Inference (evaluation, sampling): no autograd node, nothing saved.
        if x.shape[0] == 1:
            return _step(x, h0, c0, weight_ih, weight_hh, bias, keep_c, keep_h)
        y, ws = _forward(x, h0, c0, weight_ih, weight_hh, bias, keep_c, keep_h, True)
        return y, y[-1].clone(), ws.c[-1].clone()
    return _ZoneoutLSTMFunction.apply(x, h0, c0, weight_ih, weight_hh, bias, keep_c, keep_h)


def _float_keeps(keep_c: Keep, keep_h: Keep) -> tuple[Keep, Keep]:
    return tuple(k.float() if isinstance(k, Tensor) else k for k in (keep_c, keep_h))

"""The CUDA fused zoneout LSTM cell: cuBLAS matrix multiplies around one Triton kernel a step.

This module owns the loop over time, the precision rules and the autograd wiring of the
fused cell; the element-wise device code lives in `zlm.model.cells.triton_kernels`. The cell has
the signature of `zoneout_lstm_reference` and takes the same pre-drawn masks, so the two
are compared under one seed (tests/model/test_cells_triton.py).

Forward over a window (buffer shapes as in haste; B is the batch, G = 4H):

    xw   = x W_ih^T                       [T, B, G] cd   one matmul for all timesteps
    for t in 0..T-1:
        hw = h_lo[t] W_hh^T               [B, G]    cd   one matmul
        fwd_step kernel: + b, gates, c~, h~, zoneout -> h[t+1], c[t+1], h_lo[t+1], act[t]
    h    [T+1, B, H] sd, h[0] = h0        c    [T+1, B, H] sd, c[0] = c0
    h_lo [T+1, B, H] cd, h_lo[0] = h0     (the same buffer as h when cd == sd); y = h_lo[1:]
    act  [T, B, G] sd: sigmoid(i), sigmoid(f), tanh(g), sigmoid(o), saved for backward

Backward through time:

    for t in T-1..0:
        bwd_step kernel: dy[t], carried dh, dc, da[t+1] W_hh -> da[t], dh, dc
        dh_rec = da[t] W_hh               [B, H] cd    one matmul
    da [T, B, G] cd; then once over all timesteps:
    dx = da W_ih [T, B, I], dW_ih = da^T x, dW_hh = da^T h_lo[:-1], db = sum of da

Precision: the compute dtype cd is the autocast dtype when autocast is on, else the
dtype of x (fp32, bf16 or fp16); weights are cast to cd for the matmuls (cuBLAS accumulates
in fp32). The recurrent state, the activations, the bias and all element-wise arithmetic
stay in the state dtype sd = fp32 (fp64 for fp64 inputs). y comes back in cd, h_T and c_T in
the dtype of h0 and c0.

Triton is imported lazily, so this module imports on machines without it. Kernels run on
CUDA tensors, or on CPU tensors under the Triton interpreter (`TRITON_INTERPRET=1`, set
before triton is first imported), which is how the parity tests run without a GPU.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

from zlm.model.cells.masks import Keep


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_unavailable_reason() -> str | None:
    """None when the Triton CUDA path can run here, else a short reason it cannot."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'zlm[gpu]')"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if _interpreting():
        return "TRITON_INTERPRET=1 is set (the Triton interpreter is for tests, not training)"
    major, _ = torch.cuda.get_device_capability()
    if major < 7:
        return f"the CUDA device has compute capability {major}.x; Triton needs 7.0 or newer"
    return None


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for x's device, else x's own dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _keep_args(keep: Keep, t: int) -> tuple[Tensor | None, float, bool]:
    """(mask slice (B, H) or None, scalar, is_mask) for one step's kernel launch."""
    if isinstance(keep, Tensor):
        return keep[t], 0.0, True
    return None, float(keep), False


def _forward(x, h0, c0, w_ih, w_hh, bias, keep_c, keep_h, save: bool):
    """The forward loop. x (T, B, I) cd; h0, c0 (B, H) sd; w_* cd; bias (G,) sd.

    Returns h_lo [T+1, B, H] cd, h [T+1, B, H] sd, c [T+1, B, H] sd, act [T, B, G] sd or None.
    """
    from zlm.model.cells import triton_kernels as K

    T, B, _ = x.shape
    H = h0.shape[1]
    cd, sd = x.dtype, h0.dtype
    xw = torch.mm(x.reshape(T * B, -1), w_ih.t()).view(T, B, 4 * H)  # [T, B, G] cd
    h = torch.empty(T + 1, B, H, dtype=sd, device=x.device)
    c = torch.empty_like(h)
    h[0], c[0] = h0, c0
    write_lo = cd != sd
    h_lo = torch.empty(T + 1, B, H, dtype=cd, device=x.device) if write_lo else h
    if write_lo:
        h_lo[0] = h0
    act = torch.empty(T, B, 4 * H, dtype=sd, device=x.device) if save else None
    hw = torch.empty(B, 4 * H, dtype=cd, device=x.device)  # [B, G] per-step scratch
    w_hh_t = w_hh.t()
    n = B * H
    block = K.block_for(n)
    grid = (_cdiv(n, block),)
    for t in range(T):
        torch.mm(h_lo[t], w_hh_t, out=hw)
        mc, zc, c_mask = _keep_args(keep_c, t)
        mh, zh, h_mask = _keep_args(keep_h, t)
        K.zoneout_lstm_fwd_step[grid](
            xw[t], hw, bias, h[t], c[t],
            mc if c_mask else c[t], mh if h_mask else h[t], zc, zh,
            h[t + 1], c[t + 1], h_lo[t + 1], act[t] if save else hw,
            n, H,
            C_MASK=c_mask, H_MASK=h_mask, WRITE_LO=write_lo, SAVE=save, BLOCK=block,
        )  # fmt: skip
    return h_lo, h, c, act


def _backward(ctx, dy, dh_T, dc_T):
    """Backward through time; one kernel and one matmul a step, weight gradients after."""
    from zlm.model.cells import triton_kernels as K

    x, w_ih, w_hh, h_lo, c, act, *masks = ctx.saved_tensors
    keep_c = masks.pop(0) if ctx.c_is_mask else ctx.keep_c
    keep_h = masks.pop(0) if ctx.h_is_mask else ctx.keep_h
    T, B, _ = x.shape
    H = c.shape[2]
    cd, sd = x.dtype, c.dtype
    dy = dy.contiguous()
    dh = dh_T.to(sd, copy=True).contiguous()  # [B, H] sd, carried gradient into h
    dc = dc_T.to(sd, copy=True).contiguous()  # [B, H] sd, carried gradient into c
    da = torch.empty(T, B, 4 * H, dtype=cd, device=x.device)  # [T, B, G] cd
    dh_rec = torch.empty(B, H, dtype=cd, device=x.device)  # [B, H] cd, da[t+1] W_hh
    n = B * H
    block = K.block_for(n)
    grid = (_cdiv(n, block),)
    for t in reversed(range(T)):
        mc, zc, c_mask = _keep_args(keep_c, t)
        mh, zh, h_mask = _keep_args(keep_h, t)
        K.zoneout_lstm_bwd_step[grid](
            dy[t], dh_rec, dh, dc, act[t], c[t],
            mc if c_mask else dc, mh if h_mask else dh, zc, zh,
            da[t], n, H,
            C_MASK=c_mask, H_MASK=h_mask, HAS_REC=t < T - 1, BLOCK=block,
        )  # fmt: skip
        torch.mm(da[t], w_hh, out=dh_rec)
    need = ctx.needs_input_grad
    da2 = da.view(T * B, 4 * H)
    dx = torch.mm(da2, w_ih).view(T, B, -1) if need[0] else None
    dh0 = (dh + dh_rec.to(sd)) if need[1] else None
    dc0 = dc if need[2] else None
    dw_ih = torch.mm(da2.t(), x.reshape(T * B, -1)) if need[3] else None
    dw_hh = torch.mm(da2.t(), h_lo[:-1].reshape(T * B, H)) if need[4] else None
    db = da2.sum(0, dtype=sd) if need[5] else None
    return dx, dh0, dc0, dw_ih, dw_hh, db, None, None


class _ZoneoutLSTMTriton(torch.autograd.Function):
    """Autograd around the fused loop; inputs arrive already cast (see `zoneout_lstm_triton`)."""

    @staticmethod
    def forward(ctx, x, h0, c0, w_ih, w_hh, bias, keep_c, keep_h):
        h_lo, h, c, act = _forward(x, h0, c0, w_ih, w_hh, bias, keep_c, keep_h, save=True)
        ctx.c_is_mask, ctx.h_is_mask = isinstance(keep_c, Tensor), isinstance(keep_h, Tensor)
        ctx.keep_c = None if ctx.c_is_mask else keep_c  # floats only; masks are saved
        ctx.keep_h = None if ctx.h_is_mask else keep_h
        masks = [k for k in (keep_c, keep_h) if isinstance(k, Tensor)]
        ctx.save_for_backward(x, w_ih, w_hh, h_lo, c, act, *masks)
        # h_T, c_T are copies so that they do not alias y or the saved buffers.
        return h_lo[1:], h[-1].clone(), c[-1].clone()

    @staticmethod
    def backward(ctx, dy, dh_T, dc_T):
        with torch.autocast(device_type=dy.device.type, enabled=False):
            return _backward(ctx, dy, dh_T, dc_T)


def zoneout_lstm_triton(
    x: Tensor,
    h0: Tensor,
    c0: Tensor,
    weight_ih: Tensor,
    weight_hh: Tensor,
    bias: Tensor,
    keep_c: Keep,
    keep_h: Keep,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run one zoneout LSTM layer over a window with the fused Triton cell.

    Args and returns as `zoneout_lstm_reference`: x (T, B, I); h0, c0 (B, H); weight_ih
    (4H, I), weight_hh (4H, H), bias (4H,), gate blocks i, f, g, o; keep_c, keep_h a
    (T, B, H) 0/1 mask or a float. Returns y (T, B, H) in the compute dtype and h_T, c_T
    (B, H) in the dtype of h0, c0.
    """
    if not (x.is_cuda or _interpreting()):
        raise RuntimeError(
            f"the Triton cell needs CUDA tensors (or TRITON_INTERPRET=1 for tests); got x on {x.device}"
        )
    cd = _compute_dtype(x)
    sd = _state_dtype(cd)
    T, B, _ = x.shape
    H = h0.shape[1]
    for name, k in (("keep_c", keep_c), ("keep_h", keep_h)):
        if isinstance(k, Tensor) and k.shape != (T, B, H):
            raise ValueError(f"{name} must be (T, B, H) = {(T, B, H)}, got {tuple(k.shape)}")
    keep_c, keep_h = (k.contiguous() if isinstance(k, Tensor) else float(k) for k in (keep_c, keep_h))
    with torch.autocast(device_type=x.device.type, enabled=False):
        args = (
            x.to(cd).contiguous(),
            h0.to(sd).contiguous(),
            c0.to(sd).contiguous(),
            weight_ih.to(cd).contiguous(),
            weight_hh.to(cd).contiguous(),
            bias.to(sd).contiguous(),
        )
        if torch.is_grad_enabled() and any(a.requires_grad for a in args):
            y, h_T, c_T = _ZoneoutLSTMTriton.apply(*args, keep_c, keep_h)
        else:  # inference: no activations saved, no autograd graph
            h_lo, h, c, _ = _forward(*args, keep_c, keep_h, save=False)
            y, h_T, c_T = h_lo[1:], h[-1].clone(), c[-1].clone()
    return y, h_T.to(h0.dtype), c_T.to(c0.dtype)

"""The Triton kernels of the CUDA fused cell: one element-wise step forward, one backward.

This module owns only device code; `zlm.model.cells.triton` owns the loop over time, the matrix
multiplies and the autograd wiring. Importing it imports triton, and `@triton.jit` decides
at import time whether these become compiled kernels or interpreter functions
(`TRITON_INTERPRET=1` must be set before the first import to run them on CPU tensors).

Names used in the shapes below (as in haste):

    T  timesteps in the window, B  batch, H  hidden units, G = 4H  gate pre-activations
    sd the state dtype (fp32; fp64 for fp64 inputs): h, c, activations, carried gradients
    cd the compute dtype of the matrix multiplies (fp32, or bf16/fp16 under low precision)

Every kernel is launched once per timestep on a 1-D grid over the n = B*H units of that
step, BLOCK units per program; unit u is example u // H, hidden unit u % H, and its four
gate pre-activations sit at columns j, H + j, 2H + j, 3H + j (gate order i, f, g, o as in
torch.nn.LSTM). All buffers are contiguous. Arithmetic is done in sd whatever dtype the
inputs arrive in; zoneout keeps are either a (B, H) 0/1 slice of a pre-drawn mask
(`C_MASK`/`H_MASK` true) or one float for every unit (the evaluation expectation; 0.0 is
a plain LSTM).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(v):
    """tanh from one exp of a non-positive argument: no overflow, no cancellation at large |v|."""
    e = tl.exp(-2.0 * tl.abs(v))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(v < 0, -t, t)


@triton.jit
def _keep(ptr, offs, mask, scalar, IS_MASK: tl.constexpr, like):
    """The keep for each unit: the pre-drawn mask value, or the scalar expectation."""
    if IS_MASK:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(like.dtype)
    else:
        return tl.zeros_like(like) + scalar


@triton.jit
def _preact(xw_ptr, hw_ptr, bias_ptr, gi, col, off, m, like):
    """One gate's pre-activation x W_ih^T + h W_hh^T + b, in the dtype of `like` (sd)."""
    a = tl.load(xw_ptr + gi + off, mask=m, other=0.0).to(like.dtype)
    a += tl.load(hw_ptr + gi + off, mask=m, other=0.0).to(like.dtype)
    return a + tl.load(bias_ptr + col + off, mask=m, other=0.0).to(like.dtype)


@triton.jit
def zoneout_lstm_fwd_step(
    xw_ptr,  # xw[t]: [B, G] cd, x_t W_ih^T (the bias is added here, in sd)
    hw_ptr,  # hw: [B, G] cd, h_lo[t] W_hh^T from this step's recurrent matrix multiply
    bias_ptr,  # bias: [G] sd
    h_prev_ptr,  # h[t]: [B, H] sd, zoned hidden state entering the step
    c_prev_ptr,  # c[t]: [B, H] sd, zoned cell state entering the step
    keep_c_ptr,  # keep_c[t]: [B, H] 0/1, any float dtype; unused unless C_MASK
    keep_h_ptr,  # keep_h[t]: [B, H] 0/1, any float dtype; unused unless H_MASK
    keep_c,  # float z_c; used unless C_MASK
    keep_h,  # float z_h; used unless H_MASK
    h_ptr,  # h[t+1]: [B, H] sd out
    c_ptr,  # c[t+1]: [B, H] sd out
    h_lo_ptr,  # h_lo[t+1]: [B, H] cd out (= y[t], the next matmul's operand); if WRITE_LO
    act_ptr,  # act[t]: [B, G] sd out, sigmoid(i), sigmoid(f), tanh(g), sigmoid(o); if SAVE
    n,  # B * H
    H,
    C_MASK: tl.constexpr,
    H_MASK: tl.constexpr,
    WRITE_LO: tl.constexpr,
    SAVE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Everything element-wise in one forward step: gates, c~, h~, zoneout mixing, stores."""
    u = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = u < n
    row = u // H
    col = u % H
    gi = row * 4 * H + col  # column of gate i; f, g, o follow at +H, +2H, +3H
    h_prev = tl.load(h_prev_ptr + u, mask=m, other=0.0)
    c_prev = tl.load(c_prev_ptr + u, mask=m, other=0.0)

    a_i = _preact(xw_ptr, hw_ptr, bias_ptr, gi, col, 0, m, h_prev)
    a_f = _preact(xw_ptr, hw_ptr, bias_ptr, gi, col, H, m, h_prev)
    a_g = _preact(xw_ptr, hw_ptr, bias_ptr, gi, col, 2 * H, m, h_prev)
    a_o = _preact(xw_ptr, hw_ptr, bias_ptr, gi, col, 3 * H, m, h_prev)

    i = tl.sigmoid(a_i)
    f = tl.sigmoid(a_f)
    g = _tanh(a_g)
    o = tl.sigmoid(a_o)
    c_new = f * c_prev + i * g  # c~
    h_new = o * _tanh(c_new)  # h~: tanh of the new, not-zoned cell

    d_c = _keep(keep_c_ptr, u, m, keep_c, C_MASK, c_prev)
    d_h = _keep(keep_h_ptr, u, m, keep_h, H_MASK, h_prev)
    c = d_c * c_prev + (1.0 - d_c) * c_new
    h = d_h * h_prev + (1.0 - d_h) * h_new
    tl.store(c_ptr + u, c, mask=m)
    tl.store(h_ptr + u, h, mask=m)
    if WRITE_LO:
        tl.store(h_lo_ptr + u, h.to(h_lo_ptr.dtype.element_ty), mask=m)
    if SAVE:
        tl.store(act_ptr + gi, i, mask=m)
        tl.store(act_ptr + gi + H, f, mask=m)
        tl.store(act_ptr + gi + 2 * H, g, mask=m)
        tl.store(act_ptr + gi + 3 * H, o, mask=m)


@triton.jit
def zoneout_lstm_bwd_step(
    dy_ptr,  # dy[t]: [B, H] gradient of the output y[t], any float dtype
    dh_rec_ptr,  # dh_rec: [B, H] cd, da[t+1] W_hh (recurrent gradient into h[t+1]); if HAS_REC
    dh_ptr,  # dh: [B, H] sd in/out: in, carried gradient into h[t+1]; out, keep_h * dh_total
    dc_ptr,  # dc: [B, H] sd in/out: in, gradient into c[t+1]; out, gradient into c[t]
    act_ptr,  # act[t]: [B, G] sd, the saved i, f, g, o activations
    c_prev_ptr,  # c[t]: [B, H] sd, the cell state entering step t
    keep_c_ptr,  # keep_c[t]: [B, H]; unused unless C_MASK
    keep_h_ptr,  # keep_h[t]: [B, H]; unused unless H_MASK
    keep_c,  # float z_c; used unless C_MASK
    keep_h,  # float z_h; used unless H_MASK
    da_ptr,  # da[t]: [B, G] cd out, gradient of the gate pre-activations
    n,  # B * H
    H,
    C_MASK: tl.constexpr,
    H_MASK: tl.constexpr,
    HAS_REC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Everything element-wise in one backward step; the h-gradient of W_hh is a matmul outside.

    With dh the total gradient into h[t+1] and dc that into c[t+1]:
        dh~ = (1 - d_h) dh            dc~ = (1 - d_c) dc + dh~ o (1 - tanh(c~)^2)
        da_i = dc~ g i (1 - i)        da_f = dc~ c[t] f (1 - f)
        da_g = dc~ i (1 - g^2)        da_o = dh~ tanh(c~) o (1 - o)
        dc[t] = d_c dc + f dc~        dh[t] = d_h dh + da W_hh   (the matmul: next launch)
    c~ is recomputed from the saved activations rather than stored.
    """
    u = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = u < n
    row = u // H
    col = u % H
    gi = row * 4 * H + col
    dh = tl.load(dh_ptr + u, mask=m, other=0.0)
    sd = dh.dtype
    dh += tl.load(dy_ptr + u, mask=m, other=0.0).to(sd)
    if HAS_REC:
        dh += tl.load(dh_rec_ptr + u, mask=m, other=0.0).to(sd)
    dc = tl.load(dc_ptr + u, mask=m, other=0.0)
    c_prev = tl.load(c_prev_ptr + u, mask=m, other=0.0)
    i = tl.load(act_ptr + gi, mask=m, other=0.0)
    f = tl.load(act_ptr + gi + H, mask=m, other=0.0)
    g = tl.load(act_ptr + gi + 2 * H, mask=m, other=0.0)
    o = tl.load(act_ptr + gi + 3 * H, mask=m, other=0.0)
    d_c = _keep(keep_c_ptr, u, m, keep_c, C_MASK, dc)
    d_h = _keep(keep_h_ptr, u, m, keep_h, H_MASK, dh)

    tc = _tanh(f * c_prev + i * g)  # tanh(c~)
    dh_new = (1.0 - d_h) * dh
    dc_new = (1.0 - d_c) * dc + dh_new * o * (1.0 - tc * tc)
    da_i = dc_new * g * i * (1.0 - i)
    da_f = dc_new * c_prev * f * (1.0 - f)
    da_g = dc_new * i * (1.0 - g * g)
    da_o = dh_new * tc * o * (1.0 - o)

    lo = da_ptr.dtype.element_ty
    tl.store(da_ptr + gi, da_i.to(lo), mask=m)
    tl.store(da_ptr + gi + H, da_f.to(lo), mask=m)
    tl.store(da_ptr + gi + 2 * H, da_g.to(lo), mask=m)
    tl.store(da_ptr + gi + 3 * H, da_o.to(lo), mask=m)
    tl.store(dc_ptr + u, d_c * dc + f * dc_new, mask=m)
    tl.store(dh_ptr + u, d_h * dh, mask=m)


def block_for(n: int) -> int:
    """Units per program: a power of two, at most 1024, no bigger than needed."""
    return min(1024, triton.next_power_of_2(max(n, 16)))

"""The compiled fused CPU zoneout cell: torch matrix multiplies + one C++ step per timestep.

Same signature, parameter layout, gate order (i, f, g, o) and pre-drawn masks as
`zlm.model.cells.reference.zoneout_lstm_reference`; it matches it to 1e-5 in fp32 and
1e-10 in fp64, and in bf16 to 2e-2 relative (tests/model/test_cells_compiled.py).

Per window (haste's layout, on the CPU):
- forward: the input projection for all timesteps is one matrix multiply; per step one
  recurrent multiply (in fp32 MKL's packed GEMM where torch carries MKL, in bf16 oneDNN's
  AMX micro-kernel up to H 1024 on CPUs with AMX, else oneDNN packed weights:
  `recurrent_backend`, `zlm.model.cells.packed_gemm`)
  and ONE call of the C++ step (zlm/model/cells/csrc/cell_steps.cpp): bias-added pre-activations -> gate
  activations -> c~, h~ -> both zoneout mixes, in one pass over memory;
- backward: per step one C++ call (all element-wise work of the step, in one pass) and
  one recurrent multiply; dW_ih, dW_hh, db and dx are one multiply or reduction each.
- with packed recurrent weights (fp32: MKL's or oneDNN's; bf16 where the CPU has native bf16:
  oneDNN's or, with AMX, its micro-kernel's) the
  time loops themselves run in C++ (`forward_window`, `backward_window`: the same
  operator calls and element-wise steps in the same order, so the same numbers as the
  Python loops, without the interpreter's cost per step); fp64, and bf16 on other CPUs
  (`torch.mm`), keep the Python loops.

Precision: under `torch.autocast("cpu", dtype=torch.bfloat16)` every matrix multiply
(input projection, recurrence, weight gradients, dx) runs in bf16 with fp32 accumulation
inside the multiply; the recurrent state h, c, the gate arithmetic and the gradients
through time stay fp32, and parameter gradients are returned in fp32. Otherwise the cell
computes in its inputs' dtype (fp32, or fp64 for gradcheck).

Backward of one step (d = keep, n = 1 - keep; dh, dc the gradients of the zoned h_t, c_t):

    dh      = d_h(t+1) dh_{t+1} + dy_t + dpre_{t+1} W_hh        ("carry" + dy + "rec")
    dc~     = n_c dc + n_h dh o (1 - tanh(c~)^2)
    dpre    = [dc~ g i(1-i), dc~ c_prev f(1-f), dc~ i (1-g^2), n_h dh tanh(c~) o(1-o)]
    dc_prev = d_c dc + dc~ f
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from zlm.model.cells.cpu_ext import cpu_vendor, instruction_set
from zlm.model.cells.masks import Keep
from zlm.model.cells.packed_gemm import backend_for, mm_nt, recurrent_gemm
from zlm.model.cells.workspace import take_workspace

BF16 = torch.bfloat16


class StepWorkspace:
    """Buffers of one window of one layer (forward and backward), reused across windows.

    gates: (T, B, 4H) input projection (fp32 only), then the activations i, f, g, o per step.
    xp_lp: (T, B, 4H) the input projection in bf16 (bf16 only: the step reads it as is).
    c: (T+1, B, H) zoned cell state, c[0] = c0.   tc: (T, B, H) tanh(c~_t).
    h_lp: (T+1, B, H) bf16 copies of h_prev (h0, y_0 .. y_{T-1}) for bf16 multiplies.
    dgates: (T, B, 4H) gradient of the pre-activations, in the compute dtype.
    carry, dc: (B, H) gradients carried through time; pre: (B, 4H) scratch (fp32 addmm path).
    dgates_t: (4H, T*B), h_t: (H, T*B) fp32, allocated by the first backward that fills them
    (`transposed_grads`): dgates and h_prev transposed by the C++ backward, step by step,
    for the weight-gradient products (`transposed` says whether the last backward filled
    them). db: (4H,) fp32, the bias gradient the C++ backward summed step by step (None
    where it did not: one sum of dgates then).
    With oneDNN the input projection is a fresh tensor each window (`_input_projection`)
    that replaces gates (fp32) or xp_lp (bf16).
    """

    lp = False  # whether the matrix multiplies run in bf16

    def __init__(self, T: int, B: int, H: int, dtype: torch.dtype, device: torch.device):
        kw = dict(dtype=dtype, device=device)
        cd = BF16 if self.lp else dtype
        self.gates = torch.empty(T, B, 4 * H, **kw)
        self.c = torch.empty(T + 1, B, H, **kw)
        self.tc = torch.empty(T, B, H, **kw)
        self.h_lp = torch.empty(T + 1, B, H, dtype=BF16, device=device) if self.lp else None
        self.xp_lp = torch.empty(T, B, 4 * H, dtype=BF16, device=device) if self.lp else None
        self.pre = torch.empty(B, 4 * H, **kw)
        self.dgates = torch.empty(T, B, 4 * H, dtype=cd, device=device)
        self.carry, self.dc = torch.empty(B, H, **kw), torch.empty(B, H, **kw)
        self.dgates_t = self.h_t = None
        self.transposed = False
        self.db = None
        self.w16t = None  # bf16 windows with a backward: W_hh^T in bf16 (C++ bf16_pair)
        self.w16 = None  # and W_hh in bf16, where the backward's product is AMX's (its B matrix)


class StepWorkspaceBF16(StepWorkspace):
    lp = True


def _keep_args(keep: Keep, t: int | slice) -> tuple[Tensor | None, float]:
    """(mask row(s) t or None, float keep) for the C++ step."""
    return (keep[t], 0.0) if isinstance(keep, Tensor) else (None, float(keep))


def _same(w: Tensor) -> tuple[Tensor, None]:
    return w, None


def _transpose(w: Tensor) -> tuple[Tensor, None]:
    return w.t().contiguous(), None  # copy and reorder: as fast as reordering the view (docs/kernels.md)


def _bf16(w: Tensor) -> tuple[Tensor, None]:
    return w.to(BF16), None


def _given(w16: Tensor):
    """A build returning a weight already converted (by the C++ `bf16_pair`)."""
    return lambda w: (w16, None)


def _bf16_transpose(w: Tensor) -> tuple[Tensor, None]:
    return w.to(BF16).t().contiguous(), None


_PACKED_PROJECTION_BYTES = 32 << 20  # the packed input projection's result, at most
_PACKED_PROJECTION_ROWS = 2048  # T*B, at least: below, packing W_ih does not pay for itself


def _with_bias(w: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    return w, b


def _with_bias_bf16(w: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    return w.to(BF16), b.to(BF16)


def _input_projection(xs: Tensor, w_ih: Tensor, bias: Tensor, out: Tensor, backend: str, save: bool,
                      lp: bool) -> Tensor:
    """x W_ih^T + b for the whole window, (T*B, I) -> (T, B, 4H) in xs's dtype.

    With oneDNN (the backend of the recurrent products), at least _PACKED_PROJECTION_ROWS
    rows and a result of at most _PACKED_PROJECTION_BYTES (it stays in the last-level
    cache): one product with W_ih packed for it, whose result, a fresh tensor, replaces
    `out`. Otherwise addmm into `out`, the reused workspace: about twice as fast once the
    fresh result outgrows the cache, and no slower for small windows, where packing W_ih
    does not pay for itself (docs/kernels.md).
    """
    size = out.numel() * out.element_size()
    if backend == "onednn" and xs.shape[0] >= _PACKED_PROJECTION_ROWS and size <= _PACKED_PROJECTION_BYTES:
        build = _with_bias_bf16 if lp else _with_bias
        proj = recurrent_gemm((w_ih, bias), xs.shape[0], "x16" if lp else "x", build, cache=not save)
        return proj.mm(xs).view(out.shape)
    cd = BF16 if lp else xs.dtype
    torch.addmm(bias.to(cd), xs, w_ih.to(cd).t(), out=out.view(xs.shape[0], -1))
    return out


USE_MKL = True  # fp32 windows take MKL's packed GEMM where torch has it (False: oneDNN; the tests run both)
MKL_ELSEWHERE_MAX_HIDDEN = 192  # above, oneDNN's product was faster on a CPU not made by Intel (docs/kernels.md)


USE_AMX = True  # bf16 windows up to AMX_MAX_HIDDEN take AMX's micro-kernel where the CPU has it (False: oneDNN)
AMX_MAX_HIDDEN = 1024  # above, the whole training step was slower (docs/kernels.md)


def recurrent_backend(ext, dtype: torch.dtype = torch.float32, hidden: int = 0) -> str:
    """The backend of a window's recurrent products, else `backend_for`'s.

    fp32: "mkl" where the extension finds MKL's packed GEMM in torch and oneDNN would run
    otherwise, on an Intel CPU at every size (on an Intel Xeon the whole window ran
    1.05-1.5x faster: docs/kernels.md) and on other vendors' CPUs up to
    MKL_ELSEWHERE_MAX_HIDDEN units, where oneDNN's fixed cost per call outweighs a small
    product (on an AMD EPYC with AVX2 the whole training step took 0.74-0.95 of oneDNN's time
    at H 64-192, 1.02 at 256 and 1.06-1.20 at 384-512). `hidden` 0 (not known) keeps oneDNN there.
    bf16: "amx" (oneDNN's micro-kernel, amx_gemm.cpp) where the CPU has AMX and `hidden`
    is even and at most AMX_MAX_HIDDEN: a small product's time is mostly the packed linear's
    fixed cost per call (on a Xeon: a product 3.3x faster at H 128, about 1.2x at H 1024;
    the whole training step in 0.75-0.96 of the time).
    """
    backend = backend_for(dtype, torch.device("cpu"))
    if backend != "onednn":
        return backend
    if dtype == torch.float32 and USE_MKL and hasattr(ext, "mkl_packed_ready") and ext.mkl_packed_ready() \
            and (on_intel() or 0 < hidden <= MKL_ELSEWHERE_MAX_HIDDEN):
        return "mkl"
    if dtype == BF16 and USE_AMX and 0 < hidden <= AMX_MAX_HIDDEN and hidden % 2 == 0 \
            and hasattr(ext, "amx_ready") and ext.amx_ready():
        return "amx"
    return backend


TRANSPOSED_GRADS: bool | None = None  # None: `transposed_grads` decides by the CPU; True/False forces it


@functools.cache
def _avx512() -> bool:
    return instruction_set() in ("avx512", "avx512bf16")


def transposed_grads() -> bool:
    """Whether the fp32 C++ backward also writes each step's dpre and h_prev transposed
    (and sums the bias gradient) while they are in cache, so the weight gradients run as
    oneDNN products on contiguous operands (`mm_nt`): on CPUs with AVX-512, where those
    products beat torch.mm by 4-9%. On an AVX2-only CPU the strided writes cost more than
    they save (on an AMD EPYC at B32 H384: a third more time per backward step, and `mm_nt`
    slower than torch.mm on the views), so the weight gradients are torch.mm on the
    window's own buffers and db one sum (docs/kernels.md)."""
    return _avx512() if TRANSPOSED_GRADS is None else TRANSPOSED_GRADS


def weight_grads_by_mm(ext, hidden: int) -> bool:
    """Whether an fp32 window of `hidden` units takes its weight gradients as torch.mm on the
    window's buffers: its backward runs in C++ (packed products) without `transposed_grads`."""
    return (recurrent_backend(ext, hidden=hidden) in ("mkl", "onednn") and hasattr(ext, "backward_window")
            and not transposed_grads())


@functools.cache
def on_intel() -> bool:
    """Whether this is an Intel CPU (read once: every window asks)."""
    return cpu_vendor() == "GenuineIntel"


def _in_cpp(ext, gemm, name: str) -> bool:
    """Whether the window's time loop runs in C++: packed weights and a build with it."""
    return gemm.backend in ("onednn", "mkl", "amx") and hasattr(ext, name)


def _forward(ext, x, h0, c0, w_ih, w_hh, bias, keep_c: Keep, keep_h: Keep, lp: bool, save: bool):
    """Run the window without autograd. Returns y (T, B, H) (fresh) and the workspace.

    lp: bf16 matrix multiplies. save: a backward follows (keep tanh(c~); no weight cache).
    """
    T, B, _ = x.shape
    H = h0.shape[1]
    ws = take_workspace(StepWorkspaceBF16 if lp else StepWorkspace, T, B, H, x.dtype, x.device)
    gates, c, tc = ws.gates, ws.c, ws.tc
    xs = x.reshape(T * B, -1)
    if lp:  # (T*B, 4H) in bf16, read as is by the step
        backend = recurrent_backend(ext, BF16, H)
        amx = backend == "amx"
        build, ws.w16t, ws.w16 = _bf16, None, None
        if save and hasattr(ext, "bf16_pair"):  # both bf16 copies of W_hh in one pass, the backward's kept
            w16 = torch.empty(w_hh.shape, dtype=BF16)
            ws.w16t = torch.empty(w_hh.shape[::-1], dtype=BF16)
            ext.bf16_pair(w_hh.detach().contiguous(), w16, ws.w16t)
            # AMX packs W^T itself: the transposed view of W^T hands it over without a copy
            build = _given(ws.w16t.t() if amx else w16)
            ws.w16 = w16 if amx else None
        gemm = recurrent_gemm((w_hh,), B, "c16", build, cache=not save, backend=backend, ext=ext)
        projection = "onednn" if amx else gemm.backend  # one large product: oneDNN's
        ws.xp_lp = _input_projection(xs.to(BF16), w_ih, bias, ws.xp_lp, projection, save, lp)
        ws.h_lp[0].copy_(h0)
    else:
        backend = recurrent_backend(ext, hidden=H) if x.dtype == torch.float32 else None
        gemm = recurrent_gemm((w_hh,), B, "c", _same, cache=not save, backend=backend, ext=ext)  # h W_hh^T
        projection = "onednn" if gemm.backend == "mkl" else gemm.backend  # one large product: oneDNN's
        ws.gates = gates = _input_projection(xs, w_ih, bias, gates, projection, save, lp)
    y_all = torch.empty(T + 1, B, H, dtype=x.dtype, device=x.device)  # returned: never pooled
    y_all[0].copy_(h0)
    c[0].copy_(c0)
    if _in_cpp(ext, gemm, "forward_window"):
        kc, zc = _keep_args(keep_c, slice(None))
        kh, zh = _keep_args(keep_h, slice(None))
        ext.forward_window(gates, gemm.packed, y_all, c, tc, kc, zc, kh, zh, save, ws.h_lp, ws.xp_lp)
        return y_all, ws
    for t in range(T):
        if lp:
            xp, rec = ws.xp_lp[t], gemm.mm(ws.h_lp[t])  # both (B, 4H) bf16
        else:
            xp, rec = gemm.add(y_all[t], gates[t], ws.pre), None  # (B, 4H) = xW + b + hW
        kc, zc = _keep_args(keep_c, t)
        kh, zh = _keep_args(keep_h, t)
        ext.forward_step(xp, rec, gates[t], c[t], y_all[t], kc, zc, kh, zh, c[t + 1],
                         tc[t], y_all[t + 1], ws.h_lp[t + 1] if lp else None)
    return y_all, ws


def _backward(ext, ws, w_hh, y_all, keep_c, keep_h, dy, dh_T, dc_T, lp: bool):
    """Backward through time: fills ws.dgates (T, B, 4H) with the gradient of the gate
    pre-activations (and, where `transposed_grads` says so, ws.dgates_t and ws.h_t) and returns
    dh0, dc0 (B, H). y_all (T+1, B, H): h0, y. dy (T, B, H), dh_T, dc_T may be None."""
    T, B, _ = ws.gates.shape
    carry, dc, dgates = ws.carry, ws.dc, ws.dgates
    carry.zero_() if dh_T is None else carry.copy_(dh_T)
    dc.zero_() if dc_T is None else dc.copy_(dc_T)
    if lp:  # dpre (B, 4H) @ W_hh -> (B, H), in bf16 (AMX: the result fp32)
        backend = recurrent_backend(ext, BF16, w_hh.shape[1])
        if backend == "amx" and ws.w16 is not None:  # W^T here is W_hh: its transposed view, no copy
            build = _given(ws.w16.t())
        else:
            build = _bf16_transpose if ws.w16t is None else _given(ws.w16t)
        gemm = recurrent_gemm((w_hh,), B, "T16", build, backend=backend, ext=ext)
    else:
        backend = recurrent_backend(ext, hidden=w_hh.shape[1]) if w_hh.dtype == torch.float32 else None
        gemm = recurrent_gemm((w_hh,), B, "T", _transpose, backend=backend, ext=ext)
    ws.transposed, ws.db = False, None
    if _in_cpp(ext, gemm, "backward_window"):
        kc, zc = _keep_args(keep_c, slice(None))
        kh, zh = _keep_args(keep_h, slice(None))
        ws.transposed = not lp and transposed_grads()  # the C++ loop without lp is fp32
        if ws.transposed and ws.dgates_t is None:
            ws.dgates_t = torch.empty(dgates.shape[-1], T * B, dtype=torch.float32)
            ws.h_t = torch.empty(w_hh.shape[1], T * B, dtype=torch.float32)
        y = y_all if ws.transposed else None
        if ws.transposed or lp:
            ws.db = torch.empty(dgates.shape[-1], dtype=torch.float32)  # returned as the bias gradient
        rec = ext.backward_window(ws.gates, ws.tc, ws.c, kc, zc, kh, zh, dy, carry, dc, dgates, gemm.packed,
                                  ws.dgates_t if ws.transposed else None, y, ws.h_t if ws.transposed else None,
                                  ws.db)
        return carry + rec, dc.clone()
    rec = None
    for t in range(T - 1, -1, -1):
        kc, zc = _keep_args(keep_c, t)
        kh, zh = _keep_args(keep_h, t)
        ext.backward_step(ws.gates[t], ws.tc[t], ws.c[t], kc, zc, kh, zh,
                          None if dy is None else dy[t], carry, rec, dc, dgates[t])
        rec = gemm.mm(dgates[t])
    return carry + rec, dc.clone()


class _Function(torch.autograd.Function):
    """Forward without autograd; backward through time by hand (not twice-differentiable)."""

    @staticmethod
    def forward(ctx, x, h0, c0, weight_ih, weight_hh, bias, keep_c, keep_h, ext, lp):
        y_all, ws = _forward(ext, x, h0, c0, weight_ih, weight_hh, bias, keep_c, keep_h, lp, True)
        ctx.ws, ctx.keeps, ctx.ext, ctx.lp = ws, (keep_c, keep_h), ext, lp
        ctx.save_for_backward(x, weight_ih, weight_hh, y_all)
        ctx.set_materialize_grads(False)
        masks = [k for k in (keep_c, keep_h) if isinstance(k, Tensor)]
        ctx.mark_non_differentiable(*masks)
        y = y_all[1:]
        return y, y[-1].clone(), ws.c[-1].clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dh_T, dc_T):
        with torch.autocast("cpu", enabled=False):
            return _Function._grads(ctx, dy, dh_T, dc_T)

    @staticmethod
    def _grads(ctx, dy, dh_T, dc_T):
        x, w_ih, w_hh, y_all = ctx.saved_tensors
        ws, lp, needs = ctx.ws, ctx.lp, ctx.needs_input_grad
        dy = None if dy is None else dy.contiguous()
        dh0, dc0 = _backward(ctx.ext, ws, w_hh, y_all, *ctx.keeps, dy, dh_T, dc_T, lp)
        dx, dw_ih, dw_hh, db = _input_and_weight_grads(ws, x, w_ih, y_all, needs, lp)
        return (dx, dh0 if needs[1] else None, dc0 if needs[2] else None, dw_ih, dw_hh, db,
                None, None, None, None)


def _input_and_weight_grads(ws, x, w_ih, y_all, needs, lp: bool):
    """dx (T, B, I), dW_ih, dW_hh, db from ws.dgates (None where not needed); db is the
    C++ backward's (ws.db, summed step by step) where it ran."""
    T, B, H4 = ws.gates.shape
    dpre = ws.dgates.view(T * B, H4)  # compute dtype
    xs = x.reshape(T * B, -1)
    if not needs[5]:
        db = None
    elif ws.db is not None:
        db = ws.db.to(x.dtype)
    else:
        db = dpre.sum(0, dtype=x.dtype)
    if ws.transposed:  # fp32, oneDNN on contiguous operands (see packed_gemm.mm_nt)
        dx = mm_nt(dpre, w_ih.t().contiguous()).view(T, B, -1) if needs[0] else None
        dw_ih = mm_nt(ws.dgates_t, xs.t().contiguous()) if needs[3] else None
        dw_hh = mm_nt(ws.dgates_t, ws.h_t) if needs[4] else None
        return dx, dw_ih, dw_hh, db
    cd = dpre.dtype
    hprev = (ws.h_lp if lp else y_all)[:-1].reshape(T * B, -1)  # (T*B, H): h0, y_0 .. y_{T-2}
    dx = torch.mm(dpre, w_ih.to(cd)).view(T, B, -1).to(x.dtype) if needs[0] else None
    dw_ih = torch.mm(dpre.t(), xs.to(cd)).to(w_ih.dtype) if needs[3] else None
    dw_hh = torch.mm(dpre.t(), hprev).to(w_ih.dtype) if needs[4] else None  # (weights share a dtype)
    return dx, dw_ih, dw_hh, db


def compute_lp(x: Tensor) -> bool:
    """Whether the matrix multiplies run in bf16: CPU autocast to bf16 is on."""
    return (x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == BF16)


def make_compiled_cell(ext):
    """The cell function around a loaded extension module (`zlm.model.cells.cpu_ext`)."""

    def zoneout_lstm_compiled(x: Tensor, h0: Tensor, c0: Tensor, weight_ih: Tensor, weight_hh: Tensor,
                              bias: Tensor, keep_c: Keep, keep_h: Keep) -> tuple[Tensor, Tensor, Tensor]:
        """One zoneout LSTM layer over a window (compiled CPU step).

        x: (T, B, I); h0, c0: (B, H); weight_ih (4H, I), weight_hh (4H, H), bias (4H,),
        gate blocks i, f, g, o; keep_c, keep_h: (T, B, H) 0/1 masks or floats.
        Returns y: (T, B, H), h_T, c_T: (B, H) in the state dtype (fp32 under bf16 autocast).
        """
        lp = compute_lp(x)
        with torch.autocast("cpu", enabled=False):
            sd = torch.float32 if lp else x.dtype
            x, h0, c0 = (t.to(sd).contiguous() for t in (x, h0, c0))
            keep_c, keep_h = (k.to(sd).contiguous() if isinstance(k, Tensor) else k for k in (keep_c, keep_h))
            args = (x, h0, c0, weight_ih, weight_hh, bias)
            if torch.is_grad_enabled() and any(a.requires_grad for a in args):
                return _Function.apply(*args, keep_c, keep_h, ext, lp)
            y_all, ws = _forward(ext, *args, keep_c, keep_h, lp, False)
            return y_all[1:], y_all[-1].clone(), ws.c[-1].clone()

    return zoneout_lstm_compiled

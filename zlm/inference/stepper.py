"""The model's eval-mode step for one token per stream: what sampling and compression run.

The step is the model's own arithmetic (eval mode: zoneout uses its expectation, dropout
is off) laid out for T = 1:

    layer 0   gates = table[tok] + h W_hh^T          table = E W_ih^T + b, (V, 4H), once
                    (or E[tok] W_ih^T + b per step, where the table would take more than
                    TABLE_MAX_BYTES: a sentencepiece vocabulary's would take hundreds of MB)
    layer k   gates = b + x W_ih^T + h W_hh^T        (B, 4H)
    all       i, f, o = sigmoid, g = tanh;  c~ = f c + i g;  h~ = o tanh(c~)
              c = z_c c + (1 - z_c) c~;  h = z_h h + (1 - z_h) h~
    decoder   logits = h W_d^T + b_d                 (B, V)

into buffers allocated once. Three kernels, chosen once per `Stepper` (the table of which
runs when: docs/kernels.md):

- "decode" (CPU, fp32 model, compiled extension): the whole step - every layer's
  matrix-vector products, the element-wise work and the decoder - is ONE call of the
  C++ `Decoder` (zlm/model/cells/csrc/decoder.cpp), on weights packed once into
  tiles of DECODER_TILE (32) columns with the gates of DECODER_UNITS (8) units side by
  side (`zlm.model.cells.decoder_tiles`).
  bf16 weights (lp=True) halve the bytes read per token; on a CPU with AVX512-BF16 their
  products take x rounded to bf16 (vdpbf16ps, as bf16 training's matmuls do), elsewhere
  the weights are widened exactly to fp32. h, c and the accumulators stay fp32. Streams
  are taken several at a time per weight tile (4 with AVX-512), each summed in the same
  order whatever the batch, so one stream's logits do not depend on the others.
- "cpp" (CPU, compiled extension): per layer a torch multiply for the recurrence and one
  call of the compiled element-wise step (`forward_step`). It runs fp64 models, and
  `zlm compress` records and replays it.
- "torch": ~20 small torch ops per layer, where there is no compiled extension, and on CUDA.
  On CUDA the step is captured into a CUDA graph once (`zlm.core.graphs.CapturedStep`;
  it writes only into the buffers here) and replayed per token: one launch, not ~45.

Each is checked against the model's forward (tests/inference/test_stepper_compiled.py,
tests/inference/test_sample.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from zlm.core.graphs import CapturedStep
from zlm.model.cells.cpu_ext import load_extension
from zlm.model.cells.decoder_tiles import build_decoder, table_fits
from zlm.model.lm import ZoneoutLM

KERNELS = ("auto", "decode", "cpp", "torch")


class Stepper:
    """The model's eval-mode step for T = 1 and B streams, into preallocated buffers.

    kernel: "auto" (the fastest this model and machine have: "decode", else "cpp", else
    "torch"; see the module docstring), or one of them ("decode" and "cpp" fall back the
    same way when they cannot run). lp=True (bf16 chosen on the CPU): the multiplies read
    bf16 weights ("cpp": and a bf16 copy of h); h, c, the gates and the decoder stay fp32.
    threads: the Decoder's threads (default torch's); its result does not depend on them.
    The weights are copied: after changing the model's, call `load_weights`.
    """

    capture = CapturedStep  # tests substitute an eager stand-in

    def __init__(self, model: ZoneoutLM, batch: int, lp: bool = False, kernel: str = "auto",
                 threads: int | None = None, graphs: bool | None = None):
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        cfg = model.config
        H, B = cfg.hidden, batch
        dev, dt = model.decoder.weight.device, model.decoder.weight.dtype
        self.ext = load_extension() if dev.type == "cpu" and dt in (torch.float32, torch.float64) else None
        whole = self.ext is not None and dt == torch.float32 and hasattr(self.ext, "Decoder")
        if kernel in ("auto", "decode") and whole:
            self.kernel = "decode"
        else:
            self.kernel = "cpp" if self.ext is not None and kernel != "torch" else "torch"
        if self.kernel == "torch":
            self.ext = None
        self.lp = lp and self.ext is not None and dt == torch.float32
        self.threads = threads or torch.get_num_threads()
        wd = torch.bfloat16 if self.lp else dt
        self.keep_c = [layer.zoneout_cell for layer in model.layers]
        self.keep_h = [layer.zoneout_hidden for layer in model.layers]
        self.h = torch.zeros(cfg.layers, B, H, device=dev, dtype=dt)  # (L, B, H)
        self.c = torch.zeros_like(self.h)
        self.h_lp = self.h.to(torch.bfloat16) if self.lp and self.kernel == "cpp" else None  # bf16 copy of h
        self.looked_up = table_fits(model)  # layer 0's input projection: a row of the table, else a product
        self.logits = torch.empty(B, cfg.vocab_size, device=dev, dtype=dt)  # (B, V)
        if self.kernel != "decode":  # the per-layer buffers of the "cpp" and "torch" kernels
            self.rec = torch.empty(B, 4 * H, device=dev, dtype=wd)  # (B, 4H) recurrent part (lp)
            # (B, E) the tokens' embeddings, where layer 0 multiplies them instead of reading the table
            self.x0 = None if self.looked_up else torch.empty(B, cfg.embed, device=dev, dtype=dt)
            self.gates = [torch.empty(B, 4 * H, device=dev, dtype=dt) for _ in model.layers]
            self.c_new, self.tanh_c, self.h_new = (torch.empty(B, H, device=dev, dtype=dt) for _ in range(3))
            # Views fixed once: sigmoid over i, f, o (B, 3H), tanh over g (B, H).
            self.views = [(g[:, : 3 * H], g[:, 3 * H :], g[:, :H], g[:, H : 2 * H], g[:, 2 * H : 3 * H],
                           g[:, 3 * H :]) for g in self.gates]
        # graphs: replay the "torch" step from a CUDA graph (None: on CUDA)
        self.graphs = self.kernel == "torch" and (dev.type == "cuda" if graphs is None else graphs)
        self.graph: CapturedStep | None = None
        self.load_weights(model)

    @torch.no_grad()
    def load_weights(self, model: ZoneoutLM) -> None:
        """(Re)derive the step's weight layouts from `model` (after its weights changed)."""
        self.graph = None  # captured over the old layouts: captured again at the next step
        if self.kernel == "decode":
            self.decoder = self._pack_decoder(model)
            return
        H, dev = model.config.hidden, model.decoder.weight.device
        wd = torch.bfloat16 if self.lp else model.decoder.weight.dtype
        if self.ext is None:  # i, f, g, o -> i, f, o, g: one sigmoid over (B, 3H)
            perm = torch.cat([torch.arange(0, 2 * H), torch.arange(3 * H, 4 * H),
                              torch.arange(2 * H, 3 * H)]).to(dev)
        else:
            perm = torch.arange(4 * H, device=dev)
        first = model.layers[0]
        emb = model.embedding.weight  # (V, E)
        if self.looked_up:
            self.table = torch.addmm(first.bias, emb, first.weight_ih.t())[:, perm].contiguous()  # (V, 4H)
        else:
            self.table = None
            self.emb = emb.detach().clone()  # (V, E)
            self.w_in0 = first.weight_ih[perm].t().contiguous()  # (E, 4H), in the model's dtype
            self.b0 = first.bias[perm].contiguous()  # (4H,)
        self.w_hh = [layer.weight_hh[perm].t().to(wd).contiguous() for layer in model.layers]  # (H, 4H)
        self.w_ih = [layer.weight_ih[perm].t().to(wd).contiguous() for layer in model.layers]  # (I, 4H)
        self.bias = [layer.bias[perm].to(wd).contiguous() for layer in model.layers]  # (4H,)
        self.dec_w = model.decoder.weight.t().contiguous()  # (H, V)
        self.dec_b = model.decoder.bias.detach().clone()  # (V,)

    def _pack_decoder(self, model: ZoneoutLM):
        """The C++ Decoder over packed copies of the weights, sharing self.h and self.c."""
        return build_decoder(self.ext, model, self.h, self.c, self.lp, self.threads,
                             layer0="table" if self.looked_up else "embed")

    def set_state(self, h: Tensor, c: Tensor) -> None:
        """h, c: (L, 1 or B, H), broadcast over the B streams."""
        self.h.copy_(h.expand_as(self.h))
        self.c.copy_(c.expand_as(self.c))
        if self.h_lp is not None:
            self.h_lp.copy_(self.h)

    def __call__(self, tok: Tensor, out: Tensor | None = None) -> Tensor:
        """tok: (B,) int64 -> logits (B, V): `out` if given (contiguous fp32 (B, V)), else a
        buffer overwritten by the next call."""
        out = self.logits if out is None else out
        if self.kernel == "decode":
            self.decoder.step(tok if tok.dtype == torch.long else tok.long(), out)
            return out
        if self.graphs:
            if self.graph is None:
                self.graph = self.capture(lambda t: (self._step(t, self.logits),), (tok,),
                                          snapshot=self._keep_state)
            (logits,) = self.graph(tok)
            return out if out is logits else out.copy_(logits)
        return self._step(tok, out)

    def _step(self, tok: Tensor, out: Tensor) -> Tensor:
        x = self._layers_compiled(tok) if self.ext is not None else self._layers_torch(tok)
        return torch.addmm(self.dec_b, x, self.dec_w, out=out)

    def _keep_state(self):
        """The state now; the result puts it back (after a capture's warm-up steps)."""
        h, c = self.h.clone(), self.c.clone()
        return lambda: (self.h.copy_(h), self.c.copy_(c))

    def _input0(self, tok: Tensor, g: Tensor) -> None:
        """g (B, 4H) = layer 0's input projection E[tok] W_ih^T + b: the table's rows, or one product."""
        if self.table is not None:
            torch.index_select(self.table, 0, tok, out=g)
        else:
            torch.index_select(self.emb, 0, tok, out=self.x0)
            torch.addmm(self.b0, self.x0, self.w_in0, out=g)

    def _layers_compiled(self, tok: Tensor) -> Tensor:
        for k, g in enumerate(self.gates):
            h, c = self.h[k], self.c[k]  # (B, H), updated in place by the C++ step
            if k == 0:
                self._input0(tok, g)
            elif self.lp:
                g.copy_(torch.addmm(self.bias[k], self.h_lp[k - 1], self.w_ih[k]))
            else:
                torch.addmm(self.bias[k], self.h[k - 1], self.w_ih[k], out=g)
            if self.lp:
                rec = torch.mm(self.h_lp[k], self.w_hh[k], out=self.rec)  # (B, 4H) bf16
                h_lp = self.h_lp[k]
            else:
                rec, h_lp = None, None
                g.addmm_(h, self.w_hh[k])
            self.ext.forward_step(g, rec, g, c, h, None, self.keep_c[k], None, self.keep_h[k],
                                  c, self.tanh_c, h, h_lp)
        return self.h[-1]

    def _layers_torch(self, tok: Tensor) -> Tensor:
        x = None
        for k, g in enumerate(self.gates):
            h, c = self.h[k], self.c[k]  # (B, H)
            sig, tnh, i, f, o, gg = self.views[k]
            if k == 0:
                self._input0(tok, g)
            else:
                torch.addmm(self.bias[k], x, self.w_ih[k], out=g)
            g.addmm_(h, self.w_hh[k])
            sig.sigmoid_()
            tnh.tanh_()
            torch.mul(f, c, out=self.c_new)
            self.c_new.addcmul_(i, gg)  # c~ = f c + i g
            torch.tanh(self.c_new, out=self.tanh_c)
            torch.mul(o, self.tanh_c, out=self.h_new)  # h~ = o tanh(c~)
            _zone(c, self.c_new, self.keep_c[k])
            _zone(h, self.h_new, self.keep_h[k])
            x = h
        return x


def _zone(state: Tensor, new: Tensor, keep: float) -> None:
    """state = keep * state + (1 - keep) * new, in place (eval-mode zoneout)."""
    if keep == 0.0:
        state.copy_(new)
    else:
        state.lerp_(new, 1.0 - keep)



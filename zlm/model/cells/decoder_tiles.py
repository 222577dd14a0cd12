"""The C++ `Decoder` (csrc/decoder.cpp) from Python: its weights packed into tiles, and the
eval-mode features of a window stepped through it.

The Decoder steps a whole model one token per stream in one call, on weights packed once
into tiles of DECODER_TILE (32) columns with the four gates of DECODER_UNITS (8) units side
by side (`gate_columns`, `interleave`, `pack_tiles`; the constants:
`zlm.model.cells.kernel_constants`). `zlm sample`, `zlm serve` and `zlm compress` step it
token by token (`zlm.inference.stepper.Stepper`).

`stepped_features` runs a scoring window through it: `Decoder.run` steps the window's T
tokens in one call and returns the top layer's h after each, what `ZoneoutLM.features`
returns in eval mode. Layer 0's input projection is the Decoder's table of every token's
(V, 4H) where that takes at most TABLE_MAX_BYTES, else one matrix product per window. With
a few streams a window's recurrence is a chain of small products, which the Decoder's
tiles split over the cores in one pass over the weights per 4 streams, each tile's
element-wise step done by the thread that computed it; the window path (the fused cell's
forward, one matrix product and one element-wise call per step) pays for a product shaped
for larger batches. `ZoneoutLM.features` takes this path in eval mode without gradients on
the CPU for at most `max_streams` streams (`step_weights` gives the rest of the
conditions): what `zlm eval --cache`, `zlm eval --dynamic`'s plain score, `zlm eval
--batch-size 1` and `zlm score` run, and with the AVX2 product `zlm eval` and training's
validation at their 16 streams too. Measured against the window path: docs/speed.md,
"Scoring one stream".
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from zlm.model.cells.cpu_ext import load_extension
from zlm.model.cells.kernel_constants import DECODER_TILE, DECODER_UNITS
from zlm.model.cells.packed_gemm import cached

# The most streams `stepped_features` takes, by the Decoder's product (`decoder_kernel()`).
# With the AVX2 product the Decoder was ahead of the window path at every count measured, up
# to the eval protocol's 16 streams. Elsewhere the two paths have not been compared, and what
# was measured on such CPUs points to the window path for many streams (docs/speed.md,
# "Scoring one stream"), so those builds keep the few streams where a matrix-vector product wins.
# `scripts/stepped-speed` compares the two paths on any CPU, fp32 and (AVX512-BF16) bf16.
STEPPED_MAX_STREAMS = {"avx2": 16}
STEPPED_MAX_STREAMS_ELSEWHERE = 4

# The largest table of layer 0's pre-activations per token (V x 4H fp32) a stepped Decoder
# keeps: a token's row is a lookup where the window path computes one product per window,
# but a sentencepiece vocabulary's table would take hundreds of MB per cached Decoder.
TABLE_MAX_BYTES = 32 << 20


def gate_columns(H: int) -> Tensor:
    """(Np,) int64, Np = ceil(H / DECODER_UNITS) * DECODER_TILE: for each packed column, the
    column of a (.., 4H) gate matrix (blocks i, f, g, o) it takes, or 4H for a zero pad;
    tile t holds the four gates of units 8t .. 8t+7, 8 columns each."""
    tiles = -(-H // DECODER_UNITS)
    unit = torch.arange(tiles).view(tiles, 1, 1) * DECODER_UNITS + torch.arange(DECODER_UNITS).view(1, 1, -1)
    col = torch.arange(4).view(1, 4, 1) * H + unit  # (tiles, 4, DECODER_UNITS)
    return torch.where(unit < H, col, 4 * H).reshape(-1)


def interleave(m: Tensor, H: int) -> Tensor:
    """(.., 4H) gate columns -> (.., Np) in the Decoder's order (zeros in the pads)."""
    pad = torch.cat([m, m.new_zeros(*m.shape[:-1], 1)], -1)
    return pad[..., gate_columns(H).to(m.device)].contiguous()


def pack_tiles(w: Tensor) -> Tensor:
    """A right operand (K, N) -> (ceil(N / DECODER_TILE), K, DECODER_TILE) contiguous tiles
    (zero-padded)."""
    K, N = w.shape
    n = -(-N // DECODER_TILE) * DECODER_TILE
    w = torch.cat([w, w.new_zeros(K, n - N)], 1) if n > N else w
    return w.reshape(K, n // DECODER_TILE, DECODER_TILE).permute(1, 0, 2).contiguous()


def table_fits(model) -> bool:
    """Whether layer 0's table of every token's pre-activations (V, Np) fp32 takes at most
    TABLE_MAX_BYTES."""
    return model.config.vocab_size * len(gate_columns(model.config.hidden)) * 4 <= TABLE_MAX_BYTES


LAYER0 = ("table", "given", "embed")


@torch.no_grad()
def build_decoder(ext, model, h: Tensor, c: Tensor, lp: bool, threads: int, layer0: str = "table"):
    """The C++ Decoder over packed copies of `model`'s weights (a `ZoneoutLM`, fp32), stepping
    the state h, c (L, B, H) fp32 in place. lp: bf16 weights (h, c and the sums stay fp32).
    layer0, where layer 0's input projection x W_ih^T + b comes from:
    "table": a table of every token's, E W_ih^T + b (V, Np), read by token (`step`, `run`);
    "given": the caller's, per window (`run` only); one row of zeros stands in for the table;
    "embed": the token's embedding (V, E) and W_ih packed beside W_hh, one row of products
    more per step (`step`, `run`): a large vocabulary's table would take hundreds of MB.
    Each row is computed alike in every mode but "given" whatever the other rows."""
    if layer0 not in LAYER0:
        raise ValueError(f"layer0 must be one of {LAYER0}, got {layer0!r}")
    H = model.config.hidden
    wd = torch.bfloat16 if lp else torch.float32
    first = model.layers[0]
    if layer0 == "table":
        table = interleave(torch.addmm(first.bias, model.embedding.weight, first.weight_ih.t()), H)  # (V, Np)
    elif layer0 == "given":
        table = torch.zeros(1, len(gate_columns(H)))
    else:
        table = model.embedding.weight.detach().float().contiguous().clone()  # (V, E)
    weights, biases = [], []
    for k, layer in enumerate(model.layers):
        w = layer.weight_hh.t() if k == 0 and layer0 != "embed" else torch.cat([layer.weight_ih.t(), layer.weight_hh.t()], 0)
        weights.append(pack_tiles(interleave(w, H)).to(wd))  # (tiles, K, DECODER_TILE)
        biases.append(interleave(layer.bias, H) if k or layer0 == "embed" else torch.empty(0))
    dec_w = pack_tiles(model.decoder.weight.t())  # (ceil(V / DECODER_TILE), H, DECODER_TILE)
    return ext.Decoder(table, weights, biases, dec_w, model.decoder.bias.detach().clone(), h, c,
                       [float(layer.zoneout_cell) for layer in model.layers],
                       [float(layer.zoneout_hidden) for layer in model.layers], int(threads))


def _weights(model) -> tuple[Tensor, ...]:
    parts = [model.embedding.weight, model.decoder.weight, model.decoder.bias]
    for layer in model.layers:
        parts += [layer.weight_ih, layer.weight_hh, layer.bias]
    return tuple(parts)


def max_streams(ext) -> int:
    """The most streams `stepped_features` takes with this build's Decoder."""
    return STEPPED_MAX_STREAMS.get(ext.decoder_kernel(), STEPPED_MAX_STREAMS_ELSEWHERE)


def step_weights(model, tokens: Tensor) -> torch.dtype | None:
    """The weights `stepped_features` runs this window with, or None where it does not run
    it. It runs eval mode without gradients on the CPU, fp32 weights, at most
    `max_streams` streams, not under a tracer, with the compiled Decoder: fp32 without autocast; bf16
    under bf16 autocast where the Decoder rounds h to bf16 for each product as autocast's
    matmuls round their inputs (AVX512-BF16), not where it would widen the weights instead."""
    if model.training or torch.is_grad_enabled():  # first: a training step pays for nothing else
        return None
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return None  # a tracer sees the cell's torch ops (before any test of a shape it may keep dynamic)
    if tokens.device.type != "cpu" or model.embedding.weight.dtype != torch.float32 or tokens.dim() != 2:
        return None
    ext = load_extension()
    if ext is None or tokens.shape[1] > max_streams(ext):
        return None
    if not torch.is_autocast_enabled("cpu"):
        return torch.float32
    if torch.get_autocast_dtype("cpu") == torch.bfloat16 and ext.decoder_kernel() == "avx512-bf16dot":
        return torch.bfloat16
    return None


def stepped_features(model, tokens: Tensor, state: tuple[Tensor, Tensor],
                     weights: torch.dtype = torch.float32) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """`ZoneoutLM.features` in eval mode through the Decoder (`step_weights` says when and
    gives `weights`): tokens (T, B) int64, state (h, c) each (L, B, H) -> the top layer's h
    after each token (T, B, H) fp32 and the final state. The Decoder is packed once per set
    of weights (`packed_gemm.cached`)."""
    T, B = tokens.shape
    L, H = model.config.layers, model.config.hidden
    threads = torch.get_num_threads()
    lp = weights == torch.bfloat16
    zones = tuple((float(layer.zoneout_cell), float(layer.zoneout_hidden)) for layer in model.layers)

    table = table_fits(model)

    def make():
        with torch.inference_mode(False):  # buffers that later calls outside inference mode may write
            h = torch.zeros(L, B, H)
            c = torch.zeros(L, B, H)
        first = model.layers[0]
        w_ih = None if table else interleave(first.weight_ih.detach().t(), H)  # (E, Np)
        bias = None if table else interleave(first.bias.detach(), H)  # (Np,)
        return build_decoder(load_extension(), model, h, c, lp, threads,
                             layer0="table" if table else "given"), h, c, w_ih, bias

    # One Decoder (and state buffers) per calling thread: two threads scoring with one model
    # never share the h, c it steps.
    key = ("stepped", B, lp, threads, zones, threading.get_ident())
    decoder, h, c, w_ih, bias = cached(key, _weights(model), make)
    h.copy_(state[0])
    c.copy_(state[1])
    if table:  # layer 0 reads each token's row of the table
        given = tokens.long().contiguous()
    else:  # layer 0's pre-activations as the window path computes them: one product
        emb = model.embedding(tokens).reshape(T * B, -1)  # (T*B, E); eval mode: no dropout
        given = torch.addmm(bias, emb, w_ih).view(T, B, -1)  # (T, B, Np)
    out = torch.empty(T, B, H)
    decoder.run(given, out)
    return out, (h.clone(), c.clone())

"""The per-step matrix multiplies of the fused CPU cells: packed oneDNN weights, or addmm.

The recurrence issues one small matrix multiply per timestep (forward: h_prev W_hh^T,
(B, H) x (H, 4H); backward: dpre W_hh, (B, 4H) x (4H, H)), so the library behind it sets
the ceiling on speed. A `RecurrentGemm` holds one weight W (N, K) in the form its backend
wants:

- "onednn": W reordered ("packed") once into oneDNN's blocked layout for one batch size,
  so no call reorders it again, and the addition of the input projection runs inside the
  same call. fp32 on the CPU, and bf16 where the CPU has native bf16 (AVX512-BF16 or AMX;
  elsewhere oneDNN has no bf16 kernels);
- "mkl": W^T packed by MKL's packed GEMM for one batch size (`mkl_pack` of zlm's C++
  extension, whose fp32 time loops then call MKL directly): fp32 windows of the compiled
  cell, where torch carries MKL (`zlm.model.cells.compiled.recurrent_backend`);
- "amx": W^T in bf16, cut into blocks of columns in the layout AMX reads (`amx_pack`), for
  oneDNN's micro-kernel, which the bf16 time loops call directly (any batch size); the
  product comes back fp32: bf16 windows on CPUs with AMX (same function);
- "addmm": W^T as a contiguous (K, N) copy for `torch.addmm` (MKL): fp64, CUDA tensors, a
  torch without oneDNN, and the single-step inference path (the cell called with T = 1):
  oneDNN splits even a batch-1 product over all threads, so while another process holds a
  core every call waits for the descheduled thread, where MKL's GEMV degrades gracefully.

How the two compare on one machine: docs/kernels.md. A `RecurrentGemm` is built once per
training window (the weights change after every optimizer step); for inference it is
cached, so a caller that steps the cell one token at a time packs the weights once, not
once per token.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor

_MAX_CACHED = 16  # packed weights kept: a few layers x (forward, backward) x batch sizes, Decoders


def _onednn_ready() -> bool:
    """Whether this torch build has the packed-weight oneDNN linear ops."""
    try:
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018 - attribute lookup is the check
        torch.ops.mkldnn._linear_pointwise.binary  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return torch.backends.mkldnn.is_available()


def _onednn_bf16_ready() -> bool:
    """Whether oneDNN runs bf16 natively here (AVX512-BF16 or AMX): packed bf16 weights."""
    try:
        return ONEDNN and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


ONEDNN = _onednn_ready()
ONEDNN_BF16 = _onednn_bf16_ready()


def backend_for(dtype: torch.dtype, device: torch.device) -> str:
    """'onednn' (packed weights) on the CPU for fp32 when available and for bf16 where the
    CPU has native bf16 (elsewhere oneDNN has no bf16 kernels), else 'addmm'."""
    if device.type == "cpu" and ((dtype == torch.float32 and ONEDNN) or (dtype == torch.bfloat16 and ONEDNN_BF16)):
        return "onednn"
    return "addmm"


class RecurrentGemm:
    """`other + a @ W^T` or `a @ W^T + bias` for one fixed weight W (N, K), small a (B, K)."""

    def __init__(self, weight: Tensor, batch: int, bias: Tensor | None = None, backend: str | None = None,
                 ext=None):
        self.backend = backend or backend_for(weight.dtype, weight.device)
        self.shape = tuple(weight.shape)  # (N, K)
        self._bias = bias  # (N,) or None
        self._ext = ext  # the C++ extension ("mkl" and "amx" only)
        if self.backend == "mkl":
            self._packed = ext.mkl_pack(weight.contiguous(), batch)  # a byte tensor, for `batch` rows
        elif self.backend == "amx":
            # (N/nb, K, nb) bf16 from W^T (K, N); a transposed view of a contiguous W^T costs no copy
            self._packed = ext.amx_pack(weight.t().contiguous())
        elif self.backend == "onednn":
            # (N, K) reordered into oneDNN's blocked layout for batch size `batch`
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch)
        else:
            self._wt = weight.t().contiguous()  # (K, N): MKL's GEMV is faster on this layout

    @property
    def packed(self) -> Tensor:
        """The packed weight (backends "onednn", "mkl" and "amx"), for the C++ time loop."""
        return self._packed

    def add(self, a: Tensor, other: Tensor, out: Tensor) -> Tensor:
        """other + a @ W^T: a (B, K), other (B, N) -> (B, N), not modifying `other`.

        The result is a new tensor on the oneDNN path and `out`, a preallocated (B, N)
        buffer, on the addmm path.
        """
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise.binary(a, other, self._packed, None, "add")
        if self.backend == "mkl":
            self._ext.mkl_packed_mm(a.contiguous(), self._packed, 1.0, out.copy_(other))
            return out
        if self.backend == "amx":
            return torch.add(other, self._amx_mm(a), out=out)
        return torch.addmm(other, a, self._wt, out=out)

    def mm(self, a: Tensor) -> Tensor:
        """a @ W^T + bias: a (B, K) -> a new (B, N) (fp32 from "amx")."""
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(a, self._packed, self._bias, "none", [], "")
        if self.backend == "mkl":
            out = torch.empty(a.shape[0], self.shape[0], dtype=a.dtype)
            if self._bias is not None:
                out.copy_(self._bias.expand_as(out))  # a fresh buffer: never the bias itself
            self._ext.mkl_packed_mm(a.contiguous(), self._packed, 0.0 if self._bias is None else 1.0, out)
            return out
        if self.backend == "amx":
            out = self._amx_mm(a)
            return out if self._bias is None else out.add_(self._bias)
        if self._bias is None:
            return torch.mm(a, self._wt)
        return torch.addmm(self._bias, a, self._wt)

    def _amx_mm(self, a: Tensor) -> Tensor:
        """a @ W^T in fp32 through AMX, (B, N) contiguous: the packed product's rows are padded
        to a multiple of 16 columns."""
        return self._ext.amx_mm(a.contiguous(), self._packed)[:, : self.shape[0]].contiguous()


def mm_nt(a: Tensor, b: Tensor) -> Tensor:
    """a @ b^T for contiguous fp32 CPU matrices a (M, K), b (N, K) -> (M, N), by oneDNN.

    The weight gradients of a window (dW = dpre^T h_prev over T*B rows) are large products,
    which oneDNN runs faster than `torch.mm` (MKL) when both operands are already contiguous
    (docs/kernels.md).
    """
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


Build = Callable[..., "tuple[Tensor, Tensor | None]"]
_cache: dict[tuple, tuple] = {}
_PROBE = 64  # elements of each source compared on every cache hit


def _probe(t: Tensor) -> Tensor:
    """A strided view of a few elements spread over a tensor (compared against a copy)."""
    flat = t.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // _PROBE)]


def _stamp(t: Tensor) -> tuple:
    return (t._version, t.data_ptr())


def recurrent_gemm(
    sources: tuple[Tensor, ...],
    batch: int,
    tag: str,
    build: Build,
    cache: bool = False,
    backend: str | None = None,
    ext=None,
) -> RecurrentGemm:
    """The `RecurrentGemm` for the weight and bias `build(*sources)` returns.

    Training packs once per window (the weights change after every optimizer step, and
    the reorder costs far less than the T steps that use it). With `cache=True` - for
    inference, where a caller may step the cell one token at a time - the packed weight
    is reused while every source is the same tensor at the same address and version and
    a probe of a few of its elements is unchanged (the probe catches writes through
    `.data`, which do not bump the version). `tag` names what `build` derives; `backend`
    forces one (default: `backend_for`); "mkl" and "amx" need `ext`, the C++ extension that packs.
    """
    if not cache:
        with torch.no_grad():
            return _make(sources, batch, build, backend, ext)
    return cached(("gemm", tag, batch, backend), sources, lambda: _make(sources, batch, build, backend, ext))


def cached(key: tuple, sources: tuple[Tensor, ...], make: Callable[[], object]):
    """`make()`'s result (built without grad), reused for the same `key` while every source
    is the same tensor at the same address and version and a probe of a few of its
    elements is unchanged (the probe catches writes through `.data`, which do not bump the
    version). Packed forms of weights derive from `sources`; `key` says what else they
    depend on. Inference-mode tensors have no version counter: built every call."""
    with torch.no_grad():
        try:
            stamps = tuple(_stamp(s) for s in sources)
        except RuntimeError:
            return make()
        key = (*key, tuple(id(s) for s in sources))
        hit = _cache.get(key)
        if (
            hit is not None
            and all(r() is s for r, s in zip(hit[0], sources, strict=True))
            and hit[1] == stamps
            and all(torch.equal(view, copy) for view, copy in hit[2])
        ):
            return hit[3]
        made = make()
        if len(_cache) >= _MAX_CACHED:  # drop entries whose sources are gone, then the oldest
            for k in [k for k, v in _cache.items() if any(r() is None for r in v[0])]:
                del _cache[k]
            while len(_cache) >= _MAX_CACHED:
                del _cache[next(iter(_cache))]
        refs = tuple(weakref.ref(s) for s in sources)
        probes = tuple((v, v.clone()) for v in map(_probe, sources))  # (live view, copy)
        _cache[key] = (refs, stamps, probes, made)
        return made


def _make(sources: tuple[Tensor, ...], batch: int, build: Build, backend: str | None, ext=None) -> RecurrentGemm:
    weight, bias = build(*sources)
    return RecurrentGemm(weight, batch, bias, backend, ext)


def clear_cache() -> None:
    """Forget every packed weight (tests; freeing memory)."""
    _cache.clear()

"""The per-step matrix multiplies of the fused CPU cell: packed oneDNN weights, or addmm.

The recurrence issues one small matrix multiply per timestep (forward: h_prev W_hh^T,
backward: dgates W_hh), so the library behind it sets the ceiling on speed. Measured on
a 2-core AVX-512 machine (torch 2.13, fp32), oneDNN with the weight reordered ("packed")
once into its blocked layout ran these shapes 1.4-2.3x faster per call than
`torch.addmm` into a preallocated output (MKL), and it can fuse the addition of the input
projection into the same call. oneDNN here takes fp32 (not fp64), so anything else - fp64,
CUDA tensors, a torch without oneDNN - uses `torch.addmm`.

A `RecurrentGemm` is built once per training window (the weights change after every
optimizer step); for inference it is cached, so a sampler that calls the cell one
character at a time packs the weights once, not once per character.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor

_MAX_CACHED = 16  # packed weights kept: a few layers x (forward, backward) x batch sizes


def _onednn_ready() -> bool:
    """Whether this torch build has the packed-weight oneDNN linear ops."""
    try:
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018 - attribute lookup is the check
        torch.ops.mkldnn._linear_pointwise.binary  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return torch.backends.mkldnn.is_available()


ONEDNN = _onednn_ready()


def backend_for(dtype: torch.dtype, device: torch.device) -> str:
    """'onednn' (packed weights) for fp32 on CPU when available, else 'addmm'."""
    if ONEDNN and device.type == "cpu" and dtype == torch.float32:
        return "onednn"
    return "addmm"


class RecurrentGemm:
    """`out = other + a @ W^T` for one fixed weight W (N, K) and many small a (B, K).

    `other` is (B, N) and is not modified; the result is a new (B, N) tensor on the oneDNN
    path and `out` on the addmm path (pass a preallocated (B, N) buffer).
    """

    def __init__(self, weight: Tensor, batch: int):
        self.backend = backend_for(weight.dtype, weight.device)
        self.shape = tuple(weight.shape)  # (N, K)
        if self.backend == "onednn":
            # (N, K) reordered into oneDNN's blocked layout for batch size `batch`
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch)
        else:
            self._wt = weight.t()  # (K, N) view; addmm reads the transpose directly

    def add(self, a: Tensor, other: Tensor, out: Tensor) -> Tensor:
        """other + a @ W^T: a (B, K), other (B, N) -> (B, N)."""
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise.binary(a, other, self._packed, None, "add")
        return torch.addmm(other, a, self._wt, out=out)

    def mm(self, a: Tensor, bias: Tensor | None = None) -> Tensor:
        """a @ W^T (+ bias): a (B, K) -> a new (B, N)."""
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(a, self._packed, bias, "none", [], "")
        return torch.mm(a, self._wt) if bias is None else torch.addmm(bias, a, self._wt)


_cache: dict[tuple, tuple] = {}
_PROBE = 64  # weight elements compared on every cache hit


def _probe(weight: Tensor) -> Tensor:
    """A few elements spread over the weight: a cheap check that it was not rewritten."""
    flat = weight.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // _PROBE)].clone()


def recurrent_gemm(
    weight: Tensor,
    batch: int,
    tag: str = "",
    derive: Callable[[Tensor], Tensor] | None = None,
    cache: bool = False,
) -> RecurrentGemm:
    """The `RecurrentGemm` for `derive(weight)` (default: the weight itself).

    Training packs the weights once per window (they change after every optimizer step;
    the reorder costs far less than the T steps that use it). With `cache=True` - for
    inference, where a sampler calls the cell one character at a time - the packed weight
    is reused while the weight is the same tensor, at the same address and version, and a
    probe of a few of its elements is unchanged (the probe catches writes through
    `.data`, which do not bump the version). `tag` names the derivation ("T" for the
    transpose) so that derived weights do not collide.
    """
    if not cache:
        with torch.no_grad():
            return RecurrentGemm(derive(weight) if derive else weight, batch)
    with torch.no_grad():
        try:
            version = weight._version
        except RuntimeError:  # an inference-mode tensor has no version counter
            return RecurrentGemm(derive(weight) if derive else weight, batch)
        key = (id(weight), tag, batch, weight.dtype, weight.device)
        hit = _cache.get(key)
        if (
            hit is not None
            and hit[0]() is weight
            and hit[1] == (version, weight.data_ptr())
            and torch.equal(hit[2], _probe(weight))
        ):
            return hit[3]
        gemm = RecurrentGemm(derive(weight) if derive else weight, batch)
        if len(_cache) >= _MAX_CACHED:  # drop entries whose weights are gone, then the oldest
            for k in [k for k, v in _cache.items() if v[0]() is None]:
                del _cache[k]
            while len(_cache) >= _MAX_CACHED:
                del _cache[next(iter(_cache))]
        _cache[key] = (weakref.ref(weight), (version, weight.data_ptr()), _probe(weight), gemm)
        return gemm


def clear_cache() -> None:
    """Forget every packed weight (tests; freeing memory)."""
    _cache.clear()

"""Device and precision, resolved once into one small object.

Nothing downstream branches on strings: the trainer asks the `Runtime` for an autocast
context and a gradient scaler. Recurrent state, the loss and softmax stay in fp32
(`zlm.model.token_nll` upcasts the logits).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from zlm.errors import UsageError

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Runtime:
    """Where the model runs and in which precision."""

    device: torch.device
    precision: str  # "fp32" | "bf16" | "fp16"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return _DTYPES[self.precision]

    def autocast(self, cache: bool = True):
        """Autocast for the forward pass (a no-op in fp32). cache=False inside a CUDA graph
        capture: autocast's cast-weight cache must not outlive the captured region."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=cache)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler, enabled only for fp16 (its state is checkpointed)."""
        return torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")

    def describe(self) -> str:
        return f"{self.device} {self.precision}"


def resolve_runtime(device: str = "auto", precision: str = "auto", local_rank: int = 0) -> Runtime:
    """`--device auto|cpu|cuda` and `--precision auto|fp32|bf16|fp16` -> a Runtime.

    auto device: CUDA when available. auto precision: bf16 on CUDA where supported,
    fp16 (with a GradScaler) on older GPUs, fp32 on CPU.
    """
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}; pass --device auto, cpu or cuda")
    if precision not in PRECISIONS:
        raise UsageError(f"unknown precision {precision!r}; pass --precision auto, fp32, bf16 or fp16")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is available; pass --device cpu")
    dev = torch.device(device, local_rank) if device == "cuda" else torch.device("cpu")
    if precision == "auto":
        if dev.type == "cpu":
            precision = "fp32"
        else:
            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if dev.type == "cpu" and precision == "fp16":
        raise UsageError("--precision fp16 needs a GPU; pass --precision fp32 or bf16 on CPU")
    return Runtime(dev, precision)

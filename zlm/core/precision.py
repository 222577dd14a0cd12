"""Device and precision, resolved once into one small object.

Nothing downstream branches on strings: the trainer asks the `Runtime` for an autocast
context and a gradient scaler. Recurrent state, the loss and softmax stay in fp32
(`zlm.model.token_nll` upcasts the logits).

`--precision auto` is decided here and only here (`resolve_precision`): on CUDA bf16 where
supported, else fp16; on the CPU bf16 where the CPU has native bf16 arithmetic (AVX512-BF16
or AMX: oneDNN then runs bf16 matrix multiplies several times faster than fp32), else
fp32 - on other CPUs bf16 is emulated and far slower. Under CPU bf16 autocast the fused
cell runs its matrix multiplies in bf16 and keeps h, c and the gate arithmetic in fp32
(`zlm.model.cells.compiled`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from zlm.core.config import DEVICES, PRECISIONS  # noqa: F401 (re-exported)
from zlm.errors import UsageError
from zlm.model.cells.cpu_ext import cpu_flags, cpu_name

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


def cpu_bf16_native(flags: set[str] | None = None) -> bool:
    """Whether this CPU does bf16 arithmetic natively (AVX512-BF16 or AMX).

    flags: CPU feature flags to decide from (default: this CPU's, and oneDNN's own check).
    """
    if flags is None:
        try:
            if torch.ops.mkldnn._is_mkldnn_bf16_supported():
                return True
        except (AttributeError, RuntimeError):
            pass
        flags = cpu_flags()
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def resolve_precision(device: torch.device | str, requested: str = "auto") -> str:
    """A concrete precision ("fp32" | "bf16" | "fp16") for `requested` on `device`.

    "auto": on CUDA bf16 where supported, else fp16 (with a GradScaler); on the CPU bf16
    where `cpu_bf16_native()`, else fp32. Anything else is checked and returned as is.
    """
    device = torch.device(device)
    if requested not in PRECISIONS:
        raise UsageError(f"unknown precision {requested!r}; pass --precision auto, fp32, bf16 or fp16")
    if requested == "auto":
        if device.type == "cpu":
            return "bf16" if cpu_bf16_native() else "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if device.type == "cpu" and requested == "fp16":
        raise UsageError("--precision fp16 needs a GPU; pass --precision fp32 or bf16 on CPU")
    return requested


def precision_reason(device: torch.device | str, precision: str, requested: str = "auto") -> str:
    """One line saying why `precision` was chosen (printed at start)."""
    if requested != "auto":
        return f"--precision {requested}"
    if torch.device(device).type == "cpu":
        return ("auto: this CPU has native bf16 (AVX512-BF16/AMX)" if precision == "bf16"
                else "auto: this CPU has no native bf16 (AVX512-BF16/AMX), so fp32")
    return f"auto: {precision} on this GPU"


def resolve_device(device: str = "auto", local_rank: int = 0) -> torch.device:
    """`--device auto|cpu|cuda` -> a torch.device (auto: CUDA when available; GPU local_rank)."""
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}; pass --device auto, cpu or cuda")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is available; pass --device cpu")
    return torch.device(device, local_rank) if device == "cuda" else torch.device("cpu")


def machine_name(device: torch.device) -> str:
    """What a run's speed depends on, for its log: the GPU's name on CUDA, else the CPU's
    model name and the threads torch uses ("Intel(R) Xeon(R) Processor, 2 threads")."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()}, {torch.get_num_threads()} threads"


def resolve_runtime(device: str = "auto", precision: str = "auto", local_rank: int = 0) -> Runtime:
    """`--device auto|cpu|cuda` and `--precision auto|fp32|bf16|fp16` -> a Runtime.

    auto device: CUDA when available. auto precision: see `resolve_precision`.
    """
    if precision not in PRECISIONS:
        raise UsageError(f"unknown precision {precision!r}; pass --precision auto, fp32, bf16 or fp16")
    dev = resolve_device(device, local_rank)
    return Runtime(dev, resolve_precision(dev, precision))

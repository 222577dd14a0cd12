"""Where `--precision auto` lands, decided in one place (`zlm.core.precision`)."""

from __future__ import annotations

import pytest
import torch

from zlm.core import precision
from zlm.errors import UsageError


@pytest.mark.parametrize("flags, native", [
    ({"avx2", "fma"}, False),
    ({"avx512f", "avx512_bf16"}, True),
    ({"amx_bf16", "amx_tile"}, True),
    (set(), False),
])
def test_native_bf16_from_cpu_flags(flags, native):
    assert precision.cpu_bf16_native(flags) is native


@pytest.mark.parametrize("native, want", [(True, "bf16"), (False, "fp32")])
def test_auto_on_cpu_follows_native_bf16(monkeypatch, native, want):
    monkeypatch.setattr(precision, "cpu_bf16_native", lambda flags=None: native)
    assert precision.resolve_precision("cpu", "auto") == want
    assert precision.resolve_runtime("cpu", "auto").precision == want
    assert want in precision.precision_reason("cpu", want, "auto")


@pytest.mark.parametrize("requested", ["fp32", "bf16"])
def test_explicit_precision_is_kept(monkeypatch, requested):
    monkeypatch.setattr(precision, "cpu_bf16_native", lambda flags=None: requested == "fp32")
    assert precision.resolve_precision("cpu", requested) == requested


def test_fp16_and_unknown_refused_on_cpu():
    with pytest.raises(UsageError, match="fp16 needs a GPU"):
        precision.resolve_precision("cpu", "fp16")
    with pytest.raises(UsageError, match="unknown precision"):
        precision.resolve_precision("cpu", "int8")


def test_bf16_runtime_autocasts_cpu_to_bf16(monkeypatch):
    rt = precision.resolve_runtime("cpu", "bf16")
    with rt.autocast():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16

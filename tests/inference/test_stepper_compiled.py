"""The sampler's step with the compiled C++ step (fp32, bf16 weights) against the model."""

from __future__ import annotations

import pytest
import torch

import zlm.inference.sample as sample
from zlm.inference.sample import Stepper
from zlm.model.cells import cpu_ext
from zlm.model.lm import ModelConfig, ZoneoutLM


def _model(layers):
    torch.manual_seed(0)
    return ZoneoutLM(ModelConfig(vocab_size=13, hidden=24, embed=8, layers=layers)).eval()


def _rollout(step, model, tokens):
    h0 = torch.randn(model.config.layers, 3, 24, generator=torch.Generator().manual_seed(1)) * 0.5
    step.set_state(h0, h0 * 0.7)
    with torch.no_grad():
        ref, _ = model(tokens, (h0, h0 * 0.7))  # (T, B, V)
        got = torch.stack([step(tokens[t]).clone() for t in range(tokens.shape[0])])
    return got, ref


@pytest.mark.parametrize("layers", [1, 2])
def test_compiled_step_matches_forward_fp32_and_bf16(layers):
    if cpu_ext.load_extension() is None:
        pytest.skip(f"no compiled step: {cpu_ext.unavailable_reason()}")
    model = _model(layers)
    tokens = torch.randint(0, 13, (30, 3), generator=torch.Generator().manual_seed(2))
    step = Stepper(model, 3)
    assert step.ext is not None and not step.lp
    got, ref = _rollout(step, model, tokens)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    step = Stepper(model, 3, lp=True)  # bf16 weights, fp32 state: 2e-2 relative
    got, ref = _rollout(step, model, tokens)
    assert step.lp and ((got - ref).norm() / ref.norm()).item() < 2e-2


def test_torch_step_without_the_extension(monkeypatch):
    monkeypatch.setattr(sample, "load_extension", lambda: None)
    model = _model(2)
    step = Stepper(model, 3, lp=True)  # no compiled step: fp32 torch ops, lp ignored
    assert step.ext is None and not step.lp
    tokens = torch.randint(0, 13, (10, 3), generator=torch.Generator().manual_seed(3))
    got, ref = _rollout(step, model, tokens)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)

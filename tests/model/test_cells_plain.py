"""The plain cell (torch's LSTM kernel on zlm's parameters) equals the zoneout cells at z = 0."""

from __future__ import annotations

import pytest
import torch

from zlm.model.cells.plain import lstm_plain
from zlm.model.cells.reference import zoneout_lstm_reference


def _inputs(dtype, T=9, B=3, I=5, H=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    args = [torch.randn(T, B, I, generator=g, dtype=dtype), torch.randn(B, H, generator=g, dtype=dtype),
            torch.randn(B, H, generator=g, dtype=dtype), torch.randn(4 * H, I, generator=g, dtype=dtype) * 0.3,
            torch.randn(4 * H, H, generator=g, dtype=dtype) * 0.3, torch.randn(4 * H, generator=g, dtype=dtype)]
    return [a.requires_grad_() for a in args]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_plain_equals_reference_at_zero_zoneout_forward_and_gradients(dtype, tol):
    a, b = _inputs(dtype), _inputs(dtype)
    out_a = lstm_plain(*a, 0.0, 0.0)
    out_b = zoneout_lstm_reference(*b, 0.0, 0.0)
    for u, v in zip(out_a, out_b, strict=True):
        torch.testing.assert_close(u, v, rtol=tol, atol=tol)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, generator=g, dtype=dtype) for o in out_a]
    sum((o * w).sum() for o, w in zip(out_a, weights, strict=True)).backward()
    sum((o * w).sum() for o, w in zip(out_b, weights, strict=True)).backward()
    for name, u, v in zip(("x", "h0", "c0", "weight_ih", "weight_hh", "bias"), a, b, strict=True):
        torch.testing.assert_close(u.grad, v.grad, rtol=tol, atol=tol, msg=name)


def test_plain_matches_torch_nn_lstm_with_the_bias_as_b_ih():
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(5, 7)
    x, h0, c0 = torch.randn(6, 2, 5), torch.randn(1, 2, 7), torch.randn(1, 2, 7)
    want, (h, c) = lstm(x, (h0, c0))
    bias = (lstm.bias_ih_l0 + lstm.bias_hh_l0).detach()
    y, hT, cT = lstm_plain(x, h0[0], c0[0], lstm.weight_ih_l0, lstm.weight_hh_l0, bias, 0.0, 0.0)
    torch.testing.assert_close((y, hT, cT), (want, h[0], c[0]), rtol=1e-5, atol=1e-6)


def test_plain_refuses_zoneout():
    x = _inputs(torch.float32)
    with pytest.raises(ValueError, match="without zoneout"):
        lstm_plain(*x, 0.5, 0.0)
    with pytest.raises(ValueError, match="without zoneout"):
        lstm_plain(*x, torch.zeros(9, 3, 7), 0.0)


def test_plain_runs_torchs_kernel_in_training_mode_when_a_backward_follows(monkeypatch):
    """cuDNN refuses a backward through an LSTM run with train=False (a training run on a
    GPU died on it): the cell passes train=True whenever gradients are recorded."""
    seen = []
    lstm = torch.lstm

    def spy(*args):
        seen.append(args[6])  # (input, hx, params, has_biases, layers, dropout, train, ...)
        return lstm(*args)

    monkeypatch.setattr(torch, "lstm", spy)
    x = _inputs(torch.float32)
    lstm_plain(*x, 0.0, 0.0)
    with torch.no_grad():
        lstm_plain(*x, 0.0, 0.0)
    assert seen == [True, False]


@pytest.mark.parametrize("native", [pytest.param(True, marks=pytest.mark.cpu_feature("bf16")), False])
def test_plain_under_bf16_autocast_computes_in_fp32_where_onednn_has_no_bf16(native, monkeypatch):
    """On a CPU without native bf16 oneDNN builds no bf16 LSTM (torch.lstm under bf16 autocast
    raises there): the plain cell leaves autocast for its layer and returns what fp32 gives,
    forward and gradients. Where oneDNN has bf16 the layer runs under autocast (bf16 out)."""
    from zlm.model.cells import packed_gemm

    if native and not packed_gemm.ONEDNN_BF16:
        pytest.skip("this CPU has no native bf16: oneDNN has no bf16 LSTM here")
    monkeypatch.setattr(packed_gemm, "ONEDNN_BF16", native)
    a, b = _inputs(torch.float32), _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = lstm_plain(*a, 0.0, 0.0)
    if native:
        assert got[0].dtype == torch.bfloat16
        return
    want = lstm_plain(*b, 0.0, 0.0)
    assert all(u.dtype == torch.float32 for u in got)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    sum(o.sum() for o in got).backward()
    sum(o.sum() for o in want).backward()
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u.grad, v.grad, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_on_cuda_trains_through_cudnn(dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # fp32 parity is against full fp32
    a = [t.detach().cuda().requires_grad_() for t in _inputs(torch.float32)]
    b = _inputs(torch.float32)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        out_a = lstm_plain(*a, 0.0, 0.0)
    out_b = zoneout_lstm_reference(*b, 0.0, 0.0)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for u, v in zip(out_a, out_b, strict=True):
        torch.testing.assert_close(u.float().cpu(), v, rtol=tol, atol=tol)
    sum(o.float().sum() for o in out_a).backward()
    sum(o.sum() for o in out_b).backward()
    for name, u, v in zip(("x", "h0", "c0", "weight_ih", "weight_hh", "bias"), a, b, strict=True):
        torch.testing.assert_close(u.grad.cpu(), v.grad, rtol=tol, atol=tol, msg=name)

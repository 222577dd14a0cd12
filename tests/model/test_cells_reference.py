"""The reference cell follows the zoneout equations (Krueger et al. 2016, section 3.2) exactly."""

from __future__ import annotations

import pytest
import torch

from zlm.model.cells.masks import draw_keep
from zlm.model.cells.reference import zoneout_lstm_reference
from zlm.model.lm import ModelConfig, ZoneoutLM, ZoneoutLSTMLayer


def _params(I, H, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w_ih = torch.randn(4 * H, I, generator=g, dtype=dtype) * 0.3
    w_hh = torch.randn(4 * H, H, generator=g, dtype=dtype) * 0.3
    b = torch.randn(4 * H, generator=g, dtype=dtype) * 0.1
    return w_ih, w_hh, b


def test_no_zoneout_equals_torch_lstm_forward_and_gradients():
    T, B, I, H = 7, 3, 5, 6
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(I, H, dtype=torch.float64)
    x = torch.randn(T, B, I, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(1, B, H, dtype=torch.float64)
    c0 = torch.randn(1, B, H, dtype=torch.float64)
    y_ref, (hT, cT) = lstm(x, (h0, c0))
    (y_ref.sum() + hT.pow(2).sum() + cT.sum()).backward()

    w_ih = lstm.weight_ih_l0.detach().clone().requires_grad_()
    w_hh = lstm.weight_hh_l0.detach().clone().requires_grad_()
    b = (lstm.bias_ih_l0 + lstm.bias_hh_l0).detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y, h, c = zoneout_lstm_reference(x2, h0[0], c0[0], w_ih, w_hh, b, 0.0, 0.0)
    (y.sum() + h.pow(2).sum() + c.sum()).backward()

    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, hT[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(c, cT[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(x2.grad, x.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(w_ih.grad, lstm.weight_ih_l0.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(w_hh.grad, lstm.weight_hh_l0.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(b.grad, lstm.bias_ih_l0.grad, rtol=0, atol=1e-12)


def test_all_ones_masks_freeze_the_state():
    T, B, I, H = 5, 2, 3, 4
    w_ih, w_hh, b = _params(I, H)
    x = torch.randn(T, B, I)
    h0, c0 = torch.randn(B, H), torch.randn(B, H)
    ones = torch.ones(T, B, H)
    y, h, c = zoneout_lstm_reference(x, h0, c0, w_ih, w_hh, b, ones, ones)
    assert torch.equal(h, h0) and torch.equal(c, c0)
    assert torch.equal(y, h0.expand(T, B, H))


def test_eval_expectation_by_hand():
    """One step, one unit, computed with plain floats."""
    import math


    w_ih = torch.tensor([[0.5], [-0.3], [0.8], [0.2]], dtype=torch.float64)
    w_hh = torch.tensor([[0.1], [0.4], [-0.6], [0.7]], dtype=torch.float64)
    b = torch.tensor([0.0, 1.0, 0.1, -0.2], dtype=torch.float64)
    x, h0, c0 = 0.9, 0.3, -0.4
    zc, zh = 0.5, 0.05
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    pre = [w_ih[k, 0].item() * x + w_hh[k, 0].item() * h0 + b[k].item() for k in range(4)]
    i, f, g, o = sig(pre[0]), sig(pre[1]), math.tanh(pre[2]), sig(pre[3])
    c_new = f * c0 + i * g
    h_new = o * math.tanh(c_new)  # tanh of the new, not-zoned cell
    c_exp = zc * c0 + (1 - zc) * c_new
    h_exp = zh * h0 + (1 - zh) * h_new
    t = lambda v: torch.tensor([[v]], dtype=torch.float64)  # noqa: E731
    y, h, c = zoneout_lstm_reference(t(x)[None], t(h0), t(c0), w_ih, w_hh, b, zc, zh)
    assert abs(c.item() - c_exp) < 1e-14 and abs(h.item() - h_exp) < 1e-14


def test_gradcheck_float64_with_masks():
    T, B, I, H = 3, 2, 3, 2
    w_ih, w_hh, b = (p.requires_grad_() for p in _params(I, H, torch.float64))
    x = torch.randn(T, B, I, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(B, H, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(B, H, dtype=torch.float64, requires_grad=True)
    g = torch.Generator().manual_seed(1)
    kc = (torch.rand(T, B, H, generator=g) < 0.5).double()
    kh = (torch.rand(T, B, H, generator=g) < 0.3).double()

    def f(*args):
        return zoneout_lstm_reference(*args, kc, kh)

    assert torch.autograd.gradcheck(f, (x, h0, c0, w_ih, w_hh, b))


def test_masks_are_bernoulli_per_unit_step_example():
    keep = draw_keep(0.3, (50, 40, 30), True, dtype=torch.float32, device="cpu")
    assert set(keep.unique().tolist()) <= {0.0, 1.0}
    assert abs(keep.mean().item() - 0.3) < 0.01
    assert not torch.equal(keep[0], keep[1]) and not torch.equal(keep[:, 0], keep[:, 1])
    assert draw_keep(0.3, (2, 2, 2), False, dtype=torch.float32, device="cpu") == 0.3


@pytest.mark.parametrize("z", [0.05, 0.5, 0.9])
def test_mask_draw_16_bit_lanes_are_each_bernoulli_z(z):
    # four elements come from each 64-bit word: every lane (position mod 4) must keep at rate z
    keep = draw_keep(z, (1000, 40, 101), True, dtype=torch.float32, device="cpu")
    lanes = keep.flatten()[: 4 * (keep.numel() // 4)].view(-1, 4).mean(0)
    torch.testing.assert_close(lanes, torch.full((4,), z), atol=2e-3, rtol=0)
    pairs = keep.flatten()[:-1] * keep.flatten()[1:]  # neighbours independent
    assert abs(pairs.mean().item() - z * z) < 2e-3


def test_mask_draw_reproducible_from_the_generator_state_any_shape_and_dtype():
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    a = draw_keep(0.5, (3, 5, 7), True, dtype=torch.bfloat16, device="cpu", generator=g)
    g.set_state(state)
    b = draw_keep(0.5, (3, 5, 7), True, dtype=torch.bfloat16, device="cpu", generator=g)
    assert a.dtype == torch.bfloat16 and a.shape == (3, 5, 7) and torch.equal(a, b)
    c = draw_keep(0.5, (3, 5, 7), True, dtype=torch.bfloat16, device="cpu", generator=g)
    assert not torch.equal(a, c)
    assert torch.equal(draw_keep(1.0, (2, 3, 4), True, dtype=torch.float64, device="cpu"), torch.ones(2, 3, 4, dtype=torch.float64))


def test_layer_init_forget_bias_and_orthogonal():
    layer = ZoneoutLSTMLayer(5, 8, 0.5, 0.05)
    H = 8
    assert torch.all(layer.bias[H : 2 * H] == 1) and torch.all(layer.bias[:H] == 0)
    for k in range(4):
        w = layer.weight_hh[k * H : (k + 1) * H].detach()
        torch.testing.assert_close(w @ w.t(), torch.eye(H), atol=1e-5, rtol=0)


def test_model_shapes_and_state_carry():
    cfg = ModelConfig(vocab_size=11, hidden=8, layers=2, embed=4)
    model = ZoneoutLM(cfg).eval()
    tokens = torch.randint(0, 11, (6, 3))
    logits, state = model(tokens)
    assert logits.shape == (6, 3, 11) and state[0].shape == (2, 3, 8)
    # Two halves with the state carried equal the whole window (eval: deterministic).
    l1, s1 = model(tokens[:3])
    l2, _ = model(tokens[3:], s1)
    torch.testing.assert_close(torch.cat([l1, l2]), logits)

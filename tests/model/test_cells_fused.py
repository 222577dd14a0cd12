"""The fused CPU cell matches the reference cell: outputs, final states, every gradient."""

from __future__ import annotations

import pytest
import torch
from cell_cases import NAMES, cell_inputs, cell_outputs

from zlm.model.cells import choose_cell
from zlm.model.cells.fused import zoneout_lstm_fused
from zlm.model.cells.packed_gemm import backend_for, clear_cache
from zlm.model.cells.reference import zoneout_lstm_reference
from zlm.model.cells.workspace import clear_workspaces
from zlm.model.lm import ModelConfig, ZoneoutLM

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


@pytest.fixture(autouse=True)
def _fresh_caches():
    clear_cache()
    clear_workspaces()
    yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("masks", ["train", "eval", "off"])
@pytest.mark.parametrize("shape", [(7, 3, 5, 6), (1, 2, 4, 3), (12, 8, 16, 32)])
def test_matches_reference(dtype, masks, shape):
    args, keeps = cell_inputs(*shape, dtype, masks)
    want = cell_outputs(zoneout_lstm_reference, args, keeps)
    got = cell_outputs(zoneout_lstm_fused, args, keeps)
    for name, a, b in zip(NAMES, got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL[dtype], msg=name)


def test_gradcheck_float64_with_masks():
    args, keeps = cell_inputs(3, 2, 3, 2, torch.float64, "train", seed=3)
    assert torch.autograd.gradcheck(lambda *a: zoneout_lstm_fused(*a, *keeps), args)


def test_gradcheck_float64_eval():
    args, keeps = cell_inputs(3, 2, 3, 2, torch.float64, "eval", seed=4)
    assert torch.autograd.gradcheck(lambda *a: zoneout_lstm_fused(*a, *keeps), args)


def test_unused_outputs_and_partial_grads():
    """Only y used, and only some inputs require grad: the rest must be None/untouched."""
    args, keeps = cell_inputs(5, 2, 3, 4, torch.float64, "train")
    x, h0, c0, w_ih, w_hh, b = (a.detach() for a in args)
    w_hh.requires_grad_()
    for cell in (zoneout_lstm_reference, zoneout_lstm_fused):
        w_hh.grad = None
        cell(x, h0, c0, w_ih, w_hh, b, *keeps)[0].sum().backward()
        if cell is zoneout_lstm_reference:
            want = w_hh.grad.clone()
    torch.testing.assert_close(w_hh.grad, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_zoneout_equals_torch_lstm(dtype):
    T, B, I, H = 9, 4, 6, 8
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(I, H, dtype=dtype)
    x = torch.randn(T, B, I, dtype=dtype, requires_grad=True)
    h0, c0 = torch.randn(1, B, H, dtype=dtype), torch.randn(1, B, H, dtype=dtype)
    y_ref, (hT, cT) = lstm(x, (h0, c0))
    (y_ref.sum() + hT.pow(2).sum() + cT.sum()).backward()

    w_ih = lstm.weight_ih_l0.detach().clone().requires_grad_()
    w_hh = lstm.weight_hh_l0.detach().clone().requires_grad_()
    b = (lstm.bias_ih_l0 + lstm.bias_hh_l0).detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y, h, c = zoneout_lstm_fused(x2, h0[0], c0[0], w_ih, w_hh, b, 0.0, 0.0)
    (y.sum() + h.pow(2).sum() + c.sum()).backward()
    tol = dict(rtol=0, atol=TOL[dtype])
    for a, b_ in [(y, y_ref), (h, hT[0]), (c, cT[0]), (x2.grad, x.grad),
                  (w_ih.grad, lstm.weight_ih_l0.grad), (w_hh.grad, lstm.weight_hh_l0.grad),
                  (b.grad, lstm.bias_ih_l0.grad)]:  # fmt: skip
        torch.testing.assert_close(a, b_, **tol)


def test_no_grad_and_single_step_match_reference():
    """The inference path (nothing saved) and T=1 calls, as a sampler makes them."""
    args, _ = cell_inputs(1, 1, 8, 16, torch.float32, "eval")
    x, h, c, w_ih, w_hh, b = (a.detach() for a in args)
    hr, cr = h, c
    with torch.no_grad():
        for _ in range(5):  # state carried step to step; weights packed once, then cached
            y, h, c = zoneout_lstm_fused(x, h, c, w_ih, w_hh, b, 0.5, 0.05)
            yr, hr, cr = zoneout_lstm_reference(x, hr, cr, w_ih, w_hh, b, 0.5, 0.05)
            torch.testing.assert_close(y, yr, rtol=0, atol=1e-5)
            torch.testing.assert_close(c, cr, rtol=0, atol=1e-5)
        # An in-place weight update (an optimizer step) must not hit a stale packed weight.
        # So must a write through .data, which does not bump the version counter.
        for update in (lambda: w_hh.mul_(0.5), lambda: w_hh.data.mul_(0.5)):
            update()
            y, _, _ = zoneout_lstm_fused(x, h, c, w_ih, w_hh, b, 0.5, 0.05)
            yr, _, _ = zoneout_lstm_reference(x, h, c, w_ih, w_hh, b, 0.5, 0.05)
            torch.testing.assert_close(y, yr, rtol=0, atol=1e-5)


def test_outputs_do_not_alias_the_workspace():
    """A later window must not overwrite the y, h_T, c_T a caller still holds."""
    args, keeps = cell_inputs(4, 2, 3, 5, torch.float64, "eval")
    args = [a.detach() for a in args]
    y1, h1, c1 = zoneout_lstm_fused(*args, *keeps)
    saved = [t.clone() for t in (y1, h1, c1)]
    args2, _ = cell_inputs(4, 2, 3, 5, torch.float64, "eval", seed=9)
    zoneout_lstm_fused(*(a.detach() for a in args2), *keeps)
    for a, b in zip((y1, h1, c1), saved, strict=True):
        assert torch.equal(a, b)


def test_retain_graph_backward_twice():
    args, keeps = cell_inputs(4, 2, 3, 5, torch.float64, "train")
    y, h, c = zoneout_lstm_fused(*args, *keeps)
    loss = y.sum() + c.sum()
    g1 = torch.autograd.grad(loss, args, retain_graph=True)
    zoneout_lstm_fused(*(a.detach() for a in args), *keeps)  # another window in between
    g2 = torch.autograd.grad(loss, args)
    for a, b in zip(g1, g2, strict=True):
        assert torch.equal(a, b)


def _models(dtype, layers=2):
    config = ModelConfig(vocab_size=11, hidden=12, layers=layers, embed=7)
    torch.manual_seed(0)
    ref = ZoneoutLM(config).to(dtype)
    fused = ZoneoutLM(config, cell=zoneout_lstm_fused).to(dtype)
    fused.load_state_dict(ref.state_dict())
    return ref, fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("training", [True, False])
def test_multilayer_model_two_windows(dtype, training):
    """Same seed -> same masks; state carried across two windows; gradients of both."""
    ref, fused = _models(dtype)
    tokens = torch.randint(11, (2, 6, 3), generator=torch.Generator().manual_seed(5))
    results = []
    for model in (ref, fused):
        model.train(training)
        state, losses = model.initial_state(3, dtype=dtype), []  # fp64 needs an fp64 state
        for k in range(2):
            torch.manual_seed(100 + k)  # the masks of window k
            logits, state = model(tokens[k], state)
            loss = logits.square().mean()
            loss.backward()
            state = tuple(s.detach() for s in state)
            losses.append(loss.detach())
        grads = [p.grad for p in model.parameters()]
        results.append((losses, state, grads))
    (l1, s1, g1), (l2, s2, g2) = results
    tol = dict(rtol=0, atol=TOL[dtype])
    torch.testing.assert_close(l2, l1, **tol)
    torch.testing.assert_close(s2, s1, **tol)
    for a, b in zip(g2, g1, strict=True):
        torch.testing.assert_close(a, b, **tol)


def test_chooser_picks_fused_on_cpu():
    choice = choose_cell("auto", "cpu")  # the compiled step where it builds, else this cell
    assert choice.fn is zoneout_lstm_fused or "compiled C++ step" in choice.reason
    assert choice.name == "fused"


def test_gemm_backend_choice():
    cpu = torch.device("cpu")
    assert backend_for(torch.float64, cpu) == "addmm"
    assert backend_for(torch.float32, cpu) in ("onednn", "addmm")

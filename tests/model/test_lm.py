"""zlm.model.lm: the language model's shapes, initialisation and config checks."""

from __future__ import annotations

import pytest
import torch

from zlm.errors import UsageError
from zlm.model import lm
from zlm.model.lm import FUSED_NLL_MIN_VOCAB, ModelConfig, ZoneoutLM, blocked_nll, token_nll, training_nll


def test_shapes_and_state():
    m = ZoneoutLM(ModelConfig(vocab_size=11, hidden=16, layers=2, embed=8))
    logits, (h, c) = m(torch.randint(11, (7, 3)))
    assert logits.shape == (7, 3, 11) and h.shape == c.shape == (2, 3, 16)
    assert m.num_parameters() == sum(p.numel() for p in m.parameters())


def test_forget_bias_one_and_orthogonal_recurrent_weights():
    m = ZoneoutLM(ModelConfig(vocab_size=5, hidden=8, embed=4))
    layer = m.layers[0]
    b = dict(layer.named_parameters())
    bias = next(v for k, v in b.items() if "bias" in k)
    assert torch.all(bias[8:16] == 1.0) and torch.all(bias[:8] == 0.0)  # gates i, f, g, o
    w_hh = next(v for k, v in b.items() if "weight_hh" in k)  # (4H, H)
    for gate in w_hh.split(8):
        torch.testing.assert_close(gate @ gate.T, torch.eye(8), atol=1e-5, rtol=0)


def test_token_nll_is_summed_cross_entropy_in_fp32():
    logits = torch.randn(4, 2, 6, dtype=torch.bfloat16)
    y = torch.randint(6, (4, 2))
    want = torch.nn.functional.cross_entropy(logits.float().reshape(8, 6), y.reshape(8), reduction="sum")
    got = token_nll(logits, y)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("bad, flag", [(dict(hidden=0), "--hidden"), (dict(zoneout_cell=1.0), "--zoneout-cell"),
                                       (dict(dropout=-0.1), "--dropout")])
def test_bad_config_names_the_flag(bad, flag):
    with pytest.raises(UsageError, match=flag):
        ModelConfig(vocab_size=5, **bad)


def test_a_model_needs_a_vocabulary():
    """Presets leave vocab_size at 0 until the data is known; a model cannot be built so."""
    with pytest.raises(UsageError, match="vocab_size"):
        ZoneoutLM(ModelConfig())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_blocked_nll_equals_the_whole_windows(precision):
    # Blocks of rows (an uneven last one included) against the logits of the whole window:
    # the same per-token losses, summed in another order (fp32 rounding), in fp32 and under
    # bf16 autocast; features -> decoder is exactly forward.
    torch.manual_seed(0)
    model = ZoneoutLM(ModelConfig(vocab_size=300, hidden=16, embed=8)).eval().requires_grad_(False)
    tokens = torch.randint(300, (13, 5))
    targets = torch.randint(300, (13, 5))
    logits, state = model(tokens)
    x, again = model.features(tokens)
    assert torch.equal(model.decoder(x), logits) and all(torch.equal(a, b) for a, b in zip(state, again, strict=True))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        whole = token_nll(model.decoder(x), targets)
        for block in (None, 300 * 65, 300 * 7, 300, 1):  # whole, one block, 7 rows, 1 row, at least 1 row
            got = blocked_nll(model.decoder, x, targets, block)
            assert got.dtype == torch.float32
            assert float(got) == pytest.approx(float(whole), rel=1e-6), block


def _decoder_grads(loss_fn, precision: str, vocab: int):
    """The loss of a small model's window under `loss_fn` and the gradients it gives every
    parameter, under fp32 or bf16 autocast."""
    torch.manual_seed(0)
    model = ZoneoutLM(ModelConfig(vocab_size=vocab, hidden=16, embed=8))
    tokens, targets = torch.randint(vocab, (13, 5)), torch.randint(vocab, (13, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits, _ = model(tokens)
    loss = loss_fn(logits, targets) / targets.numel()
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("rows_block", [None, 7, 1])  # one block; 7 rows (uneven last); 1 row
def test_fused_training_loss_equals_cross_entropy(precision, rows_block, monkeypatch):
    # The fused loss (forward and every parameter's gradient) against token_nll, through the
    # model and the decoder's autocast. fp32: rounding (rel 1e-5). bf16: the logits' gradient
    # is rounded to bf16 by both before the decoder's backward, in another order, so within
    # one bf16 step of each gradient's largest entry (2**-7 relative).
    vocab = FUSED_NLL_MIN_VOCAB + 3
    if rows_block is not None:
        monkeypatch.setattr(lm, "SOFTMAX_ROWS_BLOCK", vocab * rows_block)
    want_loss, want = _decoder_grads(token_nll, precision, vocab)
    calls = []
    fused_apply = lm._FusedSoftmaxNLL.apply
    monkeypatch.setattr(lm._FusedSoftmaxNLL, "apply", lambda *a: calls.append(1) or fused_apply(*a))
    got_loss, got = _decoder_grads(training_nll, precision, vocab)
    assert calls == [1]  # the fused loss ran
    assert got_loss.dtype == torch.float32
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
    tol = 1e-5 if precision == "fp32" else 2 ** -7
    for name, g in want.items():
        err = float((got[name] - g).abs().max() / g.abs().max())
        assert err <= tol, (name, err)


def test_training_nll_dispatch():
    # The fused loss only where it pays and is safe: a CPU, a vocabulary of at least
    # FUSED_NLL_MIN_VOCAB, logits that need a gradient. Otherwise token_nll itself.
    def path(vocab, grad=True):
        logits = torch.randn(3, 2, vocab, requires_grad=grad)
        return type(training_nll(logits, torch.randint(vocab, (3, 2))).grad_fn).__name__

    assert "FusedSoftmaxNLL" in path(FUSED_NLL_MIN_VOCAB)
    assert "FusedSoftmaxNLL" not in path(FUSED_NLL_MIN_VOCAB - 1)
    assert path(FUSED_NLL_MIN_VOCAB, grad=False) == "NoneType"
    logits = torch.randn(3, 2, FUSED_NLL_MIN_VOCAB)
    y = torch.randint(FUSED_NLL_MIN_VOCAB, (3, 2))
    with torch.no_grad():
        assert torch.equal(training_nll(logits.requires_grad_(), y), token_nll(logits, y))


def test_fused_training_loss_backpropagates_once():
    # Its backward overwrites the logits with their gradient, so a second backward (retain_graph)
    # must fail loudly, not give a wrong gradient.
    w = torch.randn(FUSED_NLL_MIN_VOCAB, 4, requires_grad=True)
    loss = training_nll((torch.randn(3, 2, 4) @ w.T), torch.randint(FUSED_NLL_MIN_VOCAB, (3, 2)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagates once"):
        loss.backward()

"""zlm.model.lm: the language model's shapes, initialisation and config checks."""

from __future__ import annotations

import pytest
import torch

from zlm.errors import UsageError
from zlm.model.lm import ModelConfig, ZoneoutLM, blocked_nll, token_nll


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

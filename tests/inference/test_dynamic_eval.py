"""Dynamic evaluation: predictions before updates, the checkpoint untouched, a real gain."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import shakespeare_text
from zlm.core.eval_protocol import EvalProtocol, evaluate_predictions
from zlm.core.precision import resolve_runtime
from zlm.errors import UsageError
from zlm.inference.dynamic import DynamicAdapter, DynamicConfig, dynamic_score_predictions
from zlm.inference.load import LoadedModel
from zlm.model.cells import choose_cell

CPU = resolve_runtime("cpu", "fp32")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm(tmp_path_factory, untrained_char_model):
    """An untrained model: enough to check the protocol (no training, so fast)."""
    model, tok = untrained_char_model
    path = tmp_path_factory.mktemp("dyn")
    tok.save(path)
    return LoadedModel(model, tok, CPU, path, {}, choose_cell("auto", "cpu"))


def _tokens(lm, text):
    return lm.tokenizer.encode(text)


def test_zero_lr_is_static_and_first_segment_is_predicted_before_its_update(lm):
    tokens = _tokens(lm, shakespeare_text(3_001)[1000:])
    proto = EvalProtocol(3, 40)
    static, n = evaluate_predictions(lm.model, tokens, CPU, proto)
    dyn, m = dynamic_score_predictions(lm.model, tokens, CPU, proto, DynamicConfig(0.0, 0.0, 40))
    assert m == n and dyn == pytest.approx(static, rel=1e-5)
    # One segment only: however large the step, the score is the fixed weights' score.
    one = tokens[:41]
    s1, _ = evaluate_predictions(lm.model, one, CPU, EvalProtocol(1, 40))
    d1, _ = dynamic_score_predictions(lm.model, one, CPU, EvalProtocol(1, 40),
                                      DynamicConfig(10.0, 0.0, 40))
    assert d1 == pytest.approx(s1, rel=1e-5)


def test_second_segment_uses_the_weights_after_the_first_update(lm):
    tokens = _tokens(lm, shakespeare_text(200))[:81]
    cfg = DynamicConfig(1e-2, 1e-2, 40)
    total, _ = dynamic_score_predictions(lm.model, tokens, CPU, EvalProtocol(1, 40), cfg)
    ad = DynamicAdapter(lm.model, cfg)  # by hand: predict 1, learn 1, predict 2
    x = torch.from_numpy(tokens.astype(np.int64))[:, None]  # (81, 1)
    first, state = ad.score(x[:40], x[1:41], None, 40)
    with torch.no_grad():
        nll, _ = ad.forward(x[40:80], x[41:81], state)
    assert total == pytest.approx(first + float(nll.double().sum()), rel=1e-6)


def test_adapts_to_repeated_text_and_leaves_the_model_alone(lm):
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    rng = np.random.default_rng(0)
    piece = rng.integers(0, lm.tokenizer.vocab_size, 25)
    tokens = np.tile(piece, 24)  # (600,)
    proto = EvalProtocol(1, 30)
    static, _ = evaluate_predictions(lm.model, tokens, CPU, proto)
    dyn, _ = dynamic_score_predictions(lm.model, tokens, CPU, proto, DynamicConfig(1e-2, 1e-3, 30))
    assert dyn < 0.9 * static
    for k, v in lm.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not any(p.requires_grad for p in lm.model.parameters())


def test_config_checks_name_the_flag():
    for kw, flag in (({"lr": -1.0}, "--dynamic-lr"), ({"decay": 1.0}, "--dynamic-decay"),
                     ({"segment": 0}, "--segment")):
        with pytest.raises(UsageError, match=flag):
            DynamicConfig(**kw)

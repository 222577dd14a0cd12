"""The continuous cache: the batched memory against its readable reference, the switching
share against its definition and its bound, the scorer against the static protocol."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from conftest import shakespeare_text
from zlm.core.eval_protocol import EvalProtocol, evaluate_predictions
from zlm.core.precision import resolve_runtime
from zlm.errors import UsageError
from zlm.inference.adapt_config import CACHE_LAMBDAS, CACHE_SWITCH_RATE, CacheConfig
from zlm.inference.cache import (
    CacheScorer,
    ContinuousCache,
    SwitchingShare,
    cache_probability_reference,
    cache_score_predictions,
    mix,
)
from zlm.inference.dynamic import DynamicAdapter, DynamicConfig, dynamic_score_predictions
from zlm.model.lm import ModelConfig, ZoneoutLM

CPU = resolve_runtime("cpu", "fp32")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("size,windows", [(5, [7, 7, 3]), (50, [16, 1, 30]), (9, [4, 4, 4, 4, 4])])
def test_windows_of_the_batched_memory_equal_the_reference(size, windows):
    """Any window lengths, memories shorter or longer than a window: each stream's p_cache
    is the reference's, position by position (fp32 against float64: 1e-5)."""
    torch.manual_seed(1)
    B, H, N = 3, 6, sum(windows)
    h = torch.randn(N, B, H)
    targets = torch.randint(0, 4, (N, B))  # few tokens, so the cache often holds the target
    config = CacheConfig(size, 0.7)
    cache = ContinuousCache(B, H, config, "cpu")
    got, seen, at = [], [], 0
    for T in windows:
        p, r = cache.probability(h[at:at + T], targets[at:at + T])
        got.append(p)
        seen.append(r)
        at += T
    got, seen = torch.cat(got), torch.cat(seen)
    for b in range(B):
        ref = cache_probability_reference(h[:, b], targets[:, b], config)
        assert not seen[0, b] and bool(seen[1:, b].all())
        torch.testing.assert_close(got[1:, b].double(), ref[1:], atol=1e-5, rtol=0)
        assert 0.1 < float(ref[1:].mean()) < 0.9  # the targets are in the cache often, not always


def test_the_switching_share_is_its_definition_and_within_its_bound():
    """By hand, per stream: the weights are the posterior over the shares, then `rate` of
    them spread evenly. Its total is at most the best fixed share's plus log K + (n-1)
    log 1/(1-rate), and on a text whose best share changes half way it beats every
    fixed share."""
    torch.manual_seed(2)
    T, B = 400, 2
    log_p = -torch.rand(T, B) * 4
    p_cache = torch.rand(T, B)
    p_cache[: T // 2] *= 0.02  # the cache useless first, then good
    p_cache[T // 2:] = 0.9 + 0.1 * p_cache[T // 2:]
    seen = torch.ones(T, B, dtype=torch.bool)
    seen[0] = False
    sw = SwitchingShare(B, "cpu")
    first, later = sw.run(log_p[:150], p_cache[:150], seen[:150]), sw.run(log_p[150:], p_cache[150:], seen[150:])
    got, share = torch.cat([first[0], later[0]]), torch.cat([first[1], later[1]])
    K, rate = len(CACHE_LAMBDAS), CACHE_SWITCH_RATE
    for b in range(B):
        w = [1 / K] * K
        for t in range(T):
            each = [math.exp(float(log_p[t, b])) if not seen[t, b] else
                    (1 - lam) * math.exp(float(log_p[t, b])) + lam * float(p_cache[t, b])
                    for lam in CACHE_LAMBDAS]
            p = sum(wk * ek for wk, ek in zip(w, each, strict=True))
            assert float(got[t, b]) == pytest.approx(math.log(p), abs=1e-9)
            assert float(share[t, b]) == pytest.approx(sum(wk * lam for wk, lam in zip(w, CACHE_LAMBDAS, strict=True)),
                                                       abs=1e-12)
            w = [(1 - rate) * wk * ek / p + rate / K for wk, ek in zip(w, each, strict=True)]
    fixed = mix(log_p, p_cache, seen, torch.tensor(CACHE_LAMBDAS)).sum(0)  # (B, K)
    bound = math.log(K) + (T - 1) * -math.log1p(-rate)
    assert bool((got.sum(0) >= fixed.max(-1).values - bound).all())
    assert bool((got.sum(0) > fixed.max(-1).values).all())


def test_the_switching_share_survives_targets_no_share_gives_a_float64_probability():
    """A target the model gives exp(-2000) and the cache nothing: every share's probability
    underflows float64, and the mixture's log is still that log-probability."""
    log_p = torch.tensor([[-2000.0], [-1.0]], dtype=torch.float64)
    p_cache = torch.zeros(2, 1, dtype=torch.float64)
    seen = torch.tensor([[False], [True]])
    sw = SwitchingShare(1, "cpu")
    got = sw.score(log_p, p_cache, seen)
    assert float(got[0, 0]) == pytest.approx(-2000.0)
    assert math.isfinite(float(got[1, 0])) and float(got[1, 0]) < -1.0


def test_a_fixed_share_of_zero_is_the_static_score_and_windows_do_not_matter(untrained_char_model):
    m, tok = untrained_char_model
    tokens = tok.encode(shakespeare_text(3_001)[1000:])
    static, n = evaluate_predictions(m, tokens, CPU, EvalProtocol(3, 40))
    zero, k, _ = cache_score_predictions(m, tokens, CPU, EvalProtocol(3, 40), CacheConfig(100, 0.5, 0.0))
    assert k == n and zero == pytest.approx(static, rel=1e-6)
    a, _, _ = cache_score_predictions(m, tokens, CPU, EvalProtocol(3, 40), CacheConfig(100))
    b, _, _ = cache_score_predictions(m, tokens, CPU, EvalProtocol(3, 17), CacheConfig(100))
    assert a == pytest.approx(b, rel=1e-6)


def test_the_tail_continues_the_last_stream_and_a_sample_counts_its_share(untrained_char_model):
    m, tok = untrained_char_model
    tokens = tok.encode(shakespeare_text(1_000))[:611]  # 610 predictions: 4 x 152 and a tail of 2
    _, n = evaluate_predictions(m, tokens, CPU, EvalProtocol(4, 50))
    total, k, _ = cache_score_predictions(m, tokens, CPU, EvalProtocol(4, 50), CacheConfig(64))
    assert k == n == 610 and math.isfinite(total)
    _, ns = evaluate_predictions(m, tokens, CPU, EvalProtocol(4, 50, sample=100))
    _, ks, _ = cache_score_predictions(m, tokens, CPU, EvalProtocol(4, 50, sample=100), CacheConfig(64))
    assert ks == ns == 100


def test_a_repeated_text_is_predicted_from_the_cache(untrained_char_model):
    """An untrained model cannot know a random piece of 25 tokens; after its first copy the
    cache can: the score falls well below the static one (0.70 of it when written), and the
    model is untouched. Its embedding is made 10 times larger, so that different contexts
    give states as distinct as a trained model's."""
    m, tok = untrained_char_model
    m = copy.deepcopy(m)
    with torch.no_grad():
        m.embedding.weight.mul_(10)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    piece = np.random.default_rng(0).integers(0, tok.vocab_size, 25)
    tokens = np.tile(piece, 24)  # (600,)
    static, _ = evaluate_predictions(m, tokens, CPU, EvalProtocol(1, 30))
    cached, _, _ = cache_score_predictions(m, tokens, CPU, EvalProtocol(1, 30), CacheConfig(200, 10.0))
    assert cached < 0.75 * static
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_dynamic_evaluation_with_the_cache(untrained_char_model):
    """--dynamic --cache: segment by segment, the cache mixes with the adapting model's
    predictions (checked by hand over two segments); with a share of 0 it is dynamic
    evaluation alone; on a repeated text it beats dynamic evaluation alone."""
    m, tok = untrained_char_model
    tokens = tok.encode(shakespeare_text(200))[:81]
    dyn, cfg = DynamicConfig(1e-2, 1e-2, 40), CacheConfig(30, 2.0)
    total, n = dynamic_score_predictions(m, tokens, CPU, EvalProtocol(1, 40), dyn, cfg)
    ad, scorer = DynamicAdapter(m, dyn), CacheScorer(1, 24, cfg, "cpu")  # by hand
    x = torch.from_numpy(tokens.astype(np.int64))[:, None]  # (81, 1)
    first, state = ad.score(x[:40], x[1:41], None, 40, scorer)
    with torch.no_grad():
        nll, h, _ = ad.forward_features(x[40:80], x[41:81], state)
    second = scorer(h, -nll, x[41:81])
    assert n == 80 and total == pytest.approx(first + second, rel=1e-6)
    alone, _ = dynamic_score_predictions(m, tokens, CPU, EvalProtocol(1, 40), dyn)
    zero, _ = dynamic_score_predictions(m, tokens, CPU, EvalProtocol(1, 40), dyn, CacheConfig(30, 2.0, 0.0))
    assert zero == pytest.approx(alone, rel=1e-9) and total != alone
    big = copy.deepcopy(m)
    with torch.no_grad():
        big.embedding.weight.mul_(10)
    piece = np.tile(np.random.default_rng(0).integers(0, tok.vocab_size, 25), 24)
    alone, _ = dynamic_score_predictions(big, piece, CPU, EvalProtocol(1, 30), DynamicConfig(1e-2, 1e-3, 30))
    both, _ = dynamic_score_predictions(big, piece, CPU, EvalProtocol(1, 30), DynamicConfig(1e-2, 1e-3, 30),
                                        CacheConfig(200, 10.0))
    assert both < 0.97 * alone  # 0.94 of it when written


def test_config_checks_name_the_flag():
    for kw, flag in (({"size": 0}, "--cache-size"), ({"theta": -1.0}, "--cache-theta"),
                     ({"theta": math.inf}, "--cache-theta"), ({"mix": 1.0}, "--cache-lambda")):
        with pytest.raises(UsageError, match=flag):
            CacheConfig(**kw)
    assert "switching" in CacheConfig().describe() and "lambda 0.2" in CacheConfig(mix=0.2).describe()


@pytest.mark.gpu
def test_the_cache_on_cuda_is_the_cpus_score():
    """On CUDA (fused cell, fp32): the cached score of 16 streams and of one stream with
    dynamic evaluation are the CPU's to 1e-4 relative (other kernels, other sums)."""
    from zlm.core.precision import Runtime
    from zlm.model.cells import choose_cell

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, hidden=64, embed=16, zoneout_cell=0.1, zoneout_hidden=0.05)
    cpu_model = ZoneoutLM(cfg).eval()
    cuda_model = ZoneoutLM(cfg, choose_cell("auto", "cuda").fn).eval()
    cuda_model.load_state_dict(cpu_model.state_dict())
    cuda_model.cuda()
    tokens = np.tile(np.random.default_rng(0).integers(0, 40, 300), 10).astype(np.uint8)
    cuda = Runtime(torch.device("cuda"), "fp32")
    for protocol, dyn in ((EvalProtocol(16, 64), None), (EvalProtocol(1, 64), DynamicConfig(1e-3, 1e-3, 64))):
        if dyn is None:
            want, n, _ = cache_score_predictions(cpu_model, tokens, CPU, protocol, CacheConfig(500))
            got, m, _ = cache_score_predictions(cuda_model, tokens, cuda, protocol, CacheConfig(500))
        else:
            want, n = dynamic_score_predictions(cpu_model, tokens, CPU, protocol, dyn, CacheConfig(500))
            got, m = dynamic_score_predictions(cuda_model, tokens, cuda, protocol, dyn, CacheConfig(500))
        assert m == n and got == pytest.approx(want, rel=1e-4)


def test_eval_with_the_cache_alone_scores_the_plain_model_in_the_same_pass(untrained_char_model, monkeypatch):
    """`zlm eval --cache` runs the model over the text once: the plain score beside the cached
    one is the cached pass's own predictions, equal to the static protocol's to float
    rounding. With --dynamic the plain score takes a pass of its own."""
    from zlm.inference import evaluate as ev

    m, tok = untrained_char_model
    passes = []
    monkeypatch.setattr(ev, "evaluate_predictions", lambda *a, **k: passes.append(1) or evaluate_predictions(*a, **k))
    lm = type("LM", (), {"model": m, "tokenizer": tok, "runtime": CPU})()
    text = shakespeare_text(2_000)
    score, plain = ev._text_scores(lm, text, EvalProtocol(1), "error", None, CacheConfig(100))
    assert passes == [] and plain is not None
    static = ev.evaluate_text(lm, text, EvalProtocol(1))
    assert passes == [1] and plain.bpc == pytest.approx(static.bpc, rel=1e-6) and score.bpc != static.bpc
    _, none = ev._text_scores(lm, text, EvalProtocol(1, 64), "error", DynamicConfig(), CacheConfig(100))
    assert none is None

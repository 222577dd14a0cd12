"""`ZoneoutLM.features` through the C++ Decoder (`zlm.model.cells.decoder_tiles`): a few
streams in eval mode without gradients. Checked against the window path (the fused cell)
and the fp64 reference, forward only (it runs without gradients), to 1e-5; when it runs and
when it does not; that it follows weights changed in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zlm.core.eval_protocol import EvalProtocol, evaluate_predictions
from zlm.core.precision import resolve_runtime
from zlm.model.cells import cpu_ext, decoder_tiles
from zlm.model.lm import ModelConfig, ZoneoutLM

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _need_extension():
    if cpu_ext.load_extension() is None:
        pytest.skip(f"no compiled Decoder: {cpu_ext.unavailable_reason()}")


def _model(layers=1, zoneout=(0.3, 0.1), hidden=40, vocab=17):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, hidden=hidden, embed=8, layers=layers, zoneout_cell=zoneout[0],
                      zoneout_hidden=zoneout[1], dropout=0.2)
    return ZoneoutLM(cfg).eval()


def _state(model, B, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (model.config.layers, B, model.config.hidden)
    return torch.randn(shape, generator=g) * 0.5, torch.randn(shape, generator=g) * 0.5


def _windows(model, tokens, state, stepped: bool):
    """features over two consecutive windows, the state carried: (x of both, final state)."""
    model.stepped = stepped
    try:
        with torch.no_grad():
            x1, state = model.features(tokens[:30], state)
            x2, state = model.features(tokens[30:], state)
    finally:
        del model.stepped
    return torch.cat([x1, x2]), state


def _spy(monkeypatch):
    calls = []
    real = decoder_tiles.stepped_features

    def spy(*args):
        calls.append(args[1].shape)
        return real(*args)

    monkeypatch.setattr("zlm.model.lm.stepped_features", spy)
    return calls


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("zoneout", [(0.3, 0.1), (0.0, 0.0)])
@pytest.mark.parametrize("B", [1, 3, 7])
def test_stepped_features_are_the_window_paths_and_the_fp64_references(layers, zoneout, B, monkeypatch):
    calls = _spy(monkeypatch)
    model = _model(layers, zoneout)
    tokens = torch.randint(0, model.config.vocab_size, (70, B))
    state = _state(model, B)
    got, (h, c) = _windows(model, tokens, state, stepped=True)
    assert len(calls) == 2  # both windows ran through the Decoder
    ref, (rh, rc) = _windows(model, tokens, state, stepped=False)
    assert len(calls) == 2
    for a, b in ((got, ref), (h, rh), (c, rc)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    f64 = _model(layers, zoneout).double()  # fp64 weights: never stepped (the Decoder is fp32)
    exact, (eh, ec) = _windows(f64, tokens, tuple(s.double() for s in state), stepped=True)
    assert len(calls) == 2
    for a, b in ((got, exact), (h, eh), (c, ec)):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


def test_when_the_decoder_runs(monkeypatch):
    """Eval mode without gradients, fp32 on the CPU, no autocast, at most
    `max_streams` streams (16 with the AVX2 product, else 4): everything else stays on the
    window path."""
    calls = _spy(monkeypatch)
    model = _model()
    ext = cpu_ext.load_extension()
    most = decoder_tiles.max_streams(ext)
    assert most == (16 if ext.decoder_kernel() == "avx2" else 4)

    def ran(B, grad=False, autocast=False, m=model) -> bool:
        before = len(calls)
        tokens = torch.randint(0, 17, (5, B))
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            m.features(tokens)
        return len(calls) > before

    assert ran(1) and ran(most)
    assert not ran(most + 1)
    assert not ran(1, grad=True)
    bf16dot = ext.decoder_kernel() == "avx512-bf16dot"
    assert ran(1, autocast=True) == bf16dot  # bf16 only where the Decoder rounds h as autocast does
    model.train()
    assert not ran(1)
    model.eval()
    assert not ran(1, m=_model().double())
    model.stepped = False
    assert not ran(1)


def test_weights_changed_in_place_are_packed_again():
    model = _model()
    tokens = torch.randint(0, 17, (40, 1))
    before, _ = _windows(model, tokens, None, stepped=True)
    with torch.no_grad():
        model.layers[0].weight_hh.mul_(0.5)  # a new version: packed again
    got, _ = _windows(model, tokens, None, stepped=True)
    ref, _ = _windows(model, tokens, None, stepped=False)
    assert not torch.allclose(got, before)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    model.layers[0].weight_hh.data[0, 0] += 1.0  # through .data: no new version, the probe sees it
    got, _ = _windows(model, tokens, None, stepped=True)
    ref, _ = _windows(model, tokens, None, stepped=False)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_the_decoders_features_do_not_depend_on_the_thread_count():
    model = _model(hidden=256)
    tokens = torch.randint(0, 17, (40, 2))
    one, _ = _windows(model, tokens, None, stepped=True)
    torch.set_num_threads(2)  # the one_thread fixture puts it back
    two, _ = _windows(model, tokens, None, stepped=True)
    assert torch.equal(one, two)


def test_one_stream_scores_what_the_window_path_scores():
    model = _model(2)
    tokens = np.random.default_rng(0).integers(0, 17, 1201)
    cpu = resolve_runtime("cpu", "fp32")
    got, n = evaluate_predictions(model, tokens, cpu, EvalProtocol(1, 64))
    model.stepped = False
    ref, k = evaluate_predictions(model, tokens, cpu, EvalProtocol(1, 64))
    assert n == k == 1200 and got == pytest.approx(ref, rel=1e-6)


@pytest.mark.cpu_feature("bf16")
def test_under_bf16_autocast_the_decoder_rounds_as_autocast_does(monkeypatch):
    """Where the CPU has native bf16 the Decoder's bf16 products stand in for autocast's:
    within bf16's rounding of the window path under autocast."""
    if cpu_ext.load_extension().decoder_kernel() != "avx512-bf16dot":
        pytest.skip("the Decoder has no bf16 dot products in this build")
    calls = _spy(monkeypatch)
    model = _model(2)
    tokens = torch.randint(0, 17, (70, 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = _windows(model, tokens, None, stepped=True)
        ref, _ = _windows(model, tokens, None, stepped=False)
    assert len(calls) == 2
    torch.testing.assert_close(got, ref.float(), atol=2e-2, rtol=2e-2)


def test_threads_scoring_with_one_model_do_not_share_the_decoders_state():
    """Each thread steps its own Decoder: two threads scoring different texts at once get what
    each gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    model = _model()
    texts = [torch.randint(0, 17, (600, 1), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]

    def score(tokens):
        state, outs = None, []
        with torch.no_grad():
            for t in range(0, len(tokens), 20):
                x, state = model.features(tokens[t:t + 20], state)
                outs.append(x)
        return torch.cat(outs)

    alone = [score(t) for t in texts]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(score, texts))
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("table", [True, False])
def test_a_large_vocabulary_is_projected_per_window_not_tabled(table, monkeypatch):
    """Up to TABLE_MAX_BYTES layer 0 reads each token's row of a (V, 4H) table; above it the
    window's input projection is one product per window and the Decoder keeps no table (a
    sentencepiece vocabulary's would be hundreds of MB per cached Decoder). Both are the
    window path's features."""
    tables = []
    real = decoder_tiles.build_decoder
    monkeypatch.setattr(decoder_tiles, "build_decoder", lambda *a, **k: tables.append(k.get("layer0")) or real(*a, **k))
    model = _model(vocab=3000)
    table_bytes = 3000 * len(decoder_tiles.gate_columns(40)) * 4
    monkeypatch.setattr(decoder_tiles, "TABLE_MAX_BYTES", table_bytes if table else table_bytes - 1)
    tokens = torch.randint(0, 3000, (70, 2))
    got, (h, c) = _windows(model, tokens, None, stepped=True)
    assert tables == ["table" if table else "given"]
    ref, (rh, rc) = _windows(model, tokens, None, stepped=False)
    for a, b in ((got, ref), (h, rh), (c, rc)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_inference_mode_then_no_grad():
    """A Decoder first built under torch.inference_mode serves later calls under no_grad
    (its state buffers are ordinary tensors)."""
    model = _model()
    tokens = torch.randint(0, 17, (40, 1))
    with torch.inference_mode():
        first, _ = model.features(tokens)
    with torch.no_grad():
        again, _ = model.features(tokens)
    assert torch.equal(first, again)


def test_zlm_bench_times_the_cells_not_the_decoder(monkeypatch):
    """`zlm bench`'s infer phase (and scripts/recurrent-gemm-speed, which runs it) compares
    the cells: its models keep the window path at any batch size."""
    from zlm.tools import bench

    calls = _spy(monkeypatch)
    cfg = bench.BenchConfig(hidden=16, batch_size=2, bptt=5, vocab=11, embed=4)
    for impl in ("reference", "fused"):
        model = bench._build(impl, cfg, torch.device("cpu")).eval()
        with torch.no_grad():
            model.features(torch.randint(0, 11, (5, 2)))
    assert calls == []

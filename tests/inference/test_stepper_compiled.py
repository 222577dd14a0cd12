"""The sampler's step with the compiled kernels ("decode": the whole step in one C++ call;
"cpp": torch multiplies + the C++ element-wise step), fp32 and bf16 weights, against the
model's forward; the Decoder's packing, thread independence and checks."""

from __future__ import annotations

import pytest
import torch

import zlm.inference.stepper as stepper
from zlm.inference.stepper import Stepper
from zlm.model.cells import cpu_ext, decoder_tiles
from zlm.model.cells.decoder_tiles import gate_columns, interleave, pack_tiles
from zlm.model.lm import ModelConfig, ZoneoutLM


def _model(layers, hidden=24, vocab=13, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, hidden=hidden, embed=8, layers=layers, zoneout_cell=0.3,
                      zoneout_hidden=0.1)
    model = ZoneoutLM(cfg).to(dtype).eval()
    model.stepped = False  # the reference forward is the window path, not the Decoder under test
    return model


def _rollout(step, model, tokens):
    L, B, H = model.config.layers, tokens.shape[1], model.config.hidden
    g = torch.Generator().manual_seed(1)
    h0 = (torch.randn(L, B, H, generator=g) * 0.5).to(step.h.dtype)
    step.set_state(h0, h0 * 0.7)
    with torch.no_grad():
        ref, _ = model(tokens, (h0, h0 * 0.7))  # (T, B, V)
        got = torch.stack([step(tokens[t]).clone() for t in range(tokens.shape[0])])
    return got, ref


def _need_extension():
    if cpu_ext.load_extension() is None:
        pytest.skip(f"no compiled step: {cpu_ext.unavailable_reason()}")


@pytest.mark.parametrize("kernel", ["decode", "cpp"])
@pytest.mark.parametrize("layers", [1, 2])
def test_compiled_step_matches_forward_fp32_and_bf16(layers, kernel):
    _need_extension()
    model = _model(layers)
    tokens = torch.randint(0, 13, (30, 3), generator=torch.Generator().manual_seed(2))
    step = Stepper(model, 3, kernel=kernel)
    assert step.kernel == kernel and step.ext is not None and not step.lp
    got, ref = _rollout(step, model, tokens)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    step = Stepper(model, 3, lp=True, kernel=kernel)  # bf16 weights, fp32 state: 2e-2 relative
    got, ref = _rollout(step, model, tokens)
    assert step.lp and ((got - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("hidden,vocab", [(20, 45), (8, 32), (33, 70)])
def test_decode_pads_units_and_vocabulary(hidden, vocab):
    """Sizes that are not multiples of the tile: 8 units per tile, 32 decoder columns."""
    _need_extension()
    model = _model(2, hidden, vocab)
    tokens = torch.randint(0, vocab, (12, 2), generator=torch.Generator().manual_seed(4))
    step = Stepper(model, 2)
    assert step.kernel == "decode"
    got, ref = _rollout(step, model, tokens)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_decode_result_does_not_depend_on_threads():
    _need_extension()
    model = _model(2, hidden=64, vocab=40)
    tokens = torch.randint(0, 40, (8, 2), generator=torch.Generator().manual_seed(5))
    one, _ = _rollout(Stepper(model, 2, threads=1), model, tokens)
    two, _ = _rollout(Stepper(model, 2, threads=2), model, tokens)
    assert torch.equal(one, two)


@pytest.mark.parametrize("lp", [False, True])
@pytest.mark.parametrize("hidden", [33, 64])
def test_decode_row_does_not_depend_on_the_batch(lp, hidden):
    """Rows are stepped several at a time (4 with AVX-512): each row's logits and state are
    bit-identical to stepping that row alone, whatever its place in the batch (`zlm serve`'s
    text equals `zlm sample`'s). hidden=33: an odd depth (the bf16 pair layout's padding)."""
    _need_extension()
    model = _model(2, hidden=hidden, vocab=40)
    B, T = 7, 6  # one block of 4 and a remainder of 3
    tokens = torch.randint(0, 40, (T, B), generator=torch.Generator().manual_seed(8))
    together, _ = _rollout(Stepper(model, B, lp=lp), model, tokens)
    _assert_rows_alone_equal(model, tokens, together, (0, 3, 4, 6), lp)


def _assert_rows_alone_equal(model, tokens, together, rows, lp):
    """Each of `rows`, stepped alone from _rollout's state, gives exactly its logits in `together`."""
    (T, B), L, H = tokens.shape, model.config.layers, model.config.hidden
    h0 = torch.randn(L, B, H, generator=torch.Generator().manual_seed(1)) * 0.5  # the state _rollout sets
    for b in rows:
        alone = Stepper(model, 1, lp=lp)
        alone.set_state(h0[:, b : b + 1], h0[:, b : b + 1] * 0.7)
        with torch.no_grad():
            got = torch.stack([alone(tokens[t, b : b + 1]).clone() for t in range(T)])
        assert torch.equal(got[:, 0], together[:, b]), f"row {b} of {B} (lp={lp})"


def test_decode_follows_load_weights_and_checks_tokens():
    _need_extension()
    model = _model(1)
    step = Stepper(model, 3)
    with torch.no_grad():
        model.layers[0].weight_hh.mul_(1.5)
        model.decoder.bias.add_(0.25)
    step.load_weights(model)
    tokens = torch.randint(0, 13, (6, 3), generator=torch.Generator().manual_seed(6))
    got, ref = _rollout(step, model, tokens)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="out of range"):
        step(torch.tensor([0, 13, 1]))


def test_kernel_choice():
    _need_extension()
    assert Stepper(_model(1), 2).kernel == "decode"
    assert Stepper(_model(1), 2, kernel="cpp").kernel == "cpp"
    torch_step = Stepper(_model(1), 2, kernel="torch")
    assert torch_step.kernel == "torch" and torch_step.ext is None
    fp64 = Stepper(_model(1, dtype=torch.float64), 2)  # the Decoder is fp32-only
    assert fp64.kernel == "cpp"
    assert cpu_ext.load_extension().decoder_kernel() in ("avx512-bf16dot", "avx512", "avx2", "portable")
    with pytest.raises(ValueError, match="kernel"):
        Stepper(_model(1), 2, kernel="fast")


def test_packing_layout():
    """Tile t holds gates i, f, g, o of units 8t .. 8t+7; pads read column 4H (zero)."""
    H = 10
    cols = gate_columns(H)
    assert cols.shape == (64,)
    assert cols[:8].tolist() == list(range(8))  # i of units 0-7
    assert cols[8:16].tolist() == list(range(H, H + 8))  # f
    assert cols[32:34].tolist() == [8, 9] and set(cols[34:40].tolist()) == {4 * H}  # i of 8, 9, pads
    m = torch.arange(4 * H, dtype=torch.float32).view(1, -1) + 1
    assert interleave(m, H)[0, 58:64].tolist() == [0.0] * 6  # o of pad units
    w = torch.randn(5, 40)
    tiles = pack_tiles(w)
    assert tiles.shape == (2, 5, 32) and torch.equal(tiles[1, :, :8], w[:, 32:])
    assert torch.equal(tiles[1, :, 8:], torch.zeros(5, 24))


def test_torch_step_without_the_extension(monkeypatch):
    monkeypatch.setattr(stepper, "load_extension", lambda: None)
    model = _model(2)
    step = Stepper(model, 3, lp=True)  # no compiled step: fp32 torch ops, lp ignored
    assert step.ext is None and not step.lp and step.kernel == "torch"
    tokens = torch.randint(0, 13, (10, 3), generator=torch.Generator().manual_seed(3))
    got, ref = _rollout(step, model, tokens)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def _no_table(monkeypatch, model):
    """Lower TABLE_MAX_BYTES just under this model's (V, Np) table: the Stepper keeps none."""
    Np = len(gate_columns(model.config.hidden))
    monkeypatch.setattr(decoder_tiles, "TABLE_MAX_BYTES", model.config.vocab_size * Np * 4 - 1)


@pytest.mark.parametrize("kernel", ["decode", "cpp", "torch"])
@pytest.mark.parametrize("layers", [1, 2])
def test_step_without_the_table_matches_forward(monkeypatch, layers, kernel):
    """Above TABLE_MAX_BYTES (a sentencepiece vocabulary) layer 0's input projection is one
    product per step instead of a row of a (V, 4H) table: the same logits, fp32 and bf16."""
    if kernel != "torch":
        _need_extension()
    model = _model(layers, hidden=33, vocab=70)
    _no_table(monkeypatch, model)
    tokens = torch.randint(0, 70, (20, 3), generator=torch.Generator().manual_seed(9))
    step = Stepper(model, 3, kernel=kernel)
    assert step.kernel == kernel
    if kernel == "decode":  # the Decoder keeps the embedding (V, E), not the table (V, Np)
        assert tuple(step.decoder.table.shape) == (70, 8)
    else:
        assert step.table is None and tuple(step.emb.shape) == (70, 8)
    got, ref = _rollout(step, model, tokens)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if kernel != "torch":
        step = Stepper(model, 3, lp=True, kernel=kernel)
        got, ref = _rollout(step, model, tokens)
        assert ((got - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("lp", [False, True])
def test_decode_without_the_table_keeps_rows_independent(monkeypatch, lp):
    """The embedding's product runs in the Decoder's tiles, so a row's logits stay bit-identical
    to stepping it alone (what `zlm serve` relies on), and a window's features through `run`
    equal the looked-up Decoder's."""
    _need_extension()
    model = _model(2, hidden=33, vocab=70)
    B, T = 7, 5
    tokens = torch.randint(0, 70, (T, B), generator=torch.Generator().manual_seed(10))
    looked_up, _ = _rollout(Stepper(model, B, lp=lp), model, tokens)
    _no_table(monkeypatch, model)
    together, _ = _rollout(Stepper(model, B, lp=lp), model, tokens)
    torch.testing.assert_close(together, looked_up, atol=1e-5 if not lp else 2e-2, rtol=1e-5 if not lp else 2e-2)
    _assert_rows_alone_equal(model, tokens, together, (0, 4, 6), lp)


def test_decoder_layer0_modes_run_alike():
    """`run` through the embedding gives the table's features; it takes tokens only."""
    _need_extension()
    ext, model = cpu_ext.load_extension(), _model(2, hidden=20, vocab=45)
    tokens = torch.randint(0, 45, (6, 2), generator=torch.Generator().manual_seed(11))
    feats = {}
    for layer0 in ("table", "embed"):
        h, c = torch.zeros(2, 2, 20), torch.zeros(2, 2, 20)
        dec = decoder_tiles.build_decoder(ext, model, h, c, False, 1, layer0=layer0)
        feats[layer0] = torch.empty(6, 2, 20)
        dec.run(tokens, feats[layer0])
    torch.testing.assert_close(feats["embed"], feats["table"], atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="takes tokens"):
        dec.run(torch.zeros(6, 2, len(gate_columns(20))), feats["embed"])
    with pytest.raises(ValueError, match="layer0"):
        decoder_tiles.build_decoder(ext, model, h, c, False, 1, layer0="rows")

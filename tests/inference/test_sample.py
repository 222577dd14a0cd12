"""zlm.sample: the lean step against the model, seeds, greedy, truncation, likelihoods."""

from __future__ import annotations

import math

import pytest
import torch

from zlm.core.precision import resolve_runtime
from zlm.data.tokenizers import ByteTokenizer, CharTokenizer, train_tokenizer
from zlm.errors import UsageError
from zlm.inference.language_model import LanguageModel
from zlm.inference.sample import SampleConfig, Stepper, generate, sample_text
from zlm.model.cells import choose_cell
from zlm.model.lm import ModelConfig, ZoneoutLM, token_nll

CHARS = list("abcdefghijklmnopqrstuvwxyz ,.:\n")


def make_lm(tokenizer=None, layers=1, cell="auto", **kw) -> LanguageModel:
    tok = tokenizer or CharTokenizer(CHARS)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden=24, embed=8, layers=layers, **kw)
    choice = choose_cell(cell)
    model = ZoneoutLM(cfg, choice.fn)
    model.stepped = False  # the model's forward, the reference here, runs the window path, not the Decoder
    with torch.no_grad():  # sharper than the init, so greedy and top-k are not all ties
        model.decoder.weight.mul_(8)
    return LanguageModel(model.eval(), tok, resolve_runtime("cpu"), None, {}, choice)


@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("zoneout", [(0.5, 0.05), (0.0, 0.0)])
def test_step_matches_the_models_forward(layers, zoneout):
    lm = make_lm(layers=layers, zoneout_cell=zoneout[0], zoneout_hidden=zoneout[1], dropout=0.1)
    model = lm.model
    tokens = torch.randint(0, model.config.vocab_size, (40, 3))  # (T, B)
    with torch.no_grad():
        h0 = torch.randn(layers, 3, 24) * 0.5
        c0 = torch.randn(layers, 3, 24) * 0.5
        ref, (hT, cT) = model(tokens, (h0, c0))  # (T, B, V)
        step = Stepper(model, 3)
        step.set_state(h0, c0)
        got = torch.stack([step(tokens[t]).clone() for t in range(40)])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step.h, hT, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step.c, cT, atol=1e-5, rtol=1e-5)



def test_graph_replayed_step_equals_the_eager_one(monkeypatch):
    """The "torch" step replayed from a CUDA graph (forced on the CPU with the eager
    stand-in of a capture): the same logits and state bit for bit, the capture's warm-up
    steps undone, one capture until the weights are reloaded."""
    from conftest import EagerReplay, counting

    made = []
    monkeypatch.setattr(Stepper, "capture", counting(EagerReplay, made))
    model = make_lm(layers=2, zoneout_cell=0.5, zoneout_hidden=0.05).model
    tokens = torch.randint(0, model.config.vocab_size, (12, 3))
    h0, c0 = torch.randn(2, 3, 24) * 0.5, torch.randn(2, 3, 24) * 0.5
    runs = []
    with torch.no_grad():
        for graphs in (False, True):
            step = Stepper(model, 3, kernel="torch", graphs=graphs)
            step.set_state(h0, c0)
            out = torch.empty(3, model.config.vocab_size)
            logits = [step(tokens[t], out=out).clone() for t in range(6)]
            step.load_weights(model)
            logits += [step(tokens[t]).clone() for t in range(6, 12)]
            runs.append((torch.stack(logits), step.h.clone(), step.c.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    assert len(made) == 2  # once, and again after load_weights

def test_same_seed_same_text_and_batches():
    lm = make_lm()
    a = generate(lm, SampleConfig(length=60, prime="the ", seed=5))
    b = generate(lm, SampleConfig(length=60, prime="the ", seed=5))
    c = generate(lm, SampleConfig(length=60, prime="the ", seed=6))
    assert a == b and a[0].text != c[0].text
    many = generate(lm, SampleConfig(length=60, prime="the ", seed=5, num_samples=4))
    assert len(many) == 4 and all(len(s.text) == 60 for s in many)
    assert len({s.text for s in many}) == 4
    assert many == generate(lm, SampleConfig(length=60, prime="the ", seed=5, num_samples=4))


def test_greedy_equals_a_slow_argmax_rollout_and_top_k_1():
    lm = make_lm(layers=2)
    prime = "once upon a time"
    greedy = generate(lm, SampleConfig(length=30, prime=prime, temperature=0))[0].text
    ids = [int(i) for i in lm.tokenizer.encode(prime)]
    with torch.no_grad():  # re-runs the whole prefix every step: slow but obviously right
        for _ in range(30):
            logits, _ = lm.model(torch.tensor(ids)[:, None])
            ids.append(int(logits[-1, 0].argmax()))
    assert greedy == lm.tokenizer.decode(ids[len(prime):])
    top1 = generate(lm, SampleConfig(length=30, prime=prime, top_k=1, seed=3))[0].text
    tiny_p = generate(lm, SampleConfig(length=30, prime=prime, top_p=1e-6, seed=4))[0].text
    assert top1 == tiny_p == greedy


def _logits_along(lm, prime, text):
    """The model's logits (n, V) before each of the n generated tokens."""
    ids = torch.from_numpy(lm.tokenizer.encode(prime + text))[:, None]
    with torch.no_grad():
        logits, _ = lm.model(ids[:-1])
    p = len(prime)
    return logits[p - 1 :, 0], ids[p:, 0]


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_top_k_and_top_p_draw_only_inside_the_truncation(kernel):
    lm = make_lm()
    s = generate(lm, SampleConfig(length=60, prime="ab", top_k=3, seed=0), kernel=kernel)[0]
    logits, drawn = _logits_along(lm, "ab", s.text)
    top3 = logits.topk(3, -1).indices  # (n, 3)
    assert all(int(d) in top3[i].tolist() for i, d in enumerate(drawn))
    s = generate(lm, SampleConfig(length=60, prime="ab", top_p=0.5, seed=0), kernel=kernel)[0]
    logits, drawn = _logits_along(lm, "ab", s.text)
    probs = torch.softmax(logits, -1)
    for i, d in enumerate(drawn):  # d is in the smallest set with probability >= 0.5
        p_sorted = probs[i].sort(descending=True).values
        assert float(probs[i, d]) >= float(p_sorted[(p_sorted.cumsum(0) < 0.5).sum()]) - 1e-6


@pytest.mark.parametrize("impl", ["torch", "c++ probabilities", "c++ logits"])
def test_inverse_cdf_draw_follows_the_distribution(impl):
    """The torch form of the draw and the C++ draw (from probabilities or from logits):
    the boundary rule, zero weights never drawn, and the frequencies of 40,000 draws
    within 1.5% of the probabilities (6 standard deviations at p = 0.5)."""
    from zlm.inference.sample import _inverse_cdf
    from zlm.model.cells import cpu_ext

    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0]])
    if impl == "torch":
        def draw(u):
            out = torch.empty(len(u), 1, dtype=torch.long)
            return _inverse_cdf(probs.double().expand(len(u), -1), u, out)[:, 0]
    else:
        ext = cpu_ext.load_extension()
        if ext is None:  # (a failure under CI=true)
            pytest.skip(f"no compiled extension here: {cpu_ext.unavailable_reason()}")
        log = impl == "c++ logits"
        x = probs.log() if log else probs  # logits: softmax(log p) = p

        def draw(u):
            out = torch.empty(len(u), dtype=torch.long)
            ext.draw(x.expand(len(u), -1).contiguous(), u, 1.0, log, out)
            return out
    u = torch.tensor([0.0, 0.0999, 0.1001, 0.6999, 0.7001, 0.999999], dtype=torch.float64)
    want = [0, 0, 2, 2, 3, 3]
    assert draw(u).tolist() == want
    many = torch.rand(40000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    freq = torch.bincount(draw(many), minlength=5).double() / 40000
    assert (freq - probs[0].double()).abs().max() < 0.015 and freq[1] == 0 and freq[4] == 0


@pytest.mark.parametrize("temperature", [0.05, 1.0])
def test_temperature_scales_the_logits_of_the_draw(temperature):
    """How often the argmax is drawn matches the tempered distribution's own mass on it
    (400 draws: within 0.1)."""
    lm = make_lm()
    s = generate(lm, SampleConfig(length=400, prime="ab", temperature=temperature, seed=1))[0]
    logits, drawn = _logits_along(lm, "ab", s.text)
    expected = torch.softmax(logits / temperature, -1).max(-1).values.mean()
    assert abs((drawn == logits.argmax(-1)).float().mean() - expected) < 0.1


def test_the_prefix_is_never_rerun(monkeypatch):
    lm = make_lm()
    calls = []
    forward = lm.model.forward

    def counting(tokens, state=None):
        calls.append(tuple(tokens.shape))
        return forward(tokens, state)

    monkeypatch.setattr(lm.model, "forward", counting)
    generate(lm, SampleConfig(length=50, prime="abc abc", seed=0, num_samples=2))
    assert calls == [(7, 1)]  # the prime once; every later step goes through the Stepper


def test_log_likelihood_is_the_models_own():
    lm = make_lm()
    s = generate(lm, SampleConfig(length=40, prime="hello", temperature=0.7, top_k=5, seed=1))[0]
    ids = torch.from_numpy(lm.tokenizer.encode("hello" + s.text))[:, None]
    with torch.no_grad():
        logits, _ = lm.model(ids[:-1])
        nats = float(token_nll(logits[4:], ids[5:]))  # the 40 generated tokens only
    assert s.nats == pytest.approx(nats, rel=1e-5)
    assert s.log_likelihood_per_token == pytest.approx(-nats / 40, rel=1e-5)
    assert s.bits_per_char == pytest.approx(nats / 40 / math.log(2), rel=1e-5)


def test_log_likelihood_across_the_logits_ring(monkeypatch):
    """Likelihoods are computed every CHUNK tokens from a ring of logits: wrap it."""
    import zlm.inference.sample as sample

    monkeypatch.setattr(sample, "CHUNK", 7)
    lm = make_lm(layers=2)
    many = generate(lm, SampleConfig(length=40, prime="ab", seed=3, num_samples=2))
    for s in many:
        ids = torch.from_numpy(lm.tokenizer.encode("ab" + s.text))[:, None]
        with torch.no_grad():
            logits, _ = lm.model(ids[:-1])
            nats = float(token_nll(logits[1:], ids[2:]))
        assert s.nats == pytest.approx(nats, rel=1e-5)


def test_streaming_pieces_add_up_to_the_sample():
    lm = make_lm()
    pieces = []
    s = generate(lm, SampleConfig(length=25, prime="ab", seed=2), on_text=pieces.append)[0]
    assert pieces[0] == "ab" and len(pieces) == 26
    assert "".join(pieces) == "ab" + s.text == sample_text(lm, SampleConfig(length=25, prime="ab", seed=2))


def test_prime_outside_the_vocabulary():
    lm = make_lm()
    with pytest.raises(UsageError, match=r"--prime: character 'Q' \(U\+0051\) at character 2"):
        generate(lm, SampleConfig(length=5, prime="abQ"))
    byte_lm = make_lm(ByteTokenizer())
    out = generate(byte_lm, SampleConfig(length=5, prime="naïve ☃", seed=0))[0]
    assert out.prime == "naïve ☃" and out.tokens == 5
    sp = train_tokenizer("bpe", "the cat sat on the mat.\n" * 50, vocab_size=300)
    sp_lm = make_lm(sp)
    out = generate(sp_lm, SampleConfig(length=5, prime="zebra ☃ qué", seed=0))[0]  # byte fallback
    assert out.tokens == 5


@pytest.mark.parametrize("bad", [dict(length=0), dict(temperature=-1), dict(top_k=-2),
                                 dict(top_p=0.0), dict(top_p=1.5), dict(num_samples=0)])
def test_config_is_checked(bad):
    with pytest.raises(UsageError):
        SampleConfig(**bad)


def test_streaming_reads_tokens_back_once_per_chunk_where_asked(tmp_path, monkeypatch):
    """On CUDA the stream reads the drawn tokens once per STREAM_EVERY steps (a read is a
    sync); forced on the CPU here: the same text arrives, in chunks, with one read each."""
    from zlm.inference import sample as sample_mod

    lm = make_lm()
    cfg = sample_mod.SampleConfig(prime="the ", length=100, seed=3)
    whole = sample_mod.generate(lm, cfg)[0].text
    monkeypatch.setitem(sample_mod.STREAM_EVERY, "cpu", 16)
    pieces = []
    reads = {"n": 0}
    tolist = torch.Tensor.tolist

    def counted(self):
        reads["n"] += 1
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    got = sample_mod.generate(lm, cfg, on_text=pieces.append)[0].text
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    assert got == whole and "".join(pieces) == "the " + whole
    assert reads["n"] == -(-100 // 16) + 1  # one per chunk of 16 tokens, and the final collection


@pytest.mark.gpu
def test_graph_replayed_step_cuda():
    """On CUDA the Stepper replays its step from a CUDA graph: the logits of the eager step
    to 1e-5, and sampling with a seed gives the same text either way."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = make_lm(layers=2, zoneout_cell=0.5, zoneout_hidden=0.05).model.cuda()
    tokens = torch.randint(0, model.config.vocab_size, (20, 4), device="cuda")
    runs = []
    with torch.no_grad():
        for graphs in (False, True):
            step = Stepper(model, 4, graphs=graphs)
            assert step.kernel == "torch" and step.graphs == graphs
            runs.append(torch.stack([step(tokens[t]).clone() for t in range(20)]))
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=1e-5)

"""zlm.evaluate: BPC against an independent slow loop, stream-count effect, counts."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import shakespeare_text, train_run, write_char_dataset
from zlm.cli import app
from zlm.core.config import TrainConfig
from zlm.core.eval_protocol import (
    COLD_START_BITS,
    STREAM_CONTEXT,
    EvalProtocol,
    evaluate_predictions,
    evaluate_tokens,
)
from zlm.core.precision import resolve_runtime
from zlm.data.dataset import Dataset
from zlm.errors import DataError, UsageError
from zlm.inference.adapt_config import CacheConfig
from zlm.inference.language_model import load
from zlm.model.lm import ModelConfig, ZoneoutLM


def train_tiny(run_dir, data_dir, steps=20):
    data = Dataset.open(data_dir)
    train_run(run_dir, data, ModelConfig(vocab_size=data.vocab_size, hidden=32, embed=8),
          TrainConfig(batch_size=4, bptt=32, max_steps=steps, eval_every=steps, log_every=100,
                      eval_streams=4))
    return run_dir


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    data = write_char_dataset(root / "data", shakespeare_text(40_000))
    return train_tiny(root / "run", data)


@functools.lru_cache
def reference_model(run_dir) -> ZoneoutLM:
    lm = load(run_dir)  # only for its weights' path and model config
    model = ZoneoutLM(lm.model.config)  # reference cell by default
    model.load_state_dict(load_file(str(lm.path / "model.safetensors")))
    return model.eval()


def slow_nats(run_dir, ids) -> np.ndarray:
    """The NLL (nats) of each prediction ids[i] -> ids[i+1]: one token at a time from a zero
    state, state carried, (1, 1) tokens, the reference cell."""
    model = reference_model(run_dir)
    ids = [int(i) for i in ids]
    out, state = [], None
    with torch.no_grad():
        for a, b in zip(ids[:-1], ids[1:], strict=True):
            logits, state = model(torch.tensor([[a]]), state)
            out.append(-float(torch.log_softmax(logits[0, 0].double(), -1)[b]))
    return np.array(out)


def slow_bpc(run_dir, text: str) -> float:
    ids = load(run_dir).tokenizer.encode("\n" + text)
    return float(slow_nats(run_dir, ids).sum()) / len(text) / math.log(2)


def check_streams_against_the_slow_loop(run_dir, ids, streams: int, bpc: float,
                                       context: int = STREAM_CONTEXT) -> None:
    """`bpc`, scored with `streams` streams over the predictions of `ids`, against the slow loop.

    The protocol cuts the n predictions into S contiguous streams of L = n // S (the last
    one continuing to n); each stream after the first reads the W = min(context, L) tokens
    before its piece from a zero state, unscored. So the S-stream sum is exactly the slow
    loop run on each piece with its W tokens before it, its piece's predictions added up:
    equal up to the float rounding the single-stream check allows (1e-5 BPC), not within a
    slack. What S streams add over one is then, stream by stream, the excess over the piece
    scored with the whole text's state carried in: within the documented COLD_START_BITS
    when streams start cold (context 0), and a small share of that with the context."""
    n = len(ids) - 1
    L = n // streams
    W = min(context, L) if streams > 1 else 0
    pieces = [(s * L, (s + 1) * L if s < streams - 1 else n) for s in range(streams)]
    warm = slow_nats(run_dir, ids)  # one stream: every piece scored with the state carried in
    before = [W if s else 0 for s in range(streams)]  # context tokens read before each piece
    scored = [float(slow_nats(run_dir, ids[a - w:b + 1])[w:].sum()) for (a, b), w in zip(pieces, before, strict=True)]
    assert bpc == pytest.approx(sum(scored) / n / math.log(2), abs=1e-5)
    excess_bits = [(c - warm[a:b].sum()) / math.log(2) for c, (a, b) in zip(scored, pieces, strict=True)]
    assert excess_bits[0] == pytest.approx(0, abs=1e-6)  # the first stream starts where one stream does
    assert max(excess_bits) <= COLD_START_BITS, excess_bits
    if W >= 32:  # the context leaves little of the cold start (32 tokens: an eighth of the default)
        assert max(abs(e) for e in excess_bits) <= COLD_START_BITS / 25, excess_bits


def test_eval_matches_an_independent_slow_loop(run, tmp_path):
    text = shakespeare_text(40_000)[38_000:39_000]
    f = tmp_path / "t.txt"
    f.write_text(text, encoding="utf-8")
    expected = slow_bpc(run, text)
    runner = CliRunner()
    got = {}
    for bptt in (256, 7):
        res = runner.invoke(app, ["eval", str(run), "--file", str(f), "--batch-size", "1",
                                  "--bptt", str(bptt), "--json"])
        assert res.exit_code == 0, res.output
        got[bptt] = json.loads(res.stdout)
        assert got[bptt]["characters"] == len(text) and got[bptt]["tokens"] == len(text)
        assert got[bptt]["bpc"] == pytest.approx(expected, abs=1e-5)
    ids = load(run).tokenizer.encode("\n" + text)
    for context in ([], ["--stream-context", "0"], ["--stream-context", "40", "--bptt", "7"]):  # 6 windows of context
        res = runner.invoke(app, ["eval", str(run), "--file", str(f), "--batch-size", "8", "--json", *context])
        multi = json.loads(res.stdout)
        assert multi["characters"] == len(text)
        check_streams_against_the_slow_loop(run, ids, 8, multi["bpc"], int(context[1]) if context else STREAM_CONTEXT)
    res = runner.invoke(app, ["eval", str(run), "--file", str(f), "--batch-size", "8", "--stream-context", "-1"])
    assert res.exit_code == 2 and "--stream-context must be >= 0" in res.output


def test_the_commands_default_stream_context_is_the_protocols():
    """`zlm eval` and `zlm score` spell the default out (the CLI does not import torch at
    start-up, where STREAM_CONTEXT lives): it must stay the protocol's."""
    import typer.main

    group = typer.main.get_command(app)
    for name in ("eval", "score"):
        (option,) = [p for p in group.commands[name].params if "--stream-context" in p.opts]
        assert option.default == STREAM_CONTEXT, name


@pytest.mark.parametrize("context", [STREAM_CONTEXT, 0])
def test_stream_count_changes_bpc_by_at_most_the_documented_cold_start(run, context):
    lm = load(run)
    scores = {s: lm.evaluate_split("valid", streams=s, stream_context=context) for s in (1, 16, 64)}
    one = scores[1]
    tokens = Dataset.open(run.parent / "data").tokens("valid")  # (the run's DATA_DIR)
    assert one.tokens == len(tokens) - 1 == one.characters  # a char model: a token a character
    for s, score in scores.items():
        assert (score.tokens, score.characters) == (one.tokens, one.characters)
        check_streams_against_the_slow_loop(run, tokens, s, score.bpc, context)
    if context:  # 124 tokens of context (16 streams) take away all but 1% of the cold starts
        cold = lm.evaluate_split("valid", streams=16, stream_context=0).bpc - one.bpc
        assert cold > 0.05 and abs(scores[16].bpc - one.bpc) < 0.01 * cold


def test_the_python_api_scores_with_the_cache(run):
    """cache=True is `zlm eval --cache` with its defaults; a CacheConfig sets it; lambda 0
    is the static score."""
    lm = load(run)
    static = lm.evaluate_split("valid", streams=4)
    cached = lm.evaluate_split("valid", streams=4, cache=True)
    res = CliRunner().invoke(app, ["eval", str(run), "--batch-size", "4", "--cache", "--json"])
    assert cached.bpc == pytest.approx(json.loads(res.stdout)["bpc"], rel=1e-9)
    assert (cached.tokens, cached.characters) == (static.tokens, static.characters)
    zero = lm.evaluate_split("valid", streams=4, cache=CacheConfig(mix=0.0))
    assert zero.bpc == pytest.approx(static.bpc, rel=1e-6) and cached.bpc != static.bpc
    one = json.loads(CliRunner().invoke(app, ["eval", str(run), "--cache", "--json"]).stdout)
    assert lm.evaluate_split("valid", cache=True).bpc == pytest.approx(one["bpc"], rel=1e-9)  # 1 stream
    text = "First Citizen:\nSpeak, speak.\n" * 3
    assert lm.evaluate_text(text, cache=True).characters == len(text)


@pytest.mark.parametrize("n", [1, 2, 17, 100, 257])
@pytest.mark.parametrize("streams", [1, 3, 16])
def test_every_prediction_is_counted_once(n, streams):
    torch.manual_seed(0)
    model = ZoneoutLM(ModelConfig(vocab_size=5, hidden=4, embed=3)).eval()
    tokens = np.random.default_rng(0).integers(0, 5, n).astype(np.uint8)
    rt = resolve_runtime("cpu")
    nats, count = evaluate_predictions(model, tokens, rt, EvalProtocol(streams, bptt=10))
    assert count == n - 1
    if n > 1:  # one stream gives the same sum as the plain loop over windows of any size
        ref, _ = evaluate_predictions(model, tokens, rt, EvalProtocol(1, bptt=n))
        one, _ = evaluate_predictions(model, tokens, rt, EvalProtocol(1, bptt=3))
        assert one == pytest.approx(ref, rel=1e-6)


def test_a_sample_scores_the_same_pieces_of_each_stream_and_their_share_of_the_characters(run):
    # --eval-tokens: S streams start where they would for the whole split and score only
    # their first sample // S predictions, each after the first with the W = min(256, L)
    # tokens before it read as context: the slow loop on each piece with its context,
    # added up (the float rounding the whole-split check allows).
    tokens = Dataset.open(run.parent / "data").tokens("valid")
    n, S, sample = len(tokens) - 1, 4, 401
    L, per = n // S, 401 // 4
    lm = load(run)
    model, rt = lm.model, lm.runtime
    nats, count = evaluate_predictions(model, tokens, rt, EvalProtocol(S, sample=sample))
    assert count == S * per == 400
    W = min(STREAM_CONTEXT, L)
    pieces = [float(slow_nats(run, tokens[s * L - w:s * L + per + 1])[w:].sum())
              for s, w in enumerate([0] + [W] * (S - 1))]
    assert nats == pytest.approx(sum(pieces), rel=1e-6)
    # Characters: the split's per prediction (a char model: one each); the whole split
    # when the sample covers it.
    data = Dataset.open(run.parent / "data")
    info = data.split_info("valid")
    score = evaluate_tokens(model, tokens, data.tokenizer, info.characters, info.bytes, rt, EvalProtocol(S, sample=sample))
    assert (score.tokens, score.characters) == (400, 400)
    whole = evaluate_tokens(model, tokens, data.tokenizer, info.characters, info.bytes, rt, EvalProtocol(S))
    for covering in (n, n + 5):
        again = evaluate_tokens(model, tokens, data.tokenizer, info.characters, info.bytes, rt,
                                EvalProtocol(S, sample=covering))
        assert (again.nats, again.tokens, again.characters, again.bytes) == (
            whole.nats, whole.tokens, whole.characters, whole.bytes)
    with pytest.raises(UsageError, match="--eval-tokens must be >= 0"):
        EvalProtocol(S, sample=-1)


def test_blocks_of_a_large_vocabularys_logits_score_what_the_whole_window_does(monkeypatch):
    # On a CPU the decoder and the loss run over blocks of NLL_BLOCK logits: forced down to
    # a few rows per block (uneven last blocks, the tail stream's short windows too), the
    # sum is the whole windows' up to fp32 summation order.
    from zlm.core import eval_protocol

    torch.manual_seed(0)
    model = ZoneoutLM(ModelConfig(vocab_size=700, hidden=16, embed=8)).eval()
    tokens = np.random.default_rng(0).integers(0, 700, 3001).astype(np.uint16)
    rt = resolve_runtime("cpu", "fp32")
    calls = []
    model.decoder.register_forward_hook(lambda mod, args, out: calls.append(out.shape[0]))
    whole = evaluate_predictions(model, tokens, rt, EvalProtocol(7, bptt=50))
    assert 7 * 50 * 700 < eval_protocol.NLL_BLOCK  # the default: one decoder call per window here
    windows, calls[:] = len(calls), []
    monkeypatch.setattr(eval_protocol, "NLL_BLOCK", 700 * 9)  # 9 rows a block
    blocked = evaluate_predictions(model, tokens, rt, EvalProtocol(7, bptt=50))
    assert len(calls) > 30 * windows and max(calls) == 9
    assert blocked[1] == whole[1] == 3000 and blocked[0] == pytest.approx(whole[0], rel=1e-6)


def test_char_byte_and_bpe_models_are_scored_over_the_same_characters(tmp_path):
    from zlm.data.prepare import PrepareConfig, prepare

    text = ("Crème brûlée, naïve café — déjà vu.\n" * 20) + shakespeare_text(20_000)
    src = tmp_path / "corpus.txt"
    src.write_text(text, encoding="utf-8")
    probe = "Crème brûlée at the café.\nFirst Citizen: déjà vu — speak, speak.\n"
    scores = {}
    for kind in ("char", "byte", "bpe"):
        cfg = PrepareConfig(tokenizer=kind, vocab_size=400 if kind == "bpe" else None,
                            split=(0.9, 0.05, 0.05))
        prepare(str(src), tmp_path / f"data-{kind}", cfg)
        lm = load(train_tiny(tmp_path / f"run-{kind}", tmp_path / f"data-{kind}", steps=3))
        scores[kind] = lm.evaluate_text(probe)
    assert {s.characters for s in scores.values()} == {len(probe)}
    assert {s.bytes for s in scores.values()} == {len(probe.encode("utf-8"))}
    assert scores["byte"].tokens == len(probe.encode("utf-8"))
    assert scores["bpe"].tokens < scores["char"].tokens == len(probe)
    for s in scores.values():
        assert math.isfinite(s.bpc) and s.bits_per_byte < s.bpc


def test_unknown_characters_in_a_text_error_or_are_replaced(run, tmp_path):
    lm = load(run)
    with pytest.raises(DataError, match=r"'€' \(U\+20AC\) at character 3"):
        lm.evaluate_text("abc€d")
    from zlm.data.prepare import PrepareConfig, prepare

    src = tmp_path / "c.txt"
    src.write_text(shakespeare_text(20_000), encoding="utf-8")
    prepare(str(src), tmp_path / "d", PrepareConfig(unknown="replace"))
    lm2 = load(train_tiny(tmp_path / "r", tmp_path / "d", steps=2))
    score = lm2.evaluate_text("abc€d", unknown="replace")
    assert score.characters == 5 and score.tokens == 5


def test_split_evaluation_needs_the_training_data(run, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    lm = load(copy)
    cfg = json.loads((lm.path / "config.json").read_text())
    data = tmp_path / "moved-data"
    shutil.copytree(cfg["data"]["path"], data)
    lm.spec = replace(lm.spec, data=replace(lm.spec.data, path=str(tmp_path / "gone")))
    with pytest.raises(DataError, match="is gone; evaluate a text file instead with --file"):
        lm.evaluate_split("valid")
    lm.spec = replace(lm.spec, data=replace(lm.spec.data, path=str(data)))
    assert lm.evaluate_split("test").tokens == Dataset.open(data).split_info("test").tokens - 1


def test_graph_replayed_windows_equal_eager_ones(run, monkeypatch):
    """The CUDA-graph path of evaluation (forced on the CPU with the eager stand-in of a
    capture): every window shape captured once, the same nats bit for bit; a capture that
    fails warns and leaves the evaluation eager with the same result."""
    from conftest import EagerReplay, counting
    from zlm.core import graphs

    lm = load(run)
    tokens = Dataset.open(run.parent / "data").tokens("valid")
    protocol = EvalProtocol(7, bptt=50)  # 7 streams, a shorter last window, a tail stream
    eager = evaluate_predictions(lm.model, tokens, lm.runtime, protocol, graphs=False)
    made = []
    monkeypatch.setattr(graphs.WindowStep, "capture", counting(EagerReplay, made))
    assert evaluate_predictions(lm.model, tokens, lm.runtime, protocol, graphs=True) == eager
    assert 3 <= len(made) <= graphs.MAX_SHAPES

    def broken(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs.WindowStep, "capture", broken)
    with pytest.warns(UserWarning, match="evaluation runs eagerly"):
        assert evaluate_predictions(lm.model, tokens, lm.runtime, protocol, graphs=True) == eager


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graph_replayed_evaluation_cuda(precision):
    """On CUDA with the fused cell: replayed windows give the eager nats (1e-6 relative in
    fp32; bf16's matmuls may pick other kernels inside a capture: 1e-3)."""
    from conftest import counting
    from zlm.core import graphs
    from zlm.core.precision import Runtime
    from zlm.model.cells import choose_cell

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, hidden=64, layers=2, embed=16, zoneout_cell=0.5, zoneout_hidden=0.05)
    model = ZoneoutLM(cfg, choose_cell("auto", "cuda").fn).cuda().eval()
    tokens = np.random.default_rng(0).integers(0, 40, 5_000).astype(np.uint8)
    rt = Runtime(torch.device("cuda"), precision)
    protocol = EvalProtocol(16, bptt=64)
    eager, n = evaluate_predictions(model, tokens, rt, protocol, graphs=False)
    made = []
    original = graphs.WindowStep.capture
    graphs.WindowStep.capture = counting(original, made)
    try:
        graphed, m = evaluate_predictions(model, tokens, rt, protocol)
    finally:
        graphs.WindowStep.capture = original
    assert m == n and made
    assert graphed == pytest.approx(eager, rel=1e-6 if precision == "fp32" else 1e-3)

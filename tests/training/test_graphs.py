"""CUDA graphs for training windows (zlm.graphs).

Without a GPU: the choice (`--cuda-graphs auto|on|off`, and why it is off), the eager
`WindowStep` against the training step written out by hand (loss, gradients, state), and
the trainer saying which it chose. On CUDA (marked gpu): a graph-replayed window against
the eager one - same loss, gradients and state to 1e-5 (fp32; the Triton cell's kernels
are the same, only the launch differs), masks identical after the RNG is restored, a
changed input honoured by the next replay, training through `zlm.train` with graphs on.
"""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from conftest import EagerReplay, train_run
from zlm.core.config import TrainConfig
from zlm.core.graphs import CapturedStep, WindowStep
from zlm.core.precision import Runtime
from zlm.data.dataset import Dataset
from zlm.errors import UsageError
from zlm.model.cells import choose_cell
from zlm.model.lm import ModelConfig, ZoneoutLM, token_nll
from zlm.training.graphs import graphs_unavailable_reason, resolve_graphs
from zlm.training.step import forward_backward

CPU = Runtime(torch.device("cpu"), "fp32")
CUDA = Runtime(torch.device("cuda"), "fp32")


def test_graphs_off_reasons():
    assert graphs_unavailable_reason(CPU, "fused", 1, False) == "not on CUDA"
    assert "reference" in graphs_unavailable_reason(CUDA, "reference", 1, False)
    assert "DistributedDataParallel" in graphs_unavailable_reason(CUDA, "fused", 2, False)
    assert "GradScaler" in graphs_unavailable_reason(CUDA, "fused", 1, True)
    assert "hook" in graphs_unavailable_reason(CUDA, "fused", 1, False, hooked=True)
    assert graphs_unavailable_reason(CUDA, "fused", 1, False) is None


def test_resolve_graphs_modes():
    assert resolve_graphs("auto", None)[0] is True
    assert resolve_graphs("on", None)[0] is True
    on, line = resolve_graphs("auto", "not on CUDA")
    assert not on and line == "off (not on CUDA)"
    assert resolve_graphs("off", None) == (False, "off (--cuda-graphs off)")
    with pytest.raises(UsageError, match="--cuda-graphs on is not possible here: not on CUDA"):
        resolve_graphs("on", "not on CUDA")
    with pytest.raises(UsageError, match="pass auto, on or off"):
        resolve_graphs("sometimes", None)
    with pytest.raises(UsageError, match="--cuda-graphs"):
        TrainConfig(cuda_graphs="yes")


def test_captured_step_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="need CUDA tensors"):
        CapturedStep(lambda x: (x,), [torch.zeros(2)])


def _model(device, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=11, hidden=24, layers=layers, embed=8, zoneout_cell=0.5, zoneout_hidden=0.1)
    return ZoneoutLM(cfg, choose_cell("auto", device).fn).to(device)


def window_step(model, runtime, scaler, graphs=False) -> WindowStep:
    """The trainer's forward_backward wrapped the way the trainer wraps it."""
    fn = partial(forward_backward, model, runtime, scaler, cache=not graphs)
    return WindowStep(fn, [p for p in model.parameters() if p.requires_grad], graphs=graphs)


def _batch(device, T=7, B=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(11, (T + 1, B), generator=g).to(device)
    return tokens[:-1], tokens[1:]


def test_eager_window_step_is_the_training_step():
    """WindowStep(graphs=False) = forward, mean nats per token, backward (by hand)."""
    x, y = _batch("cpu")
    a, b = _model("cpu"), _model("cpu")
    a.train()
    b.train()
    state = a.initial_state(x.shape[1])
    torch.manual_seed(5)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss, (h, c) = window_step(a, CPU, scaler)(x, y, state)
    torch.manual_seed(5)
    logits, (h2, c2) = b(x, state)
    want = token_nll(logits, y) / y.numel()
    want.backward()
    assert loss.shape == () and not loss.requires_grad and not h.requires_grad
    torch.testing.assert_close(loss, want.detach(), rtol=0, atol=0)
    torch.testing.assert_close((h, c), (h2.detach(), c2.detach()), rtol=0, atol=0)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_trainer_says_graphs_are_off_on_cpu(tiny_data, tmp_path):
    class Rec:
        def __init__(self):
            self.start_info = None

        def start(self, info):
            self.start_info = info

        def __getattr__(self, name):
            return lambda *a, **k: None

    rep = Rec()
    cfg = TrainConfig(batch_size=4, bptt=16, max_steps=2, eval_every=2, device="cpu")
    train_run(tmp_path / "run", Dataset.open(tiny_data), ModelConfig(vocab_size=Dataset.open(tiny_data).vocab_size,
          hidden=16, embed=8), cfg, reporter=rep)
    assert rep.start_info["cuda graphs"] == "off (not on CUDA)"
    with pytest.raises(UsageError, match="--cuda-graphs on is not possible here"):
        train_run(tmp_path / "run2", Dataset.open(tiny_data), ModelConfig(vocab_size=Dataset.open(tiny_data).vocab_size,
              hidden=16, embed=8), TrainConfig(batch_size=4, bptt=16, max_steps=2, device="cpu",
                                                cuda_graphs="on"), reporter=rep)


# ------------------------------------- the replay contract on the CPU (eager stand-in)


def test_replayed_windows_equal_eager_ones_on_cpu(monkeypatch):
    """Windows of two shapes, state carried, grads set to None between steps (as the
    trainer does): replay == eager bit for bit, one capture per shape, eager beyond."""
    monkeypatch.setattr(WindowStep, "capture", EagerReplay)
    monkeypatch.setattr("zlm.core.graphs.MAX_SHAPES", 2)
    eager_m, graph_m = _model("cpu"), _model("cpu")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    eager, graphed = window_step(eager_m, CPU, scaler), window_step(graph_m, CPU, scaler, graphs=True)
    s_e = s_g = eager_m.initial_state(3)
    for k, T in enumerate((7, 7, 5, 7, 4, 5)):  # 4 is a third shape: run eagerly
        x, y = _batch("cpu", T=T, seed=10 + k)
        torch.manual_seed(100 + k)
        le, s_e = eager(x, y, s_e)
        torch.manual_seed(100 + k)
        lg, s_g = graphed(x, y, s_g)
        assert torch.equal(lg, le) and torch.equal(s_g[0], s_e[0]) and torch.equal(s_g[1], s_e[1])
        for (name, p), q in zip(graph_m.named_parameters(), eager_m.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name
        with torch.no_grad():  # an optimizer step, then grads dropped, as in zlm.train
            for m in (eager_m, graph_m):
                for p in m.parameters():
                    p -= 0.1 * p.grad
                m.zero_grad(set_to_none=True)
    assert len(graphed.captured) == 2 and graphed.replays == 5


def test_trainer_through_the_replay_path_equals_eager(tiny_data, tmp_path, monkeypatch):
    """zlm.train with graphs forced on (eager stand-in): the same losses, checkpoints and
    validation as with graphs off, over validations, checkpoints and a resume."""
    import zlm.training.trainer as zt

    data = Dataset.open(tiny_data)
    mc = ModelConfig(vocab_size=data.vocab_size, hidden=16, embed=8, zoneout_cell=0.3, zoneout_hidden=0.1)

    def run(name, graphs):
        if graphs:
            monkeypatch.setattr(WindowStep, "capture", EagerReplay)
            monkeypatch.setattr(zt, "graphs_unavailable_reason", lambda *a, **k: None)
        cfg = TrainConfig(batch_size=4, bptt=16, max_steps=6, eval_every=3, device="cpu",
                          cuda_graphs="on" if graphs else "off")
        train_run(tmp_path / name, data, mc, cfg)
        train_run(tmp_path / name, data, mc, TrainConfig(**{**cfg.to_dict(), "max_steps": 10}), resume=True)
        monkeypatch.undo()
        events = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [e["cuda_graphs"] for e in events if e["event"] == "start"] == [graphs, graphs]
        return ([e["loss"] for e in events if e["event"] == "step"],
                [e["valid_bpc"] for e in events if e["event"] == "eval"])

    assert run("graphed", True) == run("eager", False)


# ------------------------------------------------------------------------------ CUDA

def _need_cuda_fused():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    choice = choose_cell("auto", "cuda")
    if choice.name != "fused":
        pytest.skip(choice.reason)


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graph_replay_matches_eager_cuda(precision):
    """Three windows in a row, state carried, new tokens each time: replay == eager."""
    _need_cuda_fused()
    rt = Runtime(torch.device("cuda"), precision)
    tol = dict(rtol=1e-5, atol=1e-5) if precision == "fp32" else dict(rtol=2e-2, atol=2e-2)
    eager_m, graph_m = _model("cuda"), _model("cuda")
    eager_m.train()
    graph_m.train()
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    eager = window_step(eager_m, rt, scaler, graphs=False)
    graphed = window_step(graph_m, rt, scaler, graphs=True)
    s_e = s_g = eager_m.initial_state(3, "cuda")
    for k in range(3):
        x, y = _batch("cuda", seed=10 + k)
        torch.manual_seed(100 + k)
        le, s_e = eager(x, y, s_e)
        ge = _grads(eager_m)
        torch.manual_seed(100 + k)  # the same masks: the graph reads the generator's state
        lg, s_g = graphed(x, y, s_g)
        gg = _grads(graph_m)
        torch.testing.assert_close(lg, le, **tol)
        torch.testing.assert_close(s_g, s_e, **tol)
        for a, b in zip(gg, ge, strict=True):
            torch.testing.assert_close(a, b, **tol)
        for m in (eager_m, graph_m):
            m.zero_grad(set_to_none=True)  # as the trainer does; replay reattaches grads
    assert graphed.replays == 3 and len(graphed.captured) == 1


@pytest.mark.gpu
def test_training_with_graphs_cuda(tiny_data, tmp_path):
    """zlm.train on CUDA with graphs on: it learns, and the run says graphs were used."""
    _need_cuda_fused()
    data = Dataset.open(tiny_data)
    cfg = TrainConfig(batch_size=8, bptt=32, max_steps=60, eval_every=60, device="cuda", precision="bf16",
                      cuda_graphs="on", lr=3e-3)
    summary = train_run(tmp_path / "run", data, ModelConfig(vocab_size=data.vocab_size, hidden=64, embed=16), cfg)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [s["loss"] for s in steps if s["event"] == "step"]
    assert len(losses) == 60 and losses[-1] < losses[0] - 0.5
    assert summary["best_valid_bpc"] < 5.0

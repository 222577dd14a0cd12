"""Throughput of the zoneout cells against torch.nn.LSTM, measured in one process.

Three implementations of the same character language model (embedding -> one LSTM layer
-> linear decoder -> cross-entropy) run at the same sizes (the loss: F.cross_entropy for
nn.LSTM, zlm's training loss `zlm.model.lm.training_nll` for zlm's models):

- `nn.LSTM`: torch.nn.LSTM (oneDNN on the CPU, cuDNN on CUDA), no zoneout - the bar;
- `reference`: `zlm.model.ZoneoutLM` with the reference cell, zoneout z_c 0.5, z_h 0.05;
- `fused`: the same model with the cell `choose_cell("fused", device)` picks;
- `fused+graphs` (CUDA only): the fused model with each window's forward (and backward)
  replayed from a CUDA graph (`zlm.core.graphs.CapturedStep`), as `zlm train` runs it.

Phases: `train` (forward, backward; no optimizer step), `infer` (no_grad forward), both
over (T, B) windows with the state carried; `model` (nn.LSTM and fused only: a whole
training step - embedding, LSTM, decoder, loss, backward, clip 1, Adam - as `zlm train`
runs it; the fused row also carries `mask_draw_share`, the share of that step spent
drawing the two zoneout masks); and `sample` (batch 1, one character at a time: the
zlm models through `zlm.inference.sample.Stepper`, nn.LSTM through its own step ->
decoder -> softmax -> torch.multinomial).

Precision (`zlm.core.precision.resolve_precision` decides, "auto" included): bf16 rows run
every implementation under plain `torch.autocast(device, dtype=torch.bfloat16)` with its
default arguments, as a user writes it, so the nn.LSTM bar is the one a user gets. Each (implementation, phase) is warmed up, then timed in rounds whose order
rotates, so machine noise hits all alike; the median per round is reported, with the
time per character relative to nn.LSTM measured in the same run. This module measures;
`zlm.cli.bench` renders.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from zlm.core.graphs import CapturedStep
from zlm.core.precision import cpu_bf16_native, resolve_precision
from zlm.errors import UsageError
from zlm.inference.stepper import Stepper
from zlm.model.cells import choose_cell
from zlm.model.cells.masks import draw_keep
from zlm.model.cells.reference import zoneout_lstm_reference
from zlm.model.lm import ModelConfig, ZoneoutLM, training_nll

IMPLS = ("nn.LSTM", "reference", "fused")
GRAPHED = "fused+graphs"  # CUDA only
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
GRID_BATCH = (32, 128)
GRID_HIDDEN = (256, 512, 1000)
SAMPLE_HIDDEN = 512


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark size. Throughput is characters (tokens) per second."""

    hidden: int = 512  # LSTM units
    batch_size: int = 32  # parallel streams per window (1 for the sample phase)
    bptt: int = 100  # timesteps per window
    vocab: int = 65  # characters in the vocabulary (tinyshakespeare's 65)
    embed: int = 64  # embedding width fed to the LSTM
    device: str = "cpu"  # cpu or cuda
    repeats: int = 5  # timed rounds; the median is reported
    warmup: int = 2  # untimed calls per implementation and phase first
    sample_chars: int = 300  # characters generated per timed sample round
    precision: str = "fp32"  # auto | fp32 | bf16 | fp16 (CUDA): autocast around every forward

    def __post_init__(self):
        if self.device in ("cpu", "cuda"):  # an unknown device is refused by resolve_device
            object.__setattr__(self, "precision", resolve_precision(self.device, self.precision))
        if self.device == "cpu" and self.precision == "bf16" and not cpu_bf16_native():
            raise UsageError("--precision bf16: this CPU has no native bf16 (AVX512-BF16 or AMX), where "
                             "torch.nn.LSTM under autocast does not run; pass --precision fp32")
        for name in ("hidden", "batch_size", "bptt", "vocab", "embed", "repeats", "sample_chars"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise UsageError(f"--warmup must be >= 0, got {self.warmup}")


def resolve_device(name: str) -> torch.device:
    """cpu or cuda, with a one-line error when CUDA is asked for and absent."""
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            built = "built without CUDA" if torch.version.cuda is None else "sees no GPU"
            raise UsageError(f"--device cuda: this torch {torch.__version__} {built}; pass --device cpu")
        return torch.device("cuda")
    raise UsageError(f"unknown device {name!r}; pass --device cpu or --device cuda")


class TorchLSTMLM(nn.Module):
    """The bar: embedding -> torch.nn.LSTM -> decoder, with ZoneoutLM's interface."""

    def __init__(self, vocab: int, embed: int, hidden: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens, state=None):
        """tokens (T, B) -> logits (T, B, V), state (h, c) each (1, B, H)."""
        y, state = self.lstm(self.embedding(tokens), state)  # (T, B, H)
        return self.decoder(y), state


def _fused_cell(device: torch.device):
    choice = choose_cell("auto", device)
    if choice.name != "fused":
        raise UsageError(f"zlm bench: no fused cell on {device.type} ({choice.reason}); pass --device cpu")
    return choice.fn


def _build(impl: str, cfg: BenchConfig, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    if impl == "nn.LSTM":
        return TorchLSTMLM(cfg.vocab, cfg.embed, cfg.hidden).to(device)
    cell = zoneout_lstm_reference if impl == "reference" else _fused_cell(device)  # fused, graphed
    mc = ModelConfig(cfg.vocab, hidden=cfg.hidden, embed=cfg.embed, zoneout_cell=0.5, zoneout_hidden=0.05)
    model = ZoneoutLM(mc, cell=cell).to(device)
    model.stepped = False  # the infer phase times the cell; scoring's Decoder path: scripts/stepped-speed
    return model


class _Runner:
    """One model and its carried state; each call is one timed unit of work."""

    def __init__(self, impl: str, cfg: BenchConfig, device: torch.device):
        self.model, self.cfg, self.device = _build(impl, cfg, device), cfg, device
        g = torch.Generator().manual_seed(1)
        shape = (cfg.bptt + 1, cfg.batch_size)
        self.tokens = torch.randint(cfg.vocab, shape, generator=g).to(device)  # (T+1, B)
        self.state = None
        self._stepper = None  # the sampling row's Stepper, built on first use
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.graphed = impl == GRAPHED
        self.torch_loss = impl == "nn.LSTM"  # zlm's models take zlm's training loss
        self.graphs: dict[str, CapturedStep] = {}
        self.opt = None

    def autocast(self):
        """Plain autocast with default arguments; inside a CUDA graph no weight cache."""
        dtype = PRECISIONS[self.cfg.precision]
        if dtype is None:
            return contextlib.nullcontext()
        if self.graphed:
            return torch.autocast(self.device.type, dtype=dtype, cache_enabled=False)
        return torch.autocast(self.device.type, dtype=dtype)

    def _graph_state(self) -> tuple:
        if self.state is None:
            self.state = self.model.initial_state(self.cfg.batch_size, self.device)
        return self.state

    def _train_fn(self, tokens, h0, c0):
        with self.autocast():
            logits, (h, c) = self.model(tokens[:-1], (h0, c0))
        self.loss(logits, tokens[1:]).backward()
        return h.detach().float(), c.detach().float()

    def loss(self, logits, targets):
        """Mean nats per token: F.cross_entropy as a user writes it for nn.LSTM; zlm's
        `training_nll` (the fused loss for a large vocabulary on a CPU) for zlm's models."""
        if self.torch_loss:
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return training_nll(logits, targets) / targets.numel()

    def _infer_fn(self, tokens, h0, c0):
        with torch.no_grad(), self.autocast():
            _, (h, c) = self.model(tokens[:-1], (h0, c0))
        return h.float(), c.float()

    def _replay(self, phase: str) -> int:
        """The graphed implementation: capture the phase once, replay it after."""
        self.model.train(phase == "train")
        fn = self._train_fn if phase == "train" else self._infer_fn
        if phase not in self.graphs:
            params = list(self.model.parameters()) if phase == "train" else []
            self.graphs[phase] = CapturedStep(fn, (self.tokens, *self._graph_state()), params)
        h, c = self.graphs[phase](self.tokens, *self._graph_state())
        self.state = (h.clone(), c.clone())
        return self.cfg.bptt * self.cfg.batch_size

    def train(self) -> int:
        if self.graphed:
            return self._replay("train")
        self.model.train()
        with self.autocast():
            logits, state = self.model(self.tokens[:-1], self.state)  # (T, B, V)
        loss = self.loss(logits, self.tokens[1:])
        loss.backward()
        self.state = tuple(s.detach() for s in state)
        for p in self.model.parameters():
            p.grad = None
        return self.cfg.bptt * self.cfg.batch_size

    def model_step(self) -> int:
        """A whole training step: forward, loss, backward, clip 1, Adam."""
        if self.opt is None:
            self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.model.train()
        with self.autocast():
            logits, state = self.model(self.tokens[:-1], self.state)  # (T, B, V)
        loss = self.loss(logits, self.tokens[1:])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.state = tuple(s.detach() for s in state)
        return self.cfg.bptt * self.cfg.batch_size

    def masks(self) -> int:
        """Drawing the two zoneout masks of one window, as the zlm layer does."""
        shape = (self.cfg.bptt, self.cfg.batch_size, self.cfg.hidden)
        for z in (0.5, 0.05):
            draw_keep(z, shape, True, dtype=torch.float32, device=self.device)
        return self.cfg.bptt * self.cfg.batch_size

    def infer(self) -> int:
        if self.graphed:
            return self._replay("infer")
        self.model.eval()
        with torch.no_grad(), self.autocast():
            _, self.state = self.model(self.tokens[:-1], self.state)
        return self.cfg.bptt * self.cfg.batch_size

    def sample(self) -> int:
        """Batch 1, one character per call: embedding -> one step -> decoder -> draw."""
        m, n = self.model.eval(), self.cfg.sample_chars
        tok = self.tok  # (1, 1)
        with torch.no_grad():
            if isinstance(m, TorchLSTMLM):
                state = None
                for _ in range(n):
                    y, state = m.lstm(m.embedding(tok), state)  # (1, 1, H)
                    tok = torch.multinomial(torch.softmax(m.decoder(y[0]), dim=-1), 1)  # (1, 1)
                return n
            if m.cell is zoneout_lstm_reference:  # the reference cell, one step per call
                layer = m.layers[0]
                w = (layer.weight_ih, layer.weight_hh, layer.bias, layer.zoneout_cell, layer.zoneout_hidden)
                h = c = torch.zeros(1, self.cfg.hidden, device=self.device)  # (1, H)
                for _ in range(n):
                    _, h, c = m.cell(m.embedding(tok), h, c, *w)
                    tok = torch.multinomial(torch.softmax(m.decoder(h), dim=-1), 1)  # (1, 1)
                return n
            if self._stepper is None:  # built once, as zlm sample does per run (weights packed)
                lp = self.cfg.precision == "bf16" and self.device.type == "cpu"
                self._stepper = Stepper(m, 1, lp=lp)
            step = self._stepper
            tok = tok[0]  # (1,)
            for _ in range(n):
                tok = torch.multinomial(torch.softmax(step(tok), dim=-1), 1)[0]  # (1,)
        return n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(cfg: BenchConfig, phases: tuple[str, ...] = ("train", "infer")) -> list[dict]:
    """Characters/s of every implementation in every phase at one size.

    Returns one row per (phase, implementation): the size, `chars_per_s` (median over
    rounds) and `ratio_to_lstm`, the time per character relative to nn.LSTM in this run
    (lower is faster; nn.LSTM is 1.0): the median over rounds of the ratio within each round,
    where the two ran back to back, so a machine whose speed drifts between rounds (shared
    CPUs: 2x within minutes was seen) shifts both sides of a ratio alike.
    """
    device = resolve_device(cfg.device)
    impls = IMPLS + ((GRAPHED,) if device.type == "cuda" and phases != ("sample",) else ())
    runners = {impl: _Runner(impl, cfg, device) for impl in impls}
    jobs = [(impl, phase) for phase in phases for impl in _impls_for(phase, impls)]
    if "model" in phases:
        jobs.append(("fused", "masks"))
    for impl, phase in jobs:
        for _ in range(cfg.warmup):
            getattr(runners[impl], _METHOD.get(phase, phase))()
    seconds: dict[tuple[str, str], list[float]] = {job: [] for job in jobs}
    for r in range(cfg.repeats):
        k = r % len(jobs)
        for impl, phase in jobs[k:] + jobs[:k]:  # rotate who goes first
            _sync(device)
            t0 = time.perf_counter()
            chars = getattr(runners[impl], _METHOD.get(phase, phase))()
            _sync(device)
            seconds[(impl, phase)].append((time.perf_counter() - t0) / chars)
    rows = []
    size = dict(hidden=cfg.hidden, batch_size=cfg.batch_size, bptt=cfg.bptt, vocab=cfg.vocab,
                precision=cfg.precision)
    if phases == ("sample",):
        size.update(batch_size=1, bptt=1)
    for phase in phases:
        bar = seconds[("nn.LSTM", phase)]
        for impl in _impls_for(phase, impls):
            s = statistics.median(seconds[(impl, phase)])
            ratio = round_ratio(seconds[(impl, phase)], bar)
            rows.append(dict(size, phase=phase, impl=impl, chars_per_s=1.0 / s, ratio_to_lstm=ratio))
            if phase == "model" and impl == "fused":
                rows[-1]["mask_draw_share"] = statistics.median(seconds[("fused", "masks")]) / s
    return rows


def round_ratio(times: list[float], bar: list[float]) -> float:
    """The median over rounds of times[r] / bar[r]: each round's two timings ran back to back."""
    return statistics.median(a / b for a, b in zip(times, bar, strict=True))


_METHOD = {"model": "model_step"}  # phase -> _Runner method where the names differ


def _impls_for(phase: str, impls: tuple[str, ...]) -> tuple[str, ...]:
    """The whole-model step runs nn.LSTM and the fused cell only (the reference is slow)."""
    return ("nn.LSTM", "fused") if phase == "model" else impls


def grid_configs(base: BenchConfig) -> list[BenchConfig]:
    """The standard grid: B in {32, 128} x H in {256, 512, 1000}, T = 100."""
    kw = {k: v for k, v in asdict(base).items() if k not in ("hidden", "batch_size", "bptt")}
    return [BenchConfig(hidden=h, batch_size=b, bptt=100, **kw) for b in GRID_BATCH for h in GRID_HIDDEN]


def run_bench(cfg: BenchConfig, grid: bool = False, sample: bool = False,
              precisions: tuple[str, ...] = ()) -> dict:
    """The whole benchmark as one JSON-ready dict (see `measure` for the rows).

    Every size runs the train, infer and model phases. grid: run `grid_configs(cfg)` and
    batch-1 sampling at H=512 instead of cfg's size; sample: also measure batch-1
    sampling at cfg.hidden; precisions: run every size in each of these (default:
    cfg.precision), each resolved by `zlm.core.precision.resolve_precision`.
    """
    device = resolve_device(cfg.device)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    rows: list[dict] = []
    for prec in dict.fromkeys(resolve_precision(device, p) for p in precisions or (cfg.precision,)):
        for c in grid_configs(cfg) if grid else [cfg]:
            rows += measure(replace(c, precision=prec), phases=("train", "infer", "model"))
        if grid or sample:
            h = SAMPLE_HIDDEN if grid else cfg.hidden
            rows += measure(BenchConfig(**{**asdict(cfg), "hidden": h, "precision": prec}), phases=("sample",))
    return {
        "device": str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "fused_cell": choose_cell("auto", device).reason,
        "ratio_to_lstm": "time per character relative to torch.nn.LSTM in this run (lower is faster)",
        "load_average": load,
        "load_warning": _load_warning(load),
        "rows": rows,
    }


def _load_warning(load: float) -> str | None:
    """A note when other processes were busy: multi-threaded small ops suffer most."""
    cores = os.cpu_count() or 1
    if load < 0.5 * cores:
        return None
    return f"the machine was busy (load average {load:.1f} on {cores} cores): ratios are noisy; rerun when idle"

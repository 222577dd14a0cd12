"""The Trainer: built from a `Plan` (`zlm.training.plan`), `fit()` runs `train_step` /
`validate` / `save` until the run is done.

Everything that resumes is stateful and goes through one `Checkpointer` mapping (model,
optimizer, grad scaler, batch streams, schedule, `TrainState`, RNG) plus the carried
hidden state, so `--resume` continues exactly: a run of 2N steps and a run of N steps +
resume + N steps produce bit-identical losses on CPU.

Parallelism (DDP, ZeRO), precision (autocast, GradScaler) and CUDA graphs are applied
from outside the model: `distributed.setup` wraps it, `Runtime` casts, `TrainStep`
(`zlm.training.step`) runs the step and replays it from a CUDA graph.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from zlm.core import checkpoint as ckpt
from zlm.core.config import TrainConfig
from zlm.core.eval_protocol import EvalProtocol, evaluate_tokens
from zlm.core.metrics import LN2
from zlm.core.precision import Runtime, machine_name, resolve_device
from zlm.core.reporter import Reporter
from zlm.data.dataset import Dataset
from zlm.data.streams import Batch, make_streams
from zlm.errors import NonFiniteError
from zlm.model.cells.masks import mix_words
from zlm.model.lm import State, ZoneoutLM
from zlm.training import distributed
from zlm.training.averaging import WeightAverage
from zlm.training.graphs import graphs_unavailable_reason, resolve_graphs
from zlm.training.init_from import load_parent_weights
from zlm.training.plan import Plan
from zlm.training.resolve import cell_for
from zlm.training.run_dir import RunDir
from zlm.training.schedule import COOL_LR, LRSchedule, OverfitGuard
from zlm.training.state import Checkpointer, RNGState, TrainState
from zlm.training.step import TrainStep, build_optimizer, describe_mode, step_mode

RESIDENT_SHARE = 0.25  # of free device memory the training split may take to live there
GAP_TOKENS = 50_000  # train tokens scored at each validation for the generalisation gap (at most,
# and at most half of what validation scores)


@dataclass
class StepResult:
    """What one optimizer step reports, still on the device: read in batches (`_flush`)."""

    step: int  # the step's number (1-based)
    numbers: torch.Tensor  # (4,) fp32: mean loss over ranks, this rank's loss, grad norm, finite (1/0)
    tokens: int
    lr: float


class Trainer:
    """One training run: model, optimizer, streams and state, built (or resumed) at init."""

    def __init__(self, plan: Plan, *, reporter: Reporter | None = None, fault=None):
        """fault(step, loss) -> loss: a test hook that injects non-finite values."""
        train_cfg = plan.spec.train
        device = resolve_device(train_cfg.device, distributed.local_rank())
        self.par = par = distributed.setup(device, zero=train_cfg.zero)
        if par.world > 1:  # rank 0 planned (the rule, the resolution, the resume): every rank takes its plan
            plan = par.broadcast_object(plan if par.is_main else None)
        spec = self.spec = replace(plan.spec, world_size=par.world)
        cfg = self.cfg = spec.train
        self.run_dir = plan.run_dir
        self.data = data = Dataset.open(spec.data.path)
        self.rep = reporter if reporter is not None and par.is_main else Reporter()
        self.resolved = spec.resolved
        self.runtime = Runtime(device, self.resolved.precision)
        torch.manual_seed(cfg.seed + par.rank)
        self.cell = cell_for(self.resolved, cfg.cell, spec.model, device, self.rep.message)
        self.model = ZoneoutLM(spec.model, self.cell.fn).to(self.runtime.device)
        if spec.parent is not None and plan.resume_from is None:  # --init-from: the parent's weights
            load_parent_weights(self.model, spec.parent, data.tokenizer)
        self.ddp_model = par.wrap_model(self.model)
        opt_cls, opt_kw = build_optimizer(cfg)
        self.optimizer = par.make_optimizer(opt_cls, self.model.parameters(), **opt_kw)
        self.scaler = self.runtime.grad_scaler()
        self.streams = make_streams(cfg.state, data.tokens("train"), cfg.batch_size, cfg.bptt, cfg.seed,
                                    par.rank, par.world)
        self.data_line, self.pin = self._place_data()
        self.total_steps = _planned_steps(cfg, self.streams.windows_per_epoch)
        self.schedule = LRSchedule(cfg.schedule, cfg.lr, self.total_steps, cfg.time_budget)
        self.state, self.carried = TrainState(), None
        self.average = WeightAverage(cfg.average, list(self.model.named_parameters()))
        self.guard = OverfitGuard(cfg.on_overfit)
        self.pending: list[StepResult] = []  # steps whose numbers are not read yet (`_flush`)
        self.run = RunDir(self.run_dir)
        self.config = spec.to_dict()
        self.checkpointer = Checkpointer(self.run_dir, self.config, data, par, cfg.keep_last)
        self.resumed_from = self._load(plan.resume_from) if plan.resume_from is not None else None
        self.log = self.run.open(self.config) if par.is_main else None
        self.use_graphs, graphs_line = resolve_graphs(cfg.cuda_graphs, graphs_unavailable_reason(
            self.runtime, self.cell.name, par.world, self.scaler.is_enabled(), hooked=fault is not None))
        mode = step_mode(self.use_graphs, self.optimizer)
        self.graphs_line = f"{graphs_line}: {describe_mode(mode)}" if self.use_graphs else graphs_line
        self.step_fn = TrainStep(self.ddp_model, self.runtime, self.scaler, self.optimizer, par, cfg.clip,
                                 mode=mode, fault=fault)
        info = data.split_info("train")
        self.chars_per_token = info.characters / max(info.tokens, 1)
        valid_tokens = cfg.scored_valid_tokens(data.split_info("valid").tokens)
        self.gap_tokens = max(2, min(GAP_TOKENS, valid_tokens // 2, info.tokens))  # the train slice's size

    @property
    def parts(self) -> dict:
        """The stateful parts a checkpoint holds (each has state_dict / load_state_dict)."""
        return {"model": self.model, "optimizer": self.optimizer, "scaler": self.scaler,
                "streams": self.streams, "schedule": self.schedule, "train_state": self.state,
                "average": self.average, "overfit": self.guard, "rng": RNGState(self.runtime.device)}

    def _load(self, latest: Path) -> Path:
        """Every part, the carried state included, from `latest`."""
        self.carried = self.checkpointer.load(latest, self.parts, warn=self.rep.message)
        self.rep.message(f"resumed from {latest} at step {self.state.step}")
        return latest

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        """Train until the step, epoch or time budget is reached, or a signal arrives."""
        self._announce()
        meter = _Meter(self.state)
        with _StopFlag() as stop:
            while True:
                self.state.elapsed = meter.elapsed()
                if self.done() or stop.signal is not None:
                    break
                result = self.train_step(self.streams.next())
                self._average()
                self._record(result, meter)
                if self.state.step % self.cfg.eval_every == 0:
                    self._flush(meter)
                    self._watch(self.validate())
                    self.save("every --eval-every steps")
            self._flush(meter)
            self.state.elapsed = meter.elapsed()
            if stop.signal is None and (self.state.step % self.cfg.eval_every != 0 or self.state.step == 0):
                self.validate()
                self.save("end of training")
            elif stop.signal is not None:
                self.save("interrupted by " + signal.Signals(stop.signal).name)
        return self._finish(stop.signal)

    def done(self) -> bool:
        """The planned steps (--max-steps, --epochs) are taken, the --time-budget is spent, or
        the overfitting guard's cool-down is over."""
        s = self.state
        if self.guard.finished(s.step):
            return True
        if self.total_steps is not None and s.step >= self.total_steps:
            return True
        return self.cfg.time_budget is not None and s.elapsed >= self.cfg.time_budget

    def train_step(self, batch: Batch) -> StepResult:
        """One optimizer step on one TBPTT window (`TrainStep`) at the schedule's learning rate.

        Nothing here reads a tensor on the host: the loss, gradient norm and finite flag
        stay on the device until `_flush` reads a batch of steps, and a non-finite step is
        skipped on the device (the fused optimizer's `found_inf`, or fp16's GradScaler)."""
        s = self.state
        x, y = batch.inputs, batch.targets  # (T, B) each
        if self.pin:  # host windows: copied from pinned memory while the device works
            x, y = x.pin_memory(), y.pin_memory()
        x = x.to(self.runtime.device, non_blocking=True)
        y = y.to(self.runtime.device, non_blocking=True)
        carried = self._carried_for(batch, x.shape[1])
        lr = self.guard.lr(s.step, self.schedule.lr(s.step, s.elapsed))
        self.ddp_model.train()
        numbers, self.carried = self.step_fn(x, y, carried, lr, s.step)  # maybe one graph replay
        s.step += 1
        s.epoch = self.streams.progress
        return StepResult(s.step, numbers, y.numel(), lr)

    def progress(self) -> float | None:
        """How far through its length (0..1) the run is: the nearest of its step, epoch and
        time limits (None: no limit)."""
        s, parts = self.state, []
        if self.total_steps:
            parts.append(s.step / self.total_steps)
        if self.cfg.time_budget:
            parts.append(s.elapsed / self.cfg.time_budget)
        return max(parts) if parts else None

    def _average(self) -> None:
        """In the last --average share of the run, this step's weights join the mean."""
        if not self.average.wanted(self.progress()):
            return
        if self.average.count == 0:
            self.rep.message(f"averaging the weights from step {self.state.step} (the last "
                             f"{self.cfg.average:.0%} of the run): validation scores the average")
            if self.par.is_main:
                self.log.write("average", step=self.state.step, share=self.cfg.average)
        self.average.add()

    def _place_data(self) -> tuple[str, bool]:
        """Put the training split on the device when it fits RESIDENT_SHARE of its free
        memory (every window is then one gather there); else windows are copied from
        pinned host memory. -> (line for the start display, pin host windows)."""
        device = self.runtime.device
        if device.type != "cuda":
            return "windows read from the memory-mapped split", False
        tokens = self.data.tokens("train")
        need = len(tokens) * (1 if tokens.dtype == np.uint8 else 4)
        free, _ = torch.cuda.mem_get_info(device)
        if need > RESIDENT_SHARE * free:
            return (f"windows copied from pinned memory (the split, {need / 2**20:,.0f} MiB, is over "
                    f"{RESIDENT_SHARE:.0%} of free device memory)"), True
        self.streams.make_resident(device)
        return f"resident on {device} ({need / 2**20:,.0f} MiB)", False

    def _carried_for(self, batch: Batch, streams: int) -> State:
        """The state this window starts from: zero at a reset, else carried (--reset-prob)."""
        if batch.reset or self.carried is None:
            return self.model.initial_state(streams, self.runtime.device)
        if self.cfg.reset_prob > 0:
            return reset_some(self.carried, self.cfg.reset_prob, (self.cfg.seed, self.par.rank, self.state.step))
        return self.carried

    def validate(self) -> float:
        """Valid BPC over the whole split, or its `--eval-tokens` sample (all ranks), of the
        averaged weights once averaging has started (`--average`); best/ is updated when it
        improves."""
        with self.average.applied():
            return self._validate()

    def _validate(self) -> float:
        s, vinfo = self.state, self.data.split_info("valid")
        score = evaluate_tokens(self.model, self.data.tokens("valid"), self.data.tokenizer, vinfo.characters,
                            vinfo.bytes, self.runtime,
                            EvalProtocol(self.cfg.eval_streams, sample=self.cfg.eval_tokens), self.par.sum,
                            self.par.rank, self.par.world)
        bpc = score.bpc
        improved = math.isfinite(bpc) and bpc < s.best_bpc
        if not math.isfinite(bpc):
            self.rep.message(f"warning: validation BPC at step {s.step} is {bpc}; best/ keeps "
                             f"{'the previous best' if math.isfinite(s.best_bpc) else 'nothing yet'}")
        if improved:
            s.best_bpc = bpc
        self.schedule.observe(bpc)
        s.valid_bpc = bpc
        s.train_slice_bpc = self._train_slice_bpc()
        if self.par.is_main:
            rec = {"step": s.step, "epoch": s.epoch, "valid_bpc": bpc, "valid_ppl": score.perplexity,
                   "valid_bits_per_byte": score.bits_per_byte, "best_bpc": s.best_bpc,
                   "tokens": score.tokens, "characters": score.characters,
                   "train_slice_bpc": s.train_slice_bpc, "gap": bpc - s.train_slice_bpc,
                   "averaged": self.average.count}
            self.log.write("eval", **rec)
            self.rep.eval(rec)
            if improved:
                self.run.write_best(self.model, self.config, self.data, s.step, bpc, s.train_slice_bpc)
        return bpc

    def _watch(self, bpc: float) -> None:
        """Show this validation to the overfitting guard (`--on-overfit`); when it reacts: the
        weights of best/ back in the model, the weight average afresh, and the cool-down."""
        s = self.state
        if not self.guard.observe(bpc, s.train_slice_bpc):
            return
        self.par.barrier()  # rank 0 has written best/
        best = ckpt.load(self.run_dir / "best")
        ckpt.load_weights(self.model, best.model, best.path)
        best_step = int(ckpt.read_json(best.path / "trainer.json", "best/'s trainer state")["step"])
        self.average.load({}, 0)
        g = self.guard
        cool = g.react(s.step, self.cfg.eval_every, self.schedule.lr(s.step, s.elapsed), best_step)
        self.rep.message(f"overfitting: {g.seen()}; back to best/ (step {best_step}, {s.best_bpc:.3f}), lr "
                         f"cooled from {cool.lr:.3g} ({COOL_LR:g} x the schedule's) to 0 over "
                         f"{cool.until - cool.at} steps, then the run stops (--on-overfit cool-down)")
        if self.par.is_main:
            self.log.write("overfit", step=s.step, reason=g.reason, best_step=best_step, lr=cool.lr,
                           until=cool.until, valid=[v for v, _ in g.history], train_slice=[t for _, t in g.history])

    def _train_slice_bpc(self) -> float:
        """BPC in eval mode on `gap_tokens` tokens spread over the train split, measured as
        validation is (the same streams, each scoring the first piece of its stretch, the same
        pieces at every validation): valid BPC minus this is the generalisation gap shown
        while training. Spread, not the split's first tokens: a text whose beginning is unlike
        the rest (one collection of many) would otherwise show a gap of the wrong sign."""
        info = self.data.split_info("train")
        return evaluate_tokens(self.model, self.data.tokens("train"), self.data.tokenizer, info.characters, info.bytes,
                               self.runtime, EvalProtocol(self.cfg.eval_streams, sample=self.gap_tokens),
                               self.par.sum, self.par.rank, self.par.world).bpc

    def save(self, reason: str) -> Path | None:
        """A training checkpoint of every part (rank 0 writes; every rank takes part)."""
        path = self.checkpointer.save(self.parts, self.carried)
        if path is not None:
            self.state.last_good = str(path)
            self.rep.message(f"checkpoint {path.name} saved ({reason})")
            self.log.write("checkpoint", step=self.state.step, path=str(path), reason=reason)
        return path

    # ------------------------------------------------------------ reporting

    def _announce(self) -> None:
        info = self.data.split_info("train")
        self.rep.start({
            "run": str(self.run_dir), "parameters": f"{self.model.num_parameters():,}",
            "cell": f"{self.cell.name} ({self.cell.reason})",
            "runtime": f"{self.runtime.describe()} ({self.resolved.why or 'as this run was started'})",
            "cuda graphs": self.graphs_line, "processes": self.par.describe(), "train split": self.data_line,
            "data": f"{self.data.path} ({self.data.meta['tokenizer']['kind']}, vocab {self.data.vocab_size}, "
                    f"{info.tokens:,} train tokens)",
            "plan": describe_plan(self.cfg, self.total_steps, self.streams.windows_per_epoch,
                                  self.data.split_info("valid").tokens),
        })
        if self.par.is_main:
            self.log.write("start", parameters=self.model.num_parameters(), cell=self.cell.name,
                           runtime=self.runtime.describe(), machine=machine_name(self.runtime.device),
                           cuda_graphs=self.use_graphs,
                           world_size=self.par.world, step=self.state.step,
                           resumed_from=str(self.resumed_from) if self.resumed_from else None)

    def _record(self, r: StepResult, meter: _Meter) -> None:
        """Keep one step's numbers; every --log-every steps read them and write a train line
        with BPC, speed and ETA."""
        self.pending.append(r)
        if self.state.step % self.cfg.log_every == 0:
            self._flush(meter)
            if meter.tokens:
                rec = meter.record(self.state, r.lr, self._last_step(),
                                   self.cfg.time_budget, self.chars_per_token, self.par.world)
                if self.par.is_main:
                    self.log.write("train", **rec)
                self.rep.log(rec)

    def _last_step(self) -> int | None:
        """The step the run ends at, as far as steps tell (the cool-down's end once it began)."""
        cool = self.guard.cool
        if cool is None:
            return self.total_steps
        return cool.until if self.total_steps is None else min(cool.until, self.total_steps)

    def _flush(self, meter: _Meter) -> None:
        """Read the pending steps' numbers in one host read; log each step, count non-finite
        ones (raising NonFiniteError after max_nonfinite of them in a row)."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        rows = torch.stack([r.numbers for r in pending]).tolist()  # the one host read
        s = self.state
        for r, (loss, local_loss, gnorm, finite) in zip(pending, rows, strict=True):
            if finite:
                s.nonfinite = 0
                meter.add(loss, r.tokens)
                if self.par.is_main:
                    self.log.write("step", step=r.step, loss=loss, grad_norm=gnorm, lr=r.lr)
            else:
                self._nonfinite(r.step, local_loss, gnorm)

    def _nonfinite(self, step: int, loss: float, gnorm: float) -> None:
        s = self.state
        s.nonfinite += 1
        self.rep.message(f"step {step}: non-finite loss or gradient ({loss}), "
                         f"update skipped ({s.nonfinite} in a row)")
        if self.par.is_main:
            self.log.write("nonfinite", step=step, loss=loss, grad_norm=gnorm)
        if s.nonfinite >= self.cfg.max_nonfinite:
            raise NonFiniteError(
                f"{s.nonfinite} non-finite losses in a row at step {step}; the last good "
                f"checkpoint is {s.last_good or 'none yet'}; lower --lr or --clip and resume with --resume")

    def _finish(self, interrupted: int | None) -> dict:
        s = self.state
        summary = {"step": s.step, "best_valid_bpc": s.best_bpc, "elapsed_s": round(s.elapsed, 1),
                   "run": str(self.run_dir),
                   **({"overfit_at": self.guard.cool.at} if self.guard.cool is not None else {}),
                   "interrupted": signal.Signals(interrupted).name if interrupted else None}
        if self.par.is_main:
            self.log.write("finish", **summary)
            self.log.close()
        self.rep.finish(summary)
        self.par.close()
        if interrupted is None and not math.isfinite(s.best_bpc):
            raise NonFiniteError(
                f"validation BPC was never finite (last: {s.valid_bpc} at step {s.step}), so "
                f"no best checkpoint was written; the model diverged: lower --lr or --clip and train again")
        return summary


class _Meter:
    """Wall time of this session, and the train-BPC window between two log lines."""

    def __init__(self, state: TrainState):
        self.start_elapsed, self.start_step = state.elapsed, state.step
        self.t0 = self.window_t0 = time.perf_counter()
        self.nats, self.tokens = 0.0, 0

    def elapsed(self) -> float:
        return self.start_elapsed + time.perf_counter() - self.t0

    def add(self, loss: float, tokens: int) -> None:
        self.nats += loss * tokens
        self.tokens += tokens

    def record(self, s: TrainState, lr: float, total_steps: int | None, budget: float | None,
               chars_per_token: float, world: int) -> dict:
        """The train line: BPC over the window, characters/s (all ranks), ETA; starts a new window."""
        now = time.perf_counter()
        elapsed = self.start_elapsed + now - self.t0
        s_per_step = (now - self.t0) / (s.step - self.start_step)
        etas = [max(budget - elapsed, 0.0)] if budget is not None else []
        if total_steps is not None:
            etas.append(s_per_step * max(total_steps - s.step, 0))
        rec = {"step": s.step, "epoch": s.epoch,
               "train_bpc": self.nats / self.tokens / chars_per_token / LN2, "valid_bpc": s.valid_bpc,
               "chars_per_s": self.tokens * world * chars_per_token / (now - self.window_t0), "lr": lr, "elapsed": elapsed, "eta": min(etas) if etas else None, "total_steps": total_steps}
        self.nats, self.tokens, self.window_t0 = 0.0, 0, now
        return rec


class _StopFlag:
    """Ctrl-C / SIGTERM set a flag; the loop saves a checkpoint and stops cleanly."""

    def __init__(self):
        self.signal: int | None = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signal = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def reset_some(state: State, prob: float, key: tuple) -> State:
    """Zero the carried state of each stream with probability prob (--reset-prob).

    Without it a stream starts from a zero state only once per epoch, so an early model
    never learns to start mid-text, which is exactly what evaluation's parallel streams
    ask of it. The draw depends only on (seed, rank, step): resuming repeats it exactly.
    It is made on the state's device from splitmix64 words of that key (the zoneout
    masks' generator), the same bits on every device, with no host read.
    """
    if prob <= 0:
        return state
    seed, rank, step = key
    word = ((seed << 40) + (rank << 32) + step) % (1 << 64)
    word = word - (1 << 64) if word >= 1 << 63 else word  # as int64
    words = mix_words(torch.tensor(word, dtype=torch.int64, device=state[0].device), state[0].shape[1])  # (B,)
    uniform = (words & ((1 << 53) - 1)).double() * 2.0 ** -53  # (B,) in [0, 1)
    keep = (uniform >= prob).to(state[0].dtype)[None, :, None]  # (1, B, 1)
    return state[0] * keep, state[1] * keep


def _planned_steps(cfg: TrainConfig, steps_per_epoch: int) -> int | None:
    """The nearer of --max-steps and --epochs in steps (None: only a time budget or nothing)."""
    options = []
    if cfg.max_steps is not None:
        options.append(cfg.max_steps)
    if cfg.epochs is not None:
        options.append(math.ceil(cfg.epochs * steps_per_epoch))
    return min(options) if options else None


def describe_plan(cfg: TrainConfig, total_steps: int | None, steps_per_epoch: int, valid_tokens: int = 0) -> str:
    parts = [f"batch {cfg.batch_size} x bptt {cfg.bptt}", f"{steps_per_epoch:,} steps/epoch"]
    if total_steps is not None:
        parts.append(f"{total_steps:,} steps")
    if cfg.time_budget is not None:
        parts.append(f"time budget {cfg.time_budget:.0f}s")
    if total_steps is None and cfg.time_budget is None:
        parts.append("until interrupted (no --epochs, --max-steps or --time-budget)")
    if (scored := cfg.scored_valid_tokens(valid_tokens)) < valid_tokens:
        parts.append(f"validation on {scored:,} of the valid split's {valid_tokens:,} tokens "
                     "(zlm eval scores them all)")
    return ", ".join(parts)

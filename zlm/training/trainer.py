"""The training loop: loss, backward, clip, step, log, validate, checkpoint, resume.

`train(run_dir, dataset, model_config, train_config)` is the whole job. Everything that
resumes is stateful (model, optimizer, grad scaler, batch streams, carried hidden state,
RNG, schedule, best BPC), so `--resume` continues exactly: a run of 2N steps and a run
of N steps + resume + N steps produce bit-identical losses on CPU.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from zlm.core import checkpoint as ckpt
from zlm.core.metrics import LN2, MetricsLog
from zlm.core.precision import resolve_runtime
from zlm.core.report import Reporter
from zlm.core.scoring import EvalProtocol, score_split
from zlm.data.dataset import Dataset
from zlm.data.streams import make_streams
from zlm.errors import NonFiniteError, UsageError, ZlmError
from zlm.model.cells import choose_cell
from zlm.model.lm import ModelConfig, ZoneoutLM
from zlm.training import distributed
from zlm.training.graphs import GRAPH_MODES, WindowStep, graphs_unavailable_reason, resolve_graphs
from zlm.training.schedule import LRSchedule, ScheduleConfig
from zlm.training.state import load_trainer_state, save_training_checkpoint
from zlm.version import __version__

OPTIMIZERS = ("adam", "adamw", "sgd")
_MAX_LR = 3.4e37  # float32 max / 10: a larger lr overflows inside Adam's first step


@dataclass(frozen=True)
class TrainConfig:
    """How to train (stored in config.json)."""

    batch_size: int = 32  # streams per rank
    bptt: int = 100  # truncated backprop window, tokens
    lr: float = 2e-3
    optimizer: str = "adam"  # adam | adamw | sgd (momentum 0.9)
    weight_decay: float = 0.0
    clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    epochs: float | None = None  # stop after this many passes over the training split
    max_steps: int | None = None  # stop after this many optimizer steps
    time_budget: float | None = None  # stop after this many seconds of training (total)
    eval_every: int = 500  # validate (and checkpoint) every N steps, and at the end
    eval_streams: int = 16  # parallel streams for validation (EvalProtocol)
    state: str = "carry"  # carry: TBPTT streams, state carried | reset: paper's shuffled chunks
    reset_prob: float = 0.0  # carry: chance a stream's state is zeroed before a window
    seed: int = 1234
    device: str = "auto"
    precision: str = "auto"
    cell: str = "auto"  # auto | fused | reference
    cuda_graphs: str = "auto"  # auto | on | off: replay training windows from CUDA graphs
    keep_last: int = 3  # step checkpoints kept (plus best/)
    log_every: int = 10  # steps between log lines
    max_nonfinite: int = 5  # non-finite losses in a row before training stops
    zero: bool = False  # shard optimizer state (ZeroRedundancyOptimizer) under DDP

    def __post_init__(self):
        if isinstance(self.schedule, dict):
            object.__setattr__(self, "schedule", ScheduleConfig(**self.schedule))
        for name in ("batch_size", "bptt", "eval_every", "eval_streams", "keep_last", "log_every",
                     "max_nonfinite"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.lr <= _MAX_LR:  # (also refuses nan)
            raise UsageError(f"--lr must be > 0 and at most {_MAX_LR:.1e} (Adam's first step, "
                             f"10 x lr, must fit in float32), got {self.lr}")
        if self.clip < 0:
            raise UsageError(f"--clip must be >= 0 (0 turns clipping off), got {self.clip}")
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"unknown optimizer {self.optimizer!r}; pass --optimizer adam, adamw or sgd")
        if self.cuda_graphs not in GRAPH_MODES:
            raise UsageError(f"unknown --cuda-graphs {self.cuda_graphs!r}; pass auto, on or off")
        if not 0.0 <= self.reset_prob < 1.0:
            raise UsageError(f"--reset-prob must be in [0, 1), got {self.reset_prob}")
        if self.state not in ("carry", "reset"):
            raise UsageError(f"unknown state protocol {self.state!r}; pass --state carry or reset")
        for name in ("epochs", "max_steps", "time_budget"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {v}")

    def to_dict(self) -> dict:
        return asdict(self)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> tuple[type, dict]:
    """The optimizer class and its keyword arguments (ZeRO wraps the same pair)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD, dict(lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls, dict(lr=cfg.lr, weight_decay=cfg.weight_decay)


class _StopFlag:
    """Ctrl-C / SIGTERM set a flag; the loop saves a checkpoint and stops cleanly."""

    def __init__(self):
        self.signal: int | None = None
        self._old = {}

    def __enter__(self):
        if _in_main_thread():
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


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """Without --resume, an existing non-empty RUN_DIR is refused (data/ alone is reused)."""
    if not resume and run_dir.exists() and any(p.name != "data" for p in run_dir.iterdir()):
        raise UsageError(
            f"{run_dir} already exists and is not empty; pass --resume to continue it, "
            f"or --out to choose another run directory"
        )


def train(
    run_dir: Path,
    data: Dataset,
    model_config: ModelConfig,
    cfg: TrainConfig,
    *,
    resume: bool = False,
    reporter: Reporter | None = None,
    fault=None,
) -> dict:
    """Train a zoneout LM on a prepared dataset into run_dir. Returns a summary dict.

    `fault(step, loss) -> loss` is a test hook to inject non-finite values.
    """
    run_dir = Path(run_dir)
    rep = reporter or Reporter()
    runtime = resolve_runtime(cfg.device, cfg.precision, distributed.local_rank())
    par = distributed.setup(runtime.device, zero=cfg.zero)
    if not par.is_main:
        rep = Reporter()
    if par.restarted and not resume:  # an elastic agent relaunched the job after a failure
        rep.message(f"elastic restart {distributed.restart_count()}: resuming from the latest checkpoint")
        resume = True
    if par.is_main:
        check_run_dir(run_dir, resume)
    latest = ckpt.latest_complete(run_dir, warn=rep.message) if resume and par.is_main else None
    latest = par.broadcast_object(latest)  # every rank resumes from the checkpoint rank 0 found
    if resume and latest is None:
        rep.message(f"no complete checkpoint in {run_dir}: starting fresh")

    torch.manual_seed(cfg.seed + par.rank)
    cell = choose_cell(cfg.cell, runtime.device)
    model = ZoneoutLM(model_config, cell.fn).to(runtime.device)
    ddp_model = par.wrap_model(model)
    opt_cls, opt_kw = build_optimizer(model, cfg)
    optimizer = par.make_optimizer(opt_cls, model.parameters(), **opt_kw)
    scaler = runtime.grad_scaler()
    train_tokens = data.tokens("train")
    streams = make_streams(cfg.state, train_tokens, cfg.batch_size, cfg.bptt, cfg.seed, par.rank, par.world)
    info = data.split_info("train")
    chars_per_token = info.characters / max(info.tokens, 1)
    steps_per_epoch = streams.windows_per_epoch
    total_steps = _planned_steps(cfg, steps_per_epoch)
    sched = LRSchedule(cfg.schedule, cfg.lr, total_steps, cfg.time_budget)

    config = {
        "zlm_version": __version__,
        "model": model_config.to_dict(),
        "train": cfg.to_dict(),
        "data": {"path": str(Path(data.path).resolve()), "tokenizer": data.meta["tokenizer"],
                 "unit": data.meta.get("unit", "character")},
        "world_size": par.world,
    }
    t = {"step": 0, "elapsed": 0.0, "best_bpc": math.inf, "nonfinite": 0, "last_good": None}
    state = None
    if latest is not None:
        t, state = load_trainer_state(latest, model, optimizer, scaler, streams, sched, runtime, par,
                                      warn=rep.message)
        rep.message(f"resumed from {latest} at step {t['step']}")
    log = _open_run_dir(run_dir, config) if par.is_main else None

    def save(reason: str) -> Path | None:
        path = save_training_checkpoint(run_dir, t, model, optimizer, scaler, streams, sched,
                                        state, config, data, par, cfg.keep_last)
        if path is not None:
            t["last_good"] = str(path)
            rep.message(f"checkpoint {path.name} saved ({reason})")
            log.write("checkpoint", step=t["step"], path=str(path), reason=reason)
        return path

    def validate() -> float:
        vinfo = data.split_info("valid")
        score = score_split(model, data.tokens("valid"), data.tokenizer, vinfo.characters,
                            vinfo.bytes, runtime, EvalProtocol(cfg.eval_streams), par.sum,
                            par.rank, par.world)
        bpc = score.bpc
        improved = math.isfinite(bpc) and bpc < t["best_bpc"]
        if not math.isfinite(bpc):
            rep.message(f"warning: validation BPC at step {t['step']} is {bpc}; best/ keeps "
                        f"{'the previous best' if math.isfinite(t['best_bpc']) else 'nothing yet'}")
        if improved:
            t["best_bpc"] = bpc
        sched.observe(bpc)
        if par.is_main:
            rec = {"step": t["step"], "epoch": t.get("epoch", 0.0), "valid_bpc": bpc,
                   "valid_ppl": score.perplexity, "valid_bits_per_byte": score.bits_per_byte,
                   "best_bpc": t["best_bpc"], "tokens": score.tokens, "characters": score.characters}
            log.write("eval", **rec)
            rep.eval(rec)
            if improved:
                _write_best(run_dir, model, config, data, t["step"], bpc)
        t["valid_bpc"] = bpc
        return bpc

    use_graphs, graphs_line = resolve_graphs(cfg.cuda_graphs, graphs_unavailable_reason(
        runtime, cell.name, par.world, scaler.is_enabled(), hooked=fault is not None))
    rep.start({
        "run": str(run_dir), "parameters": f"{model.num_parameters():,}",
        "cell": f"{cell.name} ({cell.reason})", "runtime": runtime.describe(),
        "cuda graphs": graphs_line,
        "processes": par.describe(), "data": f"{data.path} ({data.meta['tokenizer']['kind']}, "
        f"vocab {data.vocab_size}, {info.tokens:,} train tokens)",
        "plan": _describe_plan(cfg, total_steps, steps_per_epoch),
    })
    if par.is_main:
        log.write("start", parameters=model.num_parameters(), cell=cell.name, runtime=runtime.describe(),
                  cuda_graphs=use_graphs,
                  world_size=par.world, resumed_from=str(latest) if latest else None, step=t["step"])

    params = [p for p in model.parameters()]
    window = WindowStep(ddp_model, runtime, scaler, graphs=use_graphs, fault=fault)
    window_nats, window_tokens, window_t0 = 0.0, 0, time.perf_counter()
    start_elapsed, start_step, t0 = t["elapsed"], t["step"], time.perf_counter()
    interrupted = None
    with _StopFlag() as stop:
        while True:
            t["elapsed"] = start_elapsed + time.perf_counter() - t0
            if _done(cfg, t, steps_per_epoch):
                break
            if stop.signal is not None:
                interrupted = stop.signal
                break
            batch = streams.next()
            x = batch.inputs.to(runtime.device, non_blocking=True)
            y = batch.targets.to(runtime.device, non_blocking=True)
            if batch.reset or state is None:
                state = model.initial_state(x.shape[1], runtime.device)
            elif cfg.reset_prob > 0:
                state = _reset_some(state, cfg.reset_prob, (cfg.seed, par.rank, t["step"]))
            for g in optimizer.param_groups:
                g["lr"] = sched.lr(t["step"], t["elapsed"])
            ddp_model.train()
            loss, new_state = window(x, y, state, t["step"])  # forward + backward
            scaler.unscale_(optimizer)
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.clip if cfg.clip > 0 else math.inf)
            local_loss, gnorm = loss.item(), float(gnorm)  # the step's only host syncs
            finite = math.isfinite(local_loss) and math.isfinite(gnorm)
            # One all-reduce: every rank takes the same skip decision (ZeRO's step is a
            # collective) and rank 0 logs the mean loss over all ranks' streams.
            loss_sum, n_bad = par.sum([local_loss, 0.0 if finite else 1.0])
            finite, loss_value = n_bad == 0, loss_sum / par.world
            if finite or scaler.is_enabled():
                scaler.step(optimizer)  # the fp16 scaler skips non-finite steps itself
                scaler.update()
            optimizer.zero_grad(set_to_none=True)
            t["step"] += 1
            t["epoch"] = streams.progress
            if finite:
                t["nonfinite"] = 0
                state = new_state
                window_nats += loss_value * y.numel()
                window_tokens += y.numel()
            else:
                t["nonfinite"] += 1
                state = None  # the carried state may be poisoned: restart from zero
                msg = (f"step {t['step']}: non-finite loss or gradient ({local_loss}), "
                       f"update skipped ({t['nonfinite']} in a row)")
                rep.message(msg)
                if par.is_main:
                    log.write("nonfinite", step=t["step"], loss=local_loss, grad_norm=gnorm)
                if t["nonfinite"] >= cfg.max_nonfinite:
                    last = t["last_good"] or "none yet"
                    raise NonFiniteError(
                        f"{t['nonfinite']} non-finite losses in a row at step {t['step']}; the last good "
                        f"checkpoint is {last}; lower --lr or --clip and resume with --resume"
                    )
            if par.is_main and finite:
                log.write("step", step=t["step"], loss=loss_value, grad_norm=gnorm,
                          lr=optimizer.param_groups[0]["lr"])
            if t["step"] % cfg.log_every == 0 and window_tokens:
                now = time.perf_counter()
                elapsed = start_elapsed + now - t0
                rec = {
                    "step": t["step"], "epoch": t["epoch"],
                    "train_bpc": window_nats / window_tokens / chars_per_token / LN2,
                    "valid_bpc": t.get("valid_bpc"),
                    "chars_per_s": window_tokens * par.world * chars_per_token / (now - window_t0),
                    "lr": optimizer.param_groups[0]["lr"], "elapsed": elapsed,
                    "eta": _eta(cfg, t, total_steps, elapsed, (now - t0) / (t["step"] - start_step)),
                    "total_steps": total_steps,
                }
                if par.is_main:
                    log.write("train", **rec)
                rep.log(rec)
                window_nats, window_tokens, window_t0 = 0.0, 0, now
            if t["step"] % cfg.eval_every == 0:
                validate()
                save("every --eval-every steps")
        t["elapsed"] = start_elapsed + time.perf_counter() - t0
        if interrupted is None:
            if t["step"] % cfg.eval_every != 0 or t["step"] == 0:
                validate()
                save("end of training")
        else:
            save("interrupted by " + signal.Signals(interrupted).name)
    summary = {"step": t["step"], "best_valid_bpc": t["best_bpc"], "elapsed_s": round(t["elapsed"], 1),
               "run": str(run_dir), "interrupted": signal.Signals(interrupted).name if interrupted else None}
    if par.is_main:
        log.write("finish", **summary)
        log.close()
    rep.finish(summary)
    par.close()
    if interrupted is None and not math.isfinite(t["best_bpc"]):
        raise NonFiniteError(
            f"validation BPC was never finite (last: {t.get('valid_bpc')} at step {t['step']}), so "
            f"no best checkpoint was written; the model diverged: lower --lr or --clip and train again"
        )
    return summary


def _reset_some(state: tuple, prob: float, key: tuple) -> tuple:
    """Zero the carried state of each stream with probability prob (--reset-prob).

    Without it a stream starts from a zero state only once per epoch, so an early model
    never learns to start mid-text, which is exactly what evaluation's parallel streams
    ask of it. The draw depends only on (seed, rank, step): resuming repeats it exactly.
    """
    drop = np.random.default_rng(key).random(state[0].shape[1]) < prob  # (B,)
    if not drop.any():
        return state
    keep = torch.from_numpy(~drop).to(state[0].device, state[0].dtype)[None, :, None]  # (1, B, 1)
    return state[0] * keep, state[1] * keep


def _open_run_dir(run_dir: Path, config: dict) -> MetricsLog:
    """Create RUN_DIR, write config.json, open metrics.jsonl; one-line error if it cannot."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.write_json(run_dir / "config.json", config)
        return MetricsLog(run_dir / "metrics.jsonl")
    except OSError as e:
        raise ZlmError(f"cannot write to the run directory {run_dir} ({e.strerror or e}); "
                       f"make it writable or pass another --out") from None


def _write_best(run_dir: Path, model, config: dict, data: Dataset, step: int, bpc: float) -> None:
    """best/: the weights with the best valid BPC so far, loadable on their own."""
    final = run_dir / "best"
    tmp = None
    try:
        tmp = ckpt.temp_directory(final)
        ckpt.write_tensors(tmp / "model.safetensors", model.state_dict())
        ckpt.write_json(tmp / "config.json", config)
        ckpt.write_json(tmp / "trainer.json", {"step": step, "valid_bpc": bpc, "best_bpc": bpc})
        data.copy_description(tmp)
        ckpt.finish_directory(tmp, final, step)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise ZlmError(f"could not write {final} ({e.strerror or e}); free disk space or make the run "
                       f"directory writable, then resume with --resume; the previous best/ is untouched") from None


def _planned_steps(cfg: TrainConfig, steps_per_epoch: int) -> int | None:
    options = []
    if cfg.max_steps is not None:
        options.append(cfg.max_steps)
    if cfg.epochs is not None:
        options.append(math.ceil(cfg.epochs * steps_per_epoch))
    return min(options) if options else None


def _done(cfg: TrainConfig, t: dict, steps_per_epoch: int) -> bool:
    total = _planned_steps(cfg, steps_per_epoch)
    if total is not None and t["step"] >= total:
        return True
    return cfg.time_budget is not None and t["elapsed"] >= cfg.time_budget


def _eta(cfg, t, total_steps, elapsed: float, s_per_step: float) -> float | None:
    """Seconds left: the nearer of the time budget and the planned steps."""
    etas = []
    if cfg.time_budget is not None:
        etas.append(max(cfg.time_budget - elapsed, 0.0))
    if total_steps is not None:
        etas.append(s_per_step * max(total_steps - t["step"], 0))
    return min(etas) if etas else None


def _describe_plan(cfg: TrainConfig, total_steps, steps_per_epoch) -> str:
    parts = [f"batch {cfg.batch_size} x bptt {cfg.bptt}", f"{steps_per_epoch:,} steps/epoch"]
    if total_steps is not None:
        parts.append(f"{total_steps:,} steps")
    if cfg.time_budget is not None:
        parts.append(f"time budget {cfg.time_budget:.0f}s")
    if total_steps is None and cfg.time_budget is None:
        parts.append("until interrupted (no --epochs, --max-steps or --time-budget)")
    return ", ".join(parts)


def read_config(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))


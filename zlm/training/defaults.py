"""The defaults rule: what `zlm train SOURCE` chooses when no --preset is given.

One preset cannot suit every corpus. On a small corpus a 10-minute budget is many passes
over the text and an unregularised LSTM overfits, so zoneout pays; on a larger one the
budget is a few passes, nothing overfits, and the fastest model that sees the most text
wins. The rule decides which regime a run is in from the size of the training split,
the length of the run (--time-budget, --epochs or --max-steps) and the measured speed of
this machine, then chooses the model, regularisation, learning rate, schedule and
validation interval (the table in `REGIMES`, derived from the corpora benchmark's valid
splits; README "How zlm chooses its defaults").

The size: the probe measures the speed of a 1x512 regularised model; a model of H units
is taken to run at that speed x (parameters at 512 / parameters at H), so the tokens a
run buys are known for every size, and the rule takes the largest of HIDDEN_SIZES that
trains on at least TOKENS_PER_PARAMETER (10) tokens per parameter (half Hoffmann et al.
2022's compute-optimal ratio; on 2 CPU cores and 10 minutes: 1x384, on a GPU: larger). Then

    expected passes E = tokens the run buys for that size / train tokens

    E >= OVERFIT_EPOCHS  "regularised": z_c 0.1, z_h 0.05 (the fused zoneout cell),
                         reset-prob 0.02, Adam 5e-3 decayed by a cosine over the run,
                         bptt 25
    E <  OVERFIT_EPOCHS  "data-rich":   zoneout 0 (torch's LSTM kernel, faster), reset-prob
                         0.02, Adam 4e-3 cosine, bptt 50
    no length            "open":        the cpu-small preset unchanged (it may run for
                                        many epochs, so it is regularised)

where a time budget buys budget x (1 - VALIDATION_SHARE) x tokens/s, measured by
`probe_tokens_per_s` (about 2 s of training steps on this machine, before the clock
starts). Both regimes keep --reset-prob 0.02: without it, a cosine-decayed plain LSTM on
11.8M characters of prose reached train BPC 1.96 but valid 2.87, because evaluation
starts its streams from a zero state the model had never learnt to start from.

Short windows give more updates for the same text at a little less speed: bptt 50 rather
than 100 won in both regimes on every corpus of the benchmark, and when regularising
(many passes, compute-bound) bptt 25 won again on tiny Shakespeare (README "Recipes").

OVERFIT_EPOCHS is 10: a cosine-decayed plain 1x384 LSTM was still improving after 7.8
passes over 2M characters of Russian quotations (valid 1.965 against zoneout's 2.029 at
the same budget), while on tiny Shakespeare at 12-14 passes zoneout won.

With a length, validation runs about EVALS_PER_RUN times (--eval-every). Explicit options
win over every choice. The choice is made once: it is written to config.json
("defaults_rule") and `--resume` reads it back instead of measuring again, so a resumed
run trains with the settings it started with on any machine.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from zlm.core import checkpoint as ckpt
from zlm.core.precision import Runtime, resolve_device, resolve_precision
from zlm.errors import CheckpointError
from zlm.model.cells import choose_cell
from zlm.model.lm import ModelConfig, ZoneoutLM
from zlm.training.config import TrainConfig, configure
from zlm.training.trainer import forward_backward

OVERFIT_EPOCHS = 10.0  # expected passes at or above which a run is regularised
VALIDATION_SHARE = 0.1  # the part of a time budget validation and checkpoints take
EVALS_PER_RUN = 6  # validations in a run of known length (and one at the end)
MIN_EVAL_EVERY = 50
HIDDEN_SIZES = (128, 256, 384, 512, 768, 1024)  # the sizes the rule picks from (more: --hidden)
TOKENS_PER_PARAMETER = 10.0  # a model should train on at least this many tokens per parameter
PROBE_HIDDEN = 512  # the size whose speed the probe measures (unless --hidden is given)

# The settings of each regime besides the size: {config field: value}, as `configure` takes them.
REGIMES: dict[str, dict] = {
    "regularised": dict(layers=1, embed=64, zoneout_cell=0.1, zoneout_hidden=0.05, reset_prob=0.02,
                        lr=5e-3, schedule="cosine", bptt=25),
    "data-rich": dict(layers=1, embed=64, zoneout_cell=0.0, zoneout_hidden=0.0, reset_prob=0.02,
                      lr=4e-3, schedule="cosine", bptt=50),
    "open": {},
}


@dataclass(frozen=True)
class RunLength:
    """What the rule knows about a run before it starts."""

    train_tokens: int
    time_budget: float | None = None  # seconds
    epochs: float | None = None
    max_steps: int | None = None
    # batch x bptt x processes at the probed window (the regularised regime's unless --bptt is
    # given): --max-steps counts these, so a step-limited run is reckoned at that window.
    tokens_per_step: int = 3200
    vocab_size: int = 256
    embed: int = 64
    bptt: int = 100  # the window tokens_per_step counts
    bptt_given: bool = False  # --bptt was given: no regime changes it

    @property
    def known(self) -> bool:
        return any(v is not None for v in (self.time_budget, self.epochs, self.max_steps))

    def step_tokens(self, settings: dict) -> int:
        """Tokens per optimizer step under a regime's settings (`decide` leaves their bptt
        out when --bptt was given)."""
        if "bptt" not in settings:
            return self.tokens_per_step
        return self.tokens_per_step * settings["bptt"] // self.bptt


@dataclass(frozen=True)
class DefaultsRule:
    """The rule's decision for one run (config.json "defaults_rule")."""

    regime: str  # regularised | data-rich | open
    expected_epochs: float | None  # passes over the train split the run should make
    tokens_per_s: float | None  # the probe's measurement (None: not needed or not taken)
    settings: dict = field(default_factory=dict)  # {config field: value} the rule chose
    line: str = ""  # what `zlm train` prints at start

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DefaultsRule:
        try:
            rule = cls(**d)
        except TypeError as e:
            raise CheckpointError(f"config.json has a damaged 'defaults_rule' block ({e}); "
                                  "resume with an explicit --preset") from None
        if rule.regime not in REGIMES:
            raise CheckpointError(f"config.json names an unknown defaults regime {rule.regime!r}; "
                                  "resume with an explicit --preset")
        return rule


def parameters(vocab_size: int, hidden: int, embed: int, layers: int = 1) -> int:
    """The parameter count of a `ZoneoutLM` of this shape (embedding, LSTM layers with one
    bias each, decoder)."""
    lstm = sum(4 * hidden * ((embed if k == 0 else hidden) + hidden + 1) for k in range(layers))
    return vocab_size * embed + lstm + hidden * vocab_size + vocab_size


def run_tokens(length: RunLength, hidden: int, tokens_per_s: float | None,
               probe_hidden: int = PROBE_HIDDEN) -> float | None:
    """Tokens a model of `hidden` units trains on: the nearest of the run's limits (None:
    no limit). Under a time budget its speed is the probe's, scaled by parameter count
    (the work per token) from the probed size."""
    options = []
    if length.epochs is not None:
        options.append(length.epochs * length.train_tokens)
    if length.max_steps is not None:
        options.append(float(length.max_steps * length.tokens_per_step))
    if length.time_budget is not None and tokens_per_s:
        scale = (parameters(length.vocab_size, probe_hidden, length.embed)
                 / parameters(length.vocab_size, hidden, length.embed))
        options.append(length.time_budget * (1 - VALIDATION_SHARE) * tokens_per_s * scale)
    return min(options) if options else None


def expected_epochs(length: RunLength, tokens_per_s: float | None, hidden: int = PROBE_HIDDEN,
                    probe_hidden: int = PROBE_HIDDEN) -> float | None:
    """Passes over the train split a model of `hidden` units makes (None: no limit)."""
    tokens = run_tokens(length, hidden, tokens_per_s, probe_hidden)
    return None if tokens is None else tokens / max(length.train_tokens, 1)


def choose_hidden(length: RunLength, tokens_per_s: float | None, probe_hidden: int = PROBE_HIDDEN) -> int:
    """The largest of HIDDEN_SIZES that trains on TOKENS_PER_PARAMETER tokens per parameter
    or more in this run (a bigger model would stop far from converged, a smaller one
    would waste the run), the smallest when none does."""
    for hidden in reversed(HIDDEN_SIZES):
        tokens = run_tokens(length, hidden, tokens_per_s, probe_hidden)
        if tokens >= TOKENS_PER_PARAMETER * parameters(length.vocab_size, hidden, length.embed):
            return hidden
    return HIDDEN_SIZES[0]


def decide(length: RunLength, tokens_per_s: float | None = None, hidden: int | None = None,
           probe_hidden: int = PROBE_HIDDEN) -> DefaultsRule:
    """The regime and settings for a run of `length` at `tokens_per_s` (pure: no probe).

    hidden: --hidden when given (the size the regime is judged for; the rule does not
    choose one then). probe_hidden: the size `tokens_per_s` was measured with.
    """
    if not length.known:
        return DefaultsRule("open", None, tokens_per_s, {}, "no --time-budget, --epochs or --max-steps: "
                            "the cpu-small preset as it is (regularised, constant lr)")
    size = hidden if hidden is not None else choose_hidden(length, tokens_per_s, probe_hidden)
    epochs = expected_epochs(length, tokens_per_s, size, probe_hidden)
    regime = "regularised" if epochs >= OVERFIT_EPOCHS else "data-rich"
    settings = dict(REGIMES[regime])
    if length.bptt_given:
        settings.pop("bptt", None)
    if hidden is None:
        settings["hidden"] = size
    steps = epochs * length.train_tokens / length.step_tokens(settings)
    settings["eval_every"] = max(MIN_EVAL_EVERY, int(math.ceil(steps / EVALS_PER_RUN / 10.0)) * 10)
    return DefaultsRule(regime, epochs, tokens_per_s, settings,
                        _line(regime, epochs, tokens_per_s, probe_hidden, {"hidden": size, **settings}))


def _line(regime: str, epochs: float, tokens_per_s: float | None, probe_hidden: int, s: dict) -> str:
    speed = f" ({tokens_per_s:,.0f} tokens/s measured at 1x{probe_hidden})" if tokens_per_s else ""
    why = (f"{epochs:.1f} epochs expected{speed}: "
           + (f"{OVERFIT_EPOCHS:g} passes or more, so regularise" if regime == "regularised" else
              f"under {OVERFIT_EPOCHS:g} passes, so no zoneout (the faster plain LSTM)"))
    return (f"{why} -> {s['layers']}x{s['hidden']}, z_c {s['zoneout_cell']:g}, z_h {s['zoneout_hidden']:g}, "
            f"reset-prob {s['reset_prob']:g}, lr {s['lr']:g} {s['schedule']} over the run, "
            + (f"bptt {s['bptt']}, " if "bptt" in s else "")
            + f"validate every {s['eval_every']} steps")


def merge(rule: DefaultsRule | None, options: dict) -> dict:
    """The options `configure` gets: the rule's settings, then every explicit option."""
    if rule is None:
        return dict(options)
    return {**rule.settings, **{k: v for k, v in options.items() if v is not None}}


def needs_probe(length: RunLength) -> bool:
    """A time budget needs this machine's speed to say how many passes it buys."""
    return length.time_budget is not None


def probe_tokens_per_s(model: ModelConfig, train: TrainConfig, seconds: float = 2.0,
                       on_event=None) -> float:
    """Training tokens/s of `model` on this machine: a few optimizer steps (Adam, clip,
    zoneout masks) on random tokens after one untimed step; the global RNG is left as found."""
    device = resolve_device(train.device, 0)
    runtime = Runtime(device, resolve_precision(device, train.precision))
    rng_state = torch.get_rng_state()
    try:
        cell = choose_cell(train.cell, device, on_event, zoneout=(model.zoneout_cell, model.zoneout_hidden))
        lm = ZoneoutLM(model, cell.fn).to(device)
        opt = torch.optim.Adam(lm.parameters(), lr=1e-4)
        x = torch.randint(model.vocab_size, (train.bptt + 1, train.batch_size), device=device)
        h0, c0 = lm.initial_state(train.batch_size, device)
        scaler = runtime.grad_scaler()

        def step():  # the trainer's window: forward, loss, backward; then clip and update
            forward_backward(lm, runtime, scaler, x[:-1], x[1:], h0, c0)
            torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

        step()
        n, t0 = 0, time.perf_counter()
        while n < 2 or time.perf_counter() - t0 < seconds:
            step()
            n += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return n * train.bptt * train.batch_size / (time.perf_counter() - t0)
    finally:
        torch.set_rng_state(rng_state)


def for_run(preset, data, options: dict, *, run_dir=None, resume: bool = False, world: int = 1,
            on_event=None) -> DefaultsRule | None:
    """The rule's decision for a run of `preset` (the default one) on `data` with the
    explicit `options` ({field: value}, None = not given).

    Resuming, it is read back from RUN_DIR/config.json and never decided again; a run
    that started without the rule (an older zlm, or --preset) gets None: its settings are
    the preset's, as when it started. A fresh run is decided now, measuring this
    machine's speed (`probe_tokens_per_s`) when a --time-budget is given.
    """
    if resume and run_dir is not None:
        config = ckpt.read_json_or_none(Path(run_dir) / "config.json")
        if config is not None:
            block = config.get("defaults_rule")
            return DefaultsRule.from_dict(block) if isinstance(block, dict) else None
    given = {k: v for k, v in options.items() if v is not None}
    model, train = configure(preset.model, preset.train, data.vocab_size,
                             {**REGIMES["regularised"], "hidden": PROBE_HIDDEN, **given})
    length = RunLength(data.split_info("train").tokens, train.time_budget, train.epochs, train.max_steps,
                       train.batch_size * train.bptt * world, data.vocab_size, model.embed,
                       train.bptt, "bptt" in given)
    speed = probe_tokens_per_s(model, train, on_event=on_event) if needs_probe(length) else None
    return decide(length, speed, given.get("hidden"), model.hidden)

"""The defaults rule: what `zlm train SOURCE` chooses when no --preset is given.

One preset cannot suit every corpus. On a small corpus a 10-minute budget is many passes
over the text and an unregularised LSTM overfits, so zoneout pays; on a larger one the
budget is a few passes, nothing overfits, and the fastest model that sees the most text
wins. `decide` is a pure function of what the planner measured (`RunLength` and the speed
probe's tokens/s) and returns a `DefaultsRule` whose settings are typed `Options`:

    size    the largest of HIDDEN_SIZES that trains on at least TOKENS_PER_PARAMETER
            tokens per parameter in this run (a model of H units is taken to run at the
            probed speed x parameters at PROBE_HIDDEN / parameters at H)
    E       expected passes = tokens the run buys for that size / train tokens, where a
            time budget buys budget x (1 - VALIDATION_SHARE) x tokens/s; for a size below
            PROBE_HIDDEN the probe also times SMALL_PROBE_HIDDEN, whose fixed per-step
            costs parameter scaling misses, and the time per token between the two
            readings is linear in the parameter count (`speed_at`)
    zoneout grows smoothly with E, linearly in log E: none up to ZONEOUT_FROM passes
            (torch's LSTM kernel runs then), ZONEOUT_CELL / ZONEOUT_HIDDEN from ZONEOUT_FULL
            passes on (`zoneout_strength`): no cliff, the more passes the more regularisation
    window and learning rate follow E the same way (`regime_for`): the "data-rich" regime's
            (REGIMES below) up to REGULARISED_FROM passes, the "regularised" regime's from
            REGULARISED_FULL on, and between them ("between") geometric means of the two
            weighted linearly in log E: no cliff here either
    average the weights over the last AVERAGE_SHARE of the run (`--average`)
    overfitting   ON_OVERFIT: once valid BPC rises at two validations, or stays 1% above its
            best at two (not climbing back), while the train slice's falls, back to the best
            weights, half the lr cooled to 0 over half a validation interval, and stop
            (`--on-overfit`, `zlm.training.schedule`)
    no run length         "open": the preset as it is (it may run for many epochs)

On CUDA the probe times the step the run will take (graphed fused cell, the resolved
precision) at each of CUDA_BATCHES, and torch's LSTM (cuDNN) beside it (`GpuSpeeds`):
the batch is the smallest whose speed is within BATCH_SPEED_SHARE of the fastest (more
updates for the same text), validation runs CUDA_EVAL_STREAMS streams, and a data-rich
run keeps the fused cell (zoneout 0) unless cuDNN measured faster.

With a length, validation runs about EVALS_PER_RUN times, and at least every
PASSES_PER_EVAL passes over the train split (--eval-every): a run of many passes that
overfits after two keeps a checkpoint from before it does. All its validations together
score at most EVAL_TOKEN_SHARE of the tokens the run trains on: a run shorter than about a
pass over a large corpus validates on a sample of the valid split (--eval-tokens, at least
MIN_EVAL_TOKENS) instead of spending its budget scoring all of it. Explicit
options win over every choice. The decision is stored in config.json ("defaults_rule")
and a resumed run reads it back instead of deciding again. How each constant was chosen,
and the measurements behind it, are in docs/defaults-rule.md.

Nothing here imports torch (`zlm train --help` quotes these constants).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from zlm.core.config import Options
from zlm.core.spec import DefaultsRule

# The next five constants are chosen by `zlm recipe defaults-loco` (zlm/tools/loco.py); ZONEOUT_HIDDEN
# is half of ZONEOUT_CELL.
REGULARISED_FROM = 4.0  # expected passes up to which a run takes the data-rich regime's window and lr
REGULARISED_FULL = 8.0  # expected passes from which it takes the regularised regime's (a ramp between)
ZONEOUT_FROM = 8.0  # expected passes up to which a run has no zoneout
ZONEOUT_FULL = 16.0  # expected passes from which it has the full ZONEOUT_CELL and ZONEOUT_HIDDEN
ZONEOUT_CELL = 0.1  # z_c at full strength
ZONEOUT_HIDDEN = 0.05  # z_h at full strength
AVERAGE_SHARE = 0.25  # the last share of a run of known length whose weights are averaged
ON_OVERFIT = "cool-down"  # what a run of known length does once it overfits (`zlm.training.schedule`)
VALIDATION_SHARE = 0.1  # the part of a time budget validation and checkpoints take
EVALS_PER_RUN = 6  # validations in a run of known length (and one at the end)
PASSES_PER_EVAL = 1.0  # and at least one validation per this many passes over the train split
MIN_EVAL_EVERY = 50
EVAL_TOKEN_SHARE = 1 / 3  # all of a run's validations score at most this share of the tokens it trains on
MIN_EVAL_TOKENS = 50_000  # and each at least this many (or the whole valid split)
HIDDEN_SIZES = (128, 256, 384, 512, 768, 1024)  # the sizes the rule picks from (more: --hidden)
TOKENS_PER_PARAMETER = 10.0  # a model should train on at least this many tokens per parameter
PROBE_HIDDEN = 512  # the size whose speed the probe measures (unless --hidden is given)
SMALL_PROBE_HIDDEN = 128  # and the second size it measures when the rule would choose below PROBE_HIDDEN
CUDA_BATCHES = (32, 64, 128, 256)  # the batches the CUDA probe times
BATCH_SPEED_SHARE = 0.8  # the smallest batch within this share of the fastest's tokens/s
CUDA_EVAL_STREAMS = 64  # validation streams on CUDA (more streams fill the device)


@dataclass(frozen=True)
class Regime:
    """The settings of one regime besides the size (each becomes the option of its name)."""

    layers: int
    embed: int
    reset_prob: float  # both regimes reset: evaluation's streams start from a zero state
    lr: float
    schedule: str
    bptt: int

    def options(self) -> Options:
        return Options(layers=self.layers, embed=self.embed, reset_prob=self.reset_prob, lr=self.lr,
                       schedule=self.schedule, bptt=self.bptt)


REGIMES = {
    "regularised": Regime(layers=1, embed=64, reset_prob=0.02, lr=5e-3, schedule="cosine", bptt=25),
    "data-rich": Regime(layers=1, embed=64, reset_prob=0.02, lr=4e-3, schedule="cosine", bptt=50),
}
RULED = ("hidden", *REGIMES["regularised"].options().given(), "zoneout_cell", "zoneout_hidden", "average",
         "on_overfit", "eval_every", "eval_tokens")
"""The options the rule chooses (all others come from the preset)."""


def probe_options() -> Options:
    """What the speed probe times: the zoneout cell at full strength at PROBE_HIDDEN, in the
    regularised regime's window (a run with less zoneout is as fast or faster)."""
    return (REGIMES["regularised"].options()
            | Options(zoneout_cell=ZONEOUT_CELL, zoneout_hidden=ZONEOUT_HIDDEN, hidden=PROBE_HIDDEN))


def zoneout_strength(epochs: float, start: float = ZONEOUT_FROM, full: float = ZONEOUT_FULL) -> float:
    """0 up to `start` expected passes, 1 from `full`, linear in log passes between
    (continuous and non-decreasing in `epochs`)."""
    if epochs <= start:
        return 0.0
    if epochs >= full:
        return 1.0
    return math.log(epochs / start) / math.log(full / start)


def window_share(epochs: float, start: float = REGULARISED_FROM, full: float = REGULARISED_FULL) -> float:
    """How far a run of `epochs` expected passes is from the data-rich regime's window and
    lr (0) to the regularised regime's (1): `zoneout_strength` between `start` and `full`."""
    return zoneout_strength(epochs, start, full)


def window_at(share: float) -> Options:
    """The window and lr `share` of the way from the data-rich regime's (0) to the regularised
    regime's (1): geometric between them (lr to 3 significant figures, bptt to whole tokens),
    with the data-rich regime's other settings."""
    rich, reg = REGIMES["data-rich"], REGIMES["regularised"]
    if share <= 0.0:
        return rich.options()
    if share >= 1.0:
        return reg.options()
    lr = float(f"{rich.lr * (reg.lr / rich.lr) ** share:.3g}")
    bptt = round(rich.bptt * (reg.bptt / rich.bptt) ** share)
    return rich.options() | Options(lr=lr, bptt=bptt)


def regime_for(epochs: float) -> tuple[str, Options]:
    """The regime's name and settings for a run of `epochs` expected passes: the data-rich
    regime's up to REGULARISED_FROM, the regularised regime's from REGULARISED_FULL, and
    "between" them lr and bptt move geometrically, in step with log passes (`window_at`):
    1% more passes never move bptt by more than a token nor lr by more than 1%."""
    k = window_share(epochs)
    return ("data-rich" if k == 0.0 else "regularised" if k == 1.0 else "between"), window_at(k)


def zoneout_for(epochs: float) -> Options:
    """z_c and z_h for a run of `epochs` expected passes (rounded to 4 decimals)."""
    k = zoneout_strength(epochs)
    return Options(zoneout_cell=round(ZONEOUT_CELL * k, 4), zoneout_hidden=round(ZONEOUT_HIDDEN * k, 4))


@dataclass(frozen=True)
class GpuSpeeds:
    """The CUDA probe's readings, training tokens/s by batch: the graphed fused cell with
    zoneout (what the run takes) and torch's LSTM on cuDNN (no zoneout, not graphed)."""

    fused: dict[int, float]
    plain: dict[int, float]

    def batch(self) -> int:
        """The smallest batch within BATCH_SPEED_SHARE of the fastest fused reading."""
        best = max(self.fused.values())
        return min(b for b, v in self.fused.items() if v >= BATCH_SPEED_SHARE * best)


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
    batch: int = 32  # the batch tokens_per_step counts
    valid_tokens: int = 0  # the valid split's tokens (0: unknown, validation scores all of it)

    @property
    def known(self) -> bool:
        return any(v is not None for v in (self.time_budget, self.epochs, self.max_steps))

    def step_tokens(self, settings: Options) -> int:
        """Tokens per optimizer step under a regime's settings (`decide` leaves their bptt
        out when --bptt was given)."""
        tokens = self.tokens_per_step
        if settings.batch_size is not None:
            tokens = tokens * settings.batch_size // self.batch
        return tokens if settings.bptt is None else tokens * settings.bptt // self.bptt


def parameters(vocab_size: int, hidden: int, embed: int, layers: int = 1) -> int:
    """The parameter count of a `ZoneoutLM` of this shape (embedding, LSTM layers with one
    bias each, decoder)."""
    lstm = sum(4 * hidden * ((embed if k == 0 else hidden) + hidden + 1) for k in range(layers))
    return vocab_size * embed + lstm + hidden * vocab_size + vocab_size


def speed_at(length: RunLength, hidden: int, tokens_per_s: float, probe_hidden: int = PROBE_HIDDEN,
             small: tuple[int, float] | None = None) -> float:
    """Training tokens/s of a model of `hidden` units, from the probe's reading at
    `probe_hidden` and, when taken, `small` = (size, tokens/s) below it. The time per token
    is taken as linear in the parameter count between the two readings, and proportional to
    it beyond them (from the nearer reading); with one reading, proportional throughout.
    A small model's fixed costs per step (the time loop, the element-wise work, the
    optimizer's launches) do not shrink with its parameters: scaled from 1x512, a 1x128
    model on 2 CPU cores was predicted 1.4-3.9x faster than it trains (docs/defaults-rule.md).
    A small reading slower than the large one is taken as equal to it."""
    def count(h: int) -> float:
        return float(parameters(length.vocab_size, h, length.embed))

    hi = (count(probe_hidden), tokens_per_s)
    lo = hi if small is None or small[0] >= probe_hidden or not small[1] else (count(small[0]), max(small[1], hi[1]))
    p = count(hidden)
    if p >= hi[0]:
        return hi[1] * hi[0] / p
    if p <= lo[0]:
        return lo[1] * lo[0] / p
    per_token = 1.0 / lo[1] + (1.0 / hi[1] - 1.0 / lo[1]) * (p - lo[0]) / (hi[0] - lo[0])
    return 1.0 / per_token


def run_tokens(length: RunLength, hidden: int, tokens_per_s: float | None,
               probe_hidden: int = PROBE_HIDDEN, small: tuple[int, float] | None = None) -> float | None:
    """Tokens a model of `hidden` units trains on: the nearest of the run's limits (None:
    no limit). Under a time budget its speed is `speed_at`'s (the probe's readings, scaled
    to the size by parameter count)."""
    options = []
    if length.epochs is not None:
        options.append(length.epochs * length.train_tokens)
    if length.max_steps is not None:
        options.append(float(length.max_steps * length.tokens_per_step))
    if length.time_budget is not None and tokens_per_s:
        options.append(length.time_budget * (1 - VALIDATION_SHARE)
                       * speed_at(length, hidden, tokens_per_s, probe_hidden, small))
    return min(options) if options else None


def expected_epochs(length: RunLength, tokens_per_s: float | None, hidden: int = PROBE_HIDDEN,
                    probe_hidden: int = PROBE_HIDDEN, small: tuple[int, float] | None = None) -> float | None:
    """Passes over the train split a model of `hidden` units makes (None: no limit)."""
    tokens = run_tokens(length, hidden, tokens_per_s, probe_hidden, small)
    return None if tokens is None else tokens / max(length.train_tokens, 1)


def choose_hidden(length: RunLength, tokens_per_s: float | None, probe_hidden: int = PROBE_HIDDEN) -> int:
    """The largest of HIDDEN_SIZES that trains on TOKENS_PER_PARAMETER tokens per parameter
    or more in this run (a bigger model would stop far from converged, a smaller one
    would waste the run), the smallest when none does. The speeds are the probe's reading
    scaled by parameter count, as when TOKENS_PER_PARAMETER was set, not the small reading:
    the plans a short budget gets below PROBE_HIDDEN are mostly plain LSTMs in a longer
    window, which run faster than the probe's zoneout cell at bptt 25, and a choice made
    with the small reading took a smaller model that did worse (docs/defaults-rule.md)."""
    for hidden in reversed(HIDDEN_SIZES):
        tokens = run_tokens(length, hidden, tokens_per_s, probe_hidden)
        if tokens >= TOKENS_PER_PARAMETER * parameters(length.vocab_size, hidden, length.embed):
            return hidden
    return HIDDEN_SIZES[0]


def small_probe(length: RunLength, tokens_per_s: float | None, hidden: int | None,
                probe_hidden: int = PROBE_HIDDEN) -> int | None:
    """The second size the probe should time (None: no second reading is needed): when the
    rule chooses the size (no --hidden) under a time budget and picks one below the probed
    size, the rule measures SMALL_PROBE_HIDDEN too, for that size's expected passes."""
    if hidden is not None or not tokens_per_s or length.time_budget is None or probe_hidden <= SMALL_PROBE_HIDDEN:
        return None
    return SMALL_PROBE_HIDDEN if choose_hidden(length, tokens_per_s, probe_hidden) < probe_hidden else None


def decide(length: RunLength, tokens_per_s: float | None = None, hidden: int | None = None,
           probe_hidden: int = PROBE_HIDDEN, gpu: GpuSpeeds | None = None,
           small: tuple[int, float] | None = None) -> DefaultsRule:
    """The regime and settings for a run of `length` at `tokens_per_s` (pure: no probe).

    hidden: --hidden when given (the size the regime is judged for; the rule does not
    choose one then). probe_hidden: the size `tokens_per_s` was measured with. gpu: the
    CUDA probe's readings (they give the batch and the speed instead of tokens_per_s).
    small: the second reading (size, tokens/s) that `small_probe` asks for, when taken.
    """
    if gpu is not None and length.known:
        return _decide_gpu(length, gpu, hidden, probe_hidden)
    if not length.known:
        return DefaultsRule("open", None, tokens_per_s, Options(), "no --time-budget, --epochs or --max-steps: "
                            "the cpu-small preset as it is (regularised, constant lr)")
    size = hidden if hidden is not None else choose_hidden(length, tokens_per_s, probe_hidden)
    epochs = expected_epochs(length, tokens_per_s, size, probe_hidden, small)
    regime, window = regime_for(epochs)
    settings = window | zoneout_for(epochs) | Options(average=AVERAGE_SHARE, on_overfit=ON_OVERFIT)
    if length.bptt_given:
        settings = Options(**{**settings.given(), "bptt": None})
    step_tokens = length.step_tokens(settings)
    eval_every = eval_interval(epochs, length.train_tokens / step_tokens)
    sample = eval_sample(epochs * length.train_tokens, step_tokens * eval_every, length.valid_tokens)
    settings = settings | Options(hidden=None if hidden is not None else size, eval_every=eval_every,
                                  eval_tokens=sample or None)
    small_hidden, small_speed = small if small is not None else (None, None)
    return DefaultsRule(regime, epochs, tokens_per_s, settings,
                        _line(regime, epochs, tokens_per_s, probe_hidden, size, settings, small),
                        small_hidden, small_speed)


def eval_interval(epochs: float, steps_per_pass: float) -> int:
    """Steps between validations in a run of `epochs` passes of `steps_per_pass` steps:
    EVALS_PER_RUN in the run, or one per PASSES_PER_EVAL passes when that is more often,
    rounded up to tens of steps (MIN_EVAL_EVERY at least). Continuous up to the rounding and
    non-decreasing in both arguments."""
    steps = min(epochs / EVALS_PER_RUN, PASSES_PER_EVAL) * steps_per_pass
    return max(MIN_EVAL_EVERY, int(math.ceil(steps / 10.0)) * 10)


def eval_sample(run_tokens: float, interval_tokens: int, valid_tokens: int) -> int:
    """Valid tokens each validation scores (--eval-tokens; 0: the whole split) in a run of
    `run_tokens` training tokens validating every `interval_tokens`: EVAL_TOKEN_SHARE of the
    run's tokens over its validations, rounded up to thousands, MIN_EVAL_TOKENS at least; 0
    when that covers the split. A run of E < PASSES_PER_EVAL passes validates about
    EVALS_PER_RUN times (`eval_interval`), so with zlm's 90/5/5 split the sample is about
    E x EVAL_TOKEN_SHARE x 18 / EVALS_PER_RUN of the valid split: all of it from one pass."""
    if valid_tokens <= 0:
        return 0
    validations = max(1, math.ceil(run_tokens / interval_tokens))
    sample = max(MIN_EVAL_TOKENS, int(math.ceil(EVAL_TOKEN_SHARE * run_tokens / validations / 1000.0)) * 1000)
    return 0 if sample >= valid_tokens else sample


def _decide_gpu(length: RunLength, gpu: GpuSpeeds, hidden: int | None, probe_hidden: int) -> DefaultsRule:
    """The CUDA branch: the batch from the readings, then the size and regime at its speed."""
    batch = gpu.batch()
    tokens_per_step = length.tokens_per_step * batch // length.batch
    rule = decide(replace(length, tokens_per_step=tokens_per_step, batch=batch), gpu.fused[batch], hidden,
                  probe_hidden)
    extra = Options(batch_size=batch, eval_streams=CUDA_EVAL_STREAMS)
    plain = gpu.plain.get(batch, 0.0)
    if rule.settings.zoneout_cell == rule.settings.zoneout_hidden == 0.0 and gpu.fused[batch] >= plain:
        extra = extra | Options(cell="fused")  # zoneout 0, but graphed: faster than cuDNN here
    why = (f"; CUDA: batch {batch} (graphed fused cell {gpu.fused[batch]:,.0f} tokens/s, "
           f"cuDNN {plain:,.0f}{', so the fused cell' if extra.cell == 'fused' else ''})")
    return replace(rule, settings=rule.settings | extra, line=rule.line + why)


def _line(regime: str, epochs: float, tokens_per_s: float | None, probe_hidden: int, size: int,
          s: Options, small: tuple[int, float] | None = None) -> str:
    also = f", {small[1]:,.0f} at 1x{small[0]}" if small is not None else ""
    speed = f" ({tokens_per_s:,.0f} tokens/s measured at 1x{probe_hidden}{also})" if tokens_per_s else ""
    k = zoneout_strength(epochs)
    why = (f"{epochs:.1f} epochs expected{speed}: zoneout at {k:.0%} of full strength"
           + (" (none: the faster plain LSTM)" if k == 0 else "")
           + f", {_regime_words(regime, epochs, 'window and lr' if s.bptt is not None else 'lr')}")
    return (f"{why} -> {s.layers}x{size}, z_c {s.zoneout_cell:g}, z_h {s.zoneout_hidden:g}, "
            f"reset-prob {s.reset_prob:g}, lr {s.lr:g} {s.schedule} over the run, "
            + (f"bptt {s.bptt}, " if s.bptt is not None else "")
            + f"average the last {s.average:.0%}, validate every {s.eval_every} steps"
            + (f" on {s.eval_tokens:,} tokens spread over the valid split" if s.eval_tokens else "")
            + (", cool down and stop once it overfits" if s.on_overfit == "cool-down" else ""))


def _regime_words(regime: str, epochs: float, what: str) -> str:
    """What the regime gives the run: its window and lr, or only its lr under --bptt."""
    if regime != "between":
        return f"the {regime} regime's {what}"
    return f"{what} {window_share(epochs):.0%} of the way from the data-rich regime's to the regularised one's"


def needs_probe(length: RunLength) -> bool:
    """A time budget needs this machine's speed to say how many passes it buys."""
    return length.time_budget is not None

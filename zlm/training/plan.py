"""`plan(source, options)`: the one path from what a user asked for to a frozen `Plan`.

`zlm train`, the recipes, the corpora benchmark, the Python API (`zlm.train`) and the
tests all go through it, and the Trainer is built from its result and nothing else:

    plan(source, options, preset=...)
      1. the run directory: --out or runs/<name>; a taken one is refused without --resume
      2. the data: a prepared DATA_DIR as it is, anything else prepared into RUN_DIR/data
      3. the configs: preset | the defaults rule's settings | the given options
         (`Options.apply`; the rule only without --preset, measuring this machine's speed
         when a --time-budget is given: `zlm.training.defaults`, `speed_probe`)
      4. "auto" resolved once: precision and cell kernel (`zlm.training.resolve`)
      -> Plan(run_dir, RunSpec, resume_from)  ->  Trainer(plan).fit()

Resuming, steps 3-4 are read back from the run's config.json (`zlm.core.spec.read_spec`):
the run keeps its model, rule and resolution; options given again replace only training
settings (e.g. a longer --max-steps), and a model option that differs is refused.
Every mistake is reported here, once, before any training process starts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from zlm.core import checkpoint as ckpt
from zlm.core.config import Options, flag
from zlm.core.precision import resolve_device
from zlm.core.reporter import Reporter
from zlm.core.spec import DataRef, DefaultsRule, RunSpec, read_spec
from zlm.data import catalog
from zlm.data.dataset import Dataset
from zlm.data.prepare import PrepareConfig, prepare
from zlm.errors import UsageError
from zlm.training import defaults, distributed
from zlm.training.init_from import check_shape, find_parent
from zlm.training.presets import Preset, get_preset
from zlm.training.resolve import resolve_fresh
from zlm.training.run_dir import RunDir, default_run_dir

PROBE = object()  # `_rule`'s speed when it measures this machine (a --time-budget needs it)


@dataclass(frozen=True)
class Plan:
    """A run, fully decided: where it runs, its spec, and the checkpoint it continues from."""

    run_dir: Path
    spec: RunSpec
    resume_from: Path | None = None  # a resumed run's latest complete checkpoint


def plan(source: str | Path, options: Options = Options(), *, out: Path | None = None,
         preset: str | Preset | None = None, resume: bool = False, mirror: Path | None = None,
         unknown: str | None = None, world: int | None = None, init_from: str | Path | None = None,
         reporter: Reporter | None = None) -> Plan:
    """Plan a run of `source` (a DATA_DIR, a text file or a corpus name) with `options`.

    preset: a name, a `Preset` (a library caller's own configs) or None (the default
    preset adapted by the defaults rule). world: processes the run will have (default:
    the launcher's WORLD_SIZE, else 1). init_from: a trained model (RUN_DIR or checkpoint)
    whose weights, shape and tokenizer the new run starts from (`zlm.training.init_from`).
    Under torchrun only rank 0 plans for real; the other ranks' plans are replaced by
    rank 0's when the Trainer starts.
    """
    rep = reporter or Reporter()
    source = str(source)
    restarted = distributed.restart_count() > 0
    resume = resume or restarted  # an elastic agent relaunched the job: resume
    world = world or distributed.world_from_env()
    run_dir = Path(out) if out is not None else default_run_dir(source, resume or world > 1)
    parent = None
    if init_from is not None:
        parent = find_parent(init_from)
        check_shape(parent, options)
        options = parent.shape() | options
    if distributed.rank_from_env() != 0:
        data = _wait_for_data(source, run_dir)
        return Plan(run_dir, _fresh(data, options, preset, world, rep, use_rule=False))
    RunDir(run_dir).check(resume)
    check_values(options, preset)
    if restarted:
        rep.message(f"elastic restart {distributed.restart_count()}: resuming from the latest checkpoint")
    data = open_or_prepare(source, run_dir, mirror, rep, unknown, None if parent is None else parent.path)
    latest = ckpt.latest_complete(run_dir, warn=rep.message) if resume else None
    if resume and latest is None:
        rep.message(f"no complete checkpoint in {run_dir}: starting fresh")
    stored = latest or (run_dir if resume and (run_dir / "config.json").is_file() else None)
    if stored is not None:
        spec = _resumed(read_spec(stored), data, options, preset, world, rep)
    else:
        spec = _fresh(data, options, preset, world, rep)
        if parent is not None:
            spec = replace(spec, parent=parent.ref)
            rep.message(f"initialised from {parent.path} ({parent.spec.model.layers}x{parent.spec.model.hidden}, "
                        f"vocabulary {parent.spec.model.vocab_size} -> {spec.model.vocab_size})")
    return Plan(run_dir, spec, latest)


def check_values(options: Options, preset: str | Preset | None) -> None:
    """Refuse a bad option value (or preset name) before the data is prepared into the run
    directory: the configs' own checks, run on the preset with the options applied. The
    vocabulary is not known yet and takes part in no check of an option's value."""
    base = _base(preset)
    options.apply(base.model, base.train, vocab_size=0)


def _base(preset: str | Preset | None) -> Preset:
    """The preset a run starts from: a library caller's own, or the named one (None: the default)."""
    return preset if isinstance(preset, Preset) else get_preset(preset)


def replay(stored: RunSpec, data: Dataset, options: Options, preset: Preset | None = None) -> RunSpec | None:
    """The spec a fresh `plan(data, options, preset=...)` gives now, the defaults rule
    decided again at the speed `stored` measured (no probe): its model and train configs
    equal `stored`'s unless the rule or the preset changed since `stored` was planned
    (`zlm.tools.benchmark` retrains a recorded run that no longer matches). preset: for a
    run planned with a library caller's own `Preset` (None: the stored spec's preset name,
    or the defaults rule when it has one). None when that cannot be told without probing:
    the CUDA probe's readings (the batch it chose) are not stored, nor a small model's speed
    for a run planned before the rule measured one (`defaults.small_probe`)."""
    if stored.rule is not None and stored.rule.settings.batch_size is not None:
        return None  # the CUDA branch chose the batch from readings config.json does not keep
    chosen = None if stored.rule is not None else (preset or stored.preset)
    speed = stored.rule.tokens_per_s if stored.rule is not None else None
    try:
        return _fresh(data, options, chosen, stored.world_size, Reporter(), speed=speed, small=_small(stored.rule))
    except _Untold:
        return None


class _Untold(Exception):
    """`replay` cannot tell the plan: the rule now wants a reading the stored run did not take."""


def _small(rule: DefaultsRule | None) -> tuple[int, float] | None:
    """The stored rule's second reading (`defaults.small_probe`), when it took one."""
    if rule is None or rule.small_hidden is None or rule.small_tokens_per_s is None:
        return None
    return rule.small_hidden, rule.small_tokens_per_s


def _fresh(data: Dataset, options: Options, preset: str | Preset | None, world: int, rep: Reporter,
           use_rule: bool = True, speed: float | None | object = PROBE,
           small: tuple[int, float] | None = None) -> RunSpec:
    base = _base(preset)
    rule = _rule(base, data, options, world, rep, speed, small) if preset is None and use_rule else None
    chosen = (rule.settings if rule is not None else Options()) | options
    model, train = chosen.apply(base.model, base.train, data.vocab_size)
    resolved = resolve_fresh(train, model, resolve_device(train.device, 0), rep.message if use_rule else None)
    return RunSpec(model, train, resolved, data_ref(data), base.name, rule, world)


def _rule(base: Preset, data: Dataset, options: Options, world: int, rep: Reporter,
          speed: float | None | object = PROBE, small: tuple[int, float] | None = None) -> DefaultsRule:
    """The defaults rule's decision; measures this machine's speed for a --time-budget
    (speed PROBE: the probed size, and a small one where `defaults.small_probe` asks), or
    decides at the speed given (None: unknown) and the small reading given (`replay`; it
    raises _Untold when the rule wants a small reading and none was given)."""
    probe = defaults.probe_options() | options
    model, train = probe.apply(base.model, base.train, data.vocab_size)
    length = defaults.RunLength(data.split_info("train").tokens, train.time_budget, train.epochs,
                                train.max_steps, train.batch_size * train.bptt * world, data.vocab_size,
                                model.embed, train.bptt, options.bptt is not None, train.batch_size,
                                data.split_info("valid").tokens)
    if speed is not PROBE:
        wants = defaults.small_probe(length, speed, options.hidden, model.hidden)
        if wants is not None and (small is None or small[0] != wants):
            raise _Untold
        return defaults.decide(length, speed, options.hidden, model.hidden, small=small if wants else None)
    speed = gpu = small = None
    if defaults.needs_probe(length):
        from zlm.training import speed_probe

        if resolve_device(train.device, 0).type == "cuda":
            gpu = speed_probe.probe_gpu(model, train, options.batch_size, on_event=rep.message)
        else:
            speed = speed_probe.probe_tokens_per_s(model, train, on_event=rep.message)
            wants = defaults.small_probe(length, speed, options.hidden, model.hidden)
            if wants is not None:
                small = (wants, speed_probe.probe_tokens_per_s(replace(model, hidden=wants), train,
                                                               on_event=rep.message))
    rule = defaults.decide(length, speed, options.hidden, model.hidden, gpu, small)
    rep.message(f"no --preset given: {base.name} with the defaults rule: {rule.line}; {_overrides(rule, options)}")
    return rule


def _overrides(rule: DefaultsRule, options: Options) -> str:
    """Which of the rule's choices the run's explicit options replace, and with what."""
    chosen = rule.settings.given()
    yours = [f"{flag(k)} {v}" for k, v in options.given().items() if k in chosen and chosen[k] != v]
    return f"the run takes yours instead: {', '.join(yours)}" if yours else "explicit options override it"


def _resumed(stored: RunSpec, data: Dataset, options: Options, preset: str | Preset | None, world: int,
             rep: Reporter) -> RunSpec:
    """The stored spec, with the training options given now replacing its values."""
    name = preset.name if isinstance(preset, Preset) else preset
    if name is not None and name != stored.preset:
        raise UsageError(f"this run was started with --preset {stored.preset}; resume it without --preset "
                         f"or with --preset {stored.preset}")
    for key, value in options.model_options().items():
        if getattr(stored.model, key) != value:
            raise UsageError(f"{flag(key)} {value} differs from this run's {getattr(stored.model, key)} "
                             f"(config.json); a resumed run keeps its model: leave {flag(key)} out or "
                             "start a new run directory")
    _, train = options.apply(stored.model, stored.train, data.vocab_size)
    if stored.rule is not None:
        rep.message(f"the defaults rule as this run started: {stored.rule.line}")
    return replace(stored, train=train, data=data_ref(data), world_size=world)


def data_ref(data: Dataset) -> DataRef:
    return DataRef(str(Path(data.path).resolve()), data.meta["tokenizer"], data.unit)


def open_or_prepare(source: str, run_dir: Path, mirror: Path | None, rep: Reporter,
                    unknown: str | None = None, base: Path | None = None) -> Dataset:
    """A prepared DATA_DIR as it is; anything else is prepared into RUN_DIR/data (char, or
    the tokenizer of `base`, a checkpoint directory: --init-from).

    A text file's vocabulary is every character of the whole file (`--unknown include`,
    as char-rnn and nanoGPT build it), so any UTF-8 text trains without flags; a named
    corpus keeps its own convention. `unknown` overrides both.
    """
    src = Path(source)
    if src.is_dir() and (src / "dataset.json").exists():
        return Dataset.open(src)
    if not src.exists() and source not in catalog.names():
        raise UsageError(f"{source}: no such file, directory or corpus name; pass a text file, a "
                         f"DATA_DIR from zlm prepare, or one of {', '.join(catalog.names())}")
    data_dir = run_dir / "data"
    if (data_dir / "dataset.json").exists():
        rep.message(f"using the data already prepared in {data_dir}")
        return Dataset.open(data_dir)
    if unknown is None and source not in catalog.names():
        unknown = "include"
    vocab = {"include": ", vocabulary from the whole text", "replace": ", unseen characters -> U+FFFD"}
    tokenizer = "char tokenizer" if base is None else f"the tokenizer of {base}"
    rep.message(f"preparing {source} into {data_dir} ({tokenizer}, 90/5/5 split{vocab.get(unknown, '')})")
    return prepare(source, data_dir, PrepareConfig(mirror=mirror, unknown=unknown,
                                                   base=None if base is None else str(base)))


def _wait_for_data(source: str, run_dir: Path, timeout: float = 3600.0) -> Dataset:
    src = Path(source)
    path = src if (src / "dataset.json").exists() else run_dir / "data"
    deadline = time.time() + timeout
    while not (path / "dataset.json").exists():
        if time.time() > deadline:
            raise UsageError(f"rank 0 did not prepare {path} within {timeout:.0f}s")
        time.sleep(0.5)
    return Dataset.open(path)


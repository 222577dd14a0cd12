"""`zlm recipe corpora-benchmark`: zlm's defaults against a plain-LSTM baseline on every
corpus of the benchmark set (corpora/benchmark.json), at one time budget, several seeds.

Owns `BenchmarkConfig`, `corpora_benchmark(config)`, the two settings it compares and
the results table. For each corpus: its text (OUT_DIR/<name>/input.txt from
`scripts/fetch-corpora`, or a built-in corpus by name) is prepared once into
OUT/<corpus>/data (char tokenizer, 90/5/5 contiguous, vocabulary over the whole corpus);
each (setting, seed) trains into OUT/<corpus>/<setting>-seed<N>; its best checkpoint is
scored on the full valid and test splits with `zlm eval`'s function (`EvalConfig()`
defaults); OUT/results.json, OUT/results.md and OUT/<corpus>/curves.png are written.

The two settings:

- "defaults": exactly what `zlm train SOURCE --time-budget T --seed S` resolves
  (`zlm_defaults`, the one place that asks the training layer for its defaults);
- "baseline": a fast plain LSTM: zoneout 0 for both states, 1x512, embed
  64, Adam 2e-3 constant, clip 1, batch 32, bptt 100, state carried, no resets, with the
  defaults' precision, device, cell choice and validation schedule (--eval-every), so
  the time budget buys the same kind of training and validation for both.

Restartable like the other recipes: finished runs (a "finish" event) and their
results.json are kept, an unfinished run resumes from its latest checkpoint. With
`--record DIR` each finished run's small files (RECORD_FILES: its spec, log and scores, no
weights) are also copied to DIR/<corpus>/<setting>-seed<N>, and a run found there is
restored instead of trained: a benchmark spread over machines whose OUT does not survive
continues from the record (kept in git, say) where it stopped. A run, here or in the
record, planned otherwise than `run_plan` plans it now (the defaults rule, the baseline
or a preset changed since) is trained again: `planned_now` decides its plan again at the
speed it measured, without probing, and `stale` names the settings that differ; such a
run in OUT is moved to OUT/<corpus>/<run>.stale, such a record is replaced once the new
run finishes. `--report` trains nothing:
it writes the tables from the runs finished so far (here or in the record; stale ones left
out), "-" where a run is missing, and lists what is left.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from zlm.atomic import building
from zlm.core import checkpoint as ckpt
from zlm.core.config import Options, ScheduleConfig, TrainConfig
from zlm.core.metrics import parse_metrics, read_metrics
from zlm.core.reporter import Reporter
from zlm.core.spec import DefaultsRule, RunSpec, read_spec
from zlm.data import benchmark_corpora as benchmark
from zlm.data.dataset import Dataset
from zlm.errors import UsageError, ZlmError
from zlm.model.config import ModelConfig
from zlm.tools.curves import read_run, read_runs
from zlm.tools.recipes import RecipeResult, ReporterFactory, score_run
from zlm.training.plan import Plan, plan, replay
from zlm.training.presets import Preset
from zlm.training.runner import run
from zlm.training.schedule import first_overfit

NAME = "corpora-benchmark"
SETTINGS = ("defaults", "baseline")
DEFAULT_MINUTES = 10.0
DEFAULT_SEEDS = (1, 2)
WIN_MARGIN = 0.03  # the defaults win when their mean is this much below the baseline's
# The baseline: the fields it fixes; everything else follows the defaults.
BASELINE_MODEL = dict(hidden=512, layers=1, embed=64, zoneout_cell=0.0, zoneout_hidden=0.0,
                      dropout=0.0)
BASELINE_TRAIN = dict(batch_size=32, bptt=100, lr=2e-3, optimizer="adam", weight_decay=0.0,
                      clip=1.0, schedule=ScheduleConfig(kind="constant"), state="carry",
                      reset_prob=0.0)
BASELINE = Preset("plain-baseline", "the corpora benchmark's plain LSTM",
                  ModelConfig(**BASELINE_MODEL), TrainConfig(**BASELINE_TRAIN))
SHARED_TRAIN = ("eval_every", "eval_streams", "eval_tokens", "device", "precision", "cell", "cuda_graphs",
                "keep_last", "log_every", "max_nonfinite")  # the baseline takes the defaults'
# What --record keeps of a finished run: enough for the tables (`score_run`, `read_run`) and
# its spec, not its checkpoints; and RECORD_LOG, its metrics.jsonl gzipped without the
# per-step lines and with at most RECORD_TRAIN_POINTS of its train lines, evenly spaced,
# the last always kept (a 10-minute run logs 23,000 steps and 2,300 train lines: 4 MB).
# A baseline run's copy of the defaults rule's decision whose validation schedule it took:
# its measured speed lets `planned_now` decide that schedule again without probing.
BASELINE_RULE = "defaults_rule.json"
RECORD_FILES = ("config.json", "results.json", "best/trainer.json", "best/dataset.json", BASELINE_RULE)
RECORD_LOG = "metrics.jsonl.gz"
RECORD_TRAIN_POINTS = 300
SIZE_OPTIONS = ("hidden", "layers", "embed", "batch_size", "bptt", "eval_every", "log_every",
                "device")


@dataclass(frozen=True)
class BenchmarkConfig:
    """Options of `zlm recipe corpora-benchmark`.

    corpora: OUT_DIR of scripts/fetch-corpora (None: $ZLM_BENCH_CORPORA, else runs/corpora).
    only: comma-separated corpus names (--only; None: the whole set).
    seeds: one run per setting and seed (--seeds 1,2).
    max_steps: a fixed step budget instead of --minutes (quick looks, tests).
    sizes: {option: value} applied to BOTH settings (--hidden, --embed, --batch-size,
        --bptt, --eval-every, --log-every, --device): tiny runs for tests; a real
        benchmark passes none of them.
    """

    corpora: Path | None = None
    only: str | None = None
    out: Path | None = None
    minutes: float = DEFAULT_MINUTES
    seeds: tuple[int, ...] = DEFAULT_SEEDS
    max_steps: int | None = None
    mirror: Path | None = None  # catalog corpora (tiny Shakespeare when not fetched)
    sizes: dict | None = None
    spec: Path | None = None  # another benchmark.json (tests)
    record: Path | None = None  # --record DIR: finished runs kept (and restored) there too
    report: bool = False  # --report: the tables from the finished runs only, nothing trained

    def __post_init__(self):
        if self.minutes <= 0:
            raise UsageError(f"--minutes must be > 0, got {self.minutes:g}")
        if self.max_steps is not None and self.max_steps < 1:
            raise UsageError(f"--max-steps must be >= 1, got {self.max_steps}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise UsageError(f"--seeds must name distinct seeds, e.g. 1,2; got "
                             f"{','.join(map(str, self.seeds))}")
        unknown = set(self.sizes or {}) - set(SIZE_OPTIONS)
        if unknown:
            raise UsageError(f"--{sorted(unknown)[0].replace('_', '-')} does not apply to "
                             f"{NAME}: its two settings are fixed")

    def corpora_dir(self) -> Path:
        return Path(self.corpora or os.environ.get(benchmark.ENV_BENCH) or Path("runs") / "corpora")

    def budget(self) -> dict:
        """{"max_steps": N} or {"time_budget": seconds}, the same for every run."""
        if self.max_steps is not None:
            return {"max_steps": self.max_steps}
        return {"time_budget": self.minutes * 60.0}


def parse_seeds(text: str) -> tuple[int, ...]:
    """'1,2' -> (1, 2) (a UsageError naming --seeds otherwise)."""
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise UsageError(f"--seeds {text}: write integers separated by commas, e.g. 1,2") from None


# ------------------------------------------------------------------ the two settings


def zlm_defaults(data: Dataset, options: Options, rule_dir: Path | None = None) -> RunSpec:
    """What `zlm train DATA_DIR` plans with only `options` given (--time-budget, --seed):
    `zlm.training.plan.plan` itself. rule_dir: a run whose stored spec to take instead of
    deciding again (a resumed run, or the baseline next to the defaults run of its seed)."""
    if rule_dir is not None and (rule_dir / "config.json").is_file():
        return read_spec(rule_dir)
    return plan(data.path, options, out=rule_dir, resume=True).spec


def baseline(defaults_cfgs: tuple[ModelConfig, TrainConfig]) -> tuple[ModelConfig, TrainConfig]:
    """The plain-LSTM baseline next to resolved defaults: BASELINE_* fixed, the budget,
    seed, precision, device and validation schedule taken from the defaults.

    The schedule is the same in tokens: the defaults validate every `eval_every` windows
    of their batch x bptt, the baseline every as many tokens of its own windows (rounded to
    tens of steps), so both are scored equally often along the text."""
    model, train_cfg = defaults_cfgs
    shared = {k: getattr(train_cfg, k) for k in (*SHARED_TRAIN, "seed", "max_steps", "time_budget")}
    per_step = train_cfg.batch_size * train_cfg.bptt
    base_per_step = BASELINE_TRAIN["batch_size"] * BASELINE_TRAIN["bptt"]
    if per_step != base_per_step and shared["eval_every"] > 0:
        shared["eval_every"] = max(10, round(shared["eval_every"] * per_step / base_per_step / 10) * 10)
    return (ModelConfig(vocab_size=model.vocab_size, **BASELINE_MODEL),
            TrainConfig(**BASELINE_TRAIN, **shared))


def run_plan(setting: str, data: Dataset, seed: int, config: BenchmarkConfig, out: Path,
             resume: bool = False, reporter: Reporter | None = None, extra: Options = Options()) -> Plan:
    """The plan of one run into OUT/<corpus>/<setting>-seed<N>; config.sizes (tests) replace
    values in both settings. Any setting but "baseline" is the defaults rule's plan with
    `extra` given (other recipes' variants of the defaults). The baseline takes the budget,
    seed and validation schedule of the defaults run of its seed (its stored spec, or
    planned now)."""
    run_dir = out / f"{setting}-seed{seed}"
    options = Options(**config.budget(), seed=seed) | Options(**(config.sizes or {}))
    if setting != "baseline":
        return plan(data.path, options | extra, out=run_dir, resume=resume, reporter=reporter)
    spec = zlm_defaults(data, options, out / f"defaults-seed{seed}")
    planned = plan(data.path, _baseline_options(spec, data, config), out=run_dir, preset=BASELINE,
                   resume=resume, reporter=reporter)
    if spec.rule is not None and planned.resume_from is None:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.write_json(run_dir / BASELINE_RULE, spec.rule.to_dict())
    return planned


def _baseline_options(defaults_spec: RunSpec, data: Dataset, config: BenchmarkConfig) -> Options:
    model, train_cfg = baseline((defaults_spec.model, defaults_spec.train))
    model, train_cfg = Options(**(config.sizes or {})).apply(model, train_cfg, data.vocab_size)
    return Options.of(model, train_cfg)


def planned_now(setting: str, data: Dataset, seed: int, config: BenchmarkConfig, out: Path,
                stored: Path, extra: Options = Options()) -> RunSpec | None:
    """What `run_plan` plans now for the run whose spec is in `stored` (its run dir or
    record), without probing (`plan.replay`): a defaults-rule run decided again at the
    speed it measured; the baseline from its defaults run replayed at that run's speed (its
    BASELINE_RULE, else OUT/<corpus>/defaults-seed<N>). None when that cannot be told."""
    spec = read_spec(stored)
    options = Options(**config.budget(), seed=seed) | Options(**(config.sizes or {}))
    if setting != "baseline":
        return replay(spec, data, options | extra)
    if (stored / BASELINE_RULE).is_file():
        rule = DefaultsRule.from_dict(json.loads((stored / BASELINE_RULE).read_text(encoding="utf-8")))
    elif (out / f"defaults-seed{seed}" / "config.json").is_file():
        rule = read_spec(out / f"defaults-seed{seed}").rule
    else:
        return None
    if rule is None:
        return None
    defaults_spec = replay(replace(spec, rule=rule), data, options)
    if defaults_spec is None:
        return None
    return replay(spec, data, _baseline_options(defaults_spec, data, config), preset=BASELINE)


def changed(stored: RunSpec, now: RunSpec) -> str:
    """The model and training settings where `stored` differs from `now` ("" when none):
    "eval_every 3690 -> 1260, ..."."""
    parts = []
    for mine, theirs in ((stored.model.to_dict(), now.model.to_dict()), (stored.train.to_dict(), now.train.to_dict())):
        parts += [f"{k} {mine.get(k)} -> {theirs.get(k)}" for k in sorted(set(mine) | set(theirs))
                  if mine.get(k) != theirs.get(k)]
    return ", ".join(parts)


def stale(setting: str, data: Dataset, seed: int, config: BenchmarkConfig, out: Path, stored: Path,
          extra: Options = Options()) -> str:
    """Why the run in `stored` is not what `run_plan` plans now ("" when it is, or when
    that cannot be told): the defaults rule, the baseline or a preset changed since."""
    now = planned_now(setting, data, seed, config, out, stored, extra)
    if now is None:
        return ""
    spec = read_spec(stored)
    if spec.train.on_overfit != now.train.on_overfit and guard_idle(stored):
        spec = replace(spec, train=replace(spec.train, on_overfit=now.train.on_overfit))
    return changed(spec, now)


def guard_idle(stored: Path) -> bool:
    """Whether the overfitting guard (`--on-overfit cool-down`) never reacts on the run in
    `stored` (its run dir or record): then the run trains the same with the guard on or off,
    so a run recorded without it stands for one with it, and the other way round. It reacts
    at a validation the run continues after (the last one ends the run either way)."""
    evals = validations(stored)
    if evals is None:
        return False
    return _first_reaction(evals[:-1]) is None


def guard_moved(stored: Path) -> str:
    """Where the overfitting guard as it is now parts from the guard a run trained with
    (`--on-overfit cool-down`), replayed over the run's validations up to its reaction ("" when
    they agree, or the run had no guard or has no log): "the guard now reacts at step 570;
    this run's reacted at 1140". `stale` compares plans, not the guard's test, so a run
    trained under an earlier version of that test is told by this."""
    config = json.loads((stored / "config.json").read_text(encoding="utf-8"))
    events = _events(stored)
    if config.get("train", {}).get("on_overfit") != "cool-down" or events is None:
        return ""
    reacted = next((e["step"] for e in events if e.get("event") == "overfit"), None)
    evals = _evals(events)
    # the last validation ends the run either way; a reaction's own validation is the last it saw
    now = _first_reaction(evals[:-1] if reacted is None else [e for e in evals if e["step"] <= reacted])
    if now == reacted:
        return ""
    if reacted is None:
        return f"the guard now reacts at step {now}; this run's never did"
    if now is None:
        return f"the guard now does not react by step {reacted}, where this run's did"
    return f"the guard now reacts at step {now}; this run's reacted at {reacted}"


def _first_reaction(evals: list[dict]) -> int | None:
    """The step of the first of these eval events at which today's guard reacts (None: never)."""
    k = first_overfit([(e["valid_bpc"], e.get("train_slice_bpc")) for e in evals])
    return None if k is None else evals[k]["step"]


def validations(stored: Path) -> list[dict] | None:
    """The eval events of the run in `stored` (run dir or record), one per step (a resumed
    run's repeat replaces the first), in step order; None when it has no log."""
    events = _events(stored)
    return None if events is None else _evals(events)


def _events(stored: Path) -> list[dict] | None:
    """Every event of the run in `stored` (its metrics.jsonl, or a record's gzipped log)."""
    if (stored / "metrics.jsonl").is_file():
        return read_metrics(stored / "metrics.jsonl")
    if (stored / RECORD_LOG).is_file():
        return parse_metrics(gzip.decompress((stored / RECORD_LOG).read_bytes()).decode("utf-8"))
    return None


def _evals(events: list[dict]) -> list[dict]:
    evals = {e["step"]: e for e in events if e.get("event") == "eval"}
    return [evals[k] for k in sorted(evals)]


# ------------------------------------------------------------------ running


def prepare_corpus(corpus: benchmark.BenchCorpus, config: BenchmarkConfig, out: Path,
                   rep: Reporter) -> Dataset:
    """OUT/<corpus>/data, prepared once: char, 90/5/5 contiguous, whole-corpus vocabulary."""
    data_dir = out / corpus.name / "data"
    if (data_dir / "dataset.json").is_file():
        return Dataset.open(data_dir)
    from zlm.data.prepare import PrepareConfig, prepare

    source = benchmark.corpus_source(corpus, config.corpora_dir())
    rep.message(f"preparing {corpus.name} ({source}) into {data_dir} (char, 90/5/5, "
                "vocabulary from the whole text)")
    return prepare(source, data_dir, PrepareConfig(tokenizer="char", split=(0.9, 0.05, 0.05),
                                                   unknown="include", mirror=config.mirror))


def train_once(setting: str, data: Dataset, seed: int, config: BenchmarkConfig, out: Path,
               make_reporter: ReporterFactory, extra: Options = Options()) -> tuple[Plan, dict] | None:
    """Train one run (`run_plan`), resume it from its latest checkpoint, or keep it when
    finished (or restore it from config.record); then its scores (`score_run`), recorded.
    None with config.report when the run is not finished (nothing is trained)."""
    run_dir = out / f"{setting}-seed{seed}"
    record = None if config.record is None else Path(config.record) / out.name / run_dir.name
    def say(text: str) -> None:
        make_reporter().message(text)

    recorded = record is not None and (record / RECORD_LOG).is_file()
    if recorded:
        _check_budget(record, config)
    if (run_dir / "config.json").is_file():
        why = stale(setting, data, seed, config, out, run_dir, extra)
        if why and config.report:
            say(f"{run_dir} was planned otherwise than now ({why}): left out of the tables")
            return None
        if why:
            aside = run_dir.with_name(run_dir.name + ".stale")
            shutil.rmtree(aside, ignore_errors=True)
            run_dir.rename(aside)
            say(f"{run_dir} was planned otherwise than now ({why}): moved to {aside.name}, training it again")
    # renew: why the record holds a run planned otherwise than now ("" if it does not); such
    # a record is not restored, and is replaced once the run is trained again
    renew = recorded and stale(setting, data, seed, config, out, record, extra)
    if renew and not _finished(run_dir):
        say(f"{record} was planned otherwise than now ({renew}): " + (
            "left out of the tables" if config.report else "training it again; the record is replaced when it finishes"))
    elif recorded:
        restore_record(record, run_dir, config)
    resume = run_dir.is_dir() and any(run_dir.iterdir())
    if resume and (run_dir / "metrics.jsonl").is_file() and read_run(run_dir).finished:
        planned = Plan(run_dir, read_spec(run_dir))
    elif config.report:
        return None
    else:
        rep = make_reporter()
        planned = run_plan(setting, data, seed, config, out, resume, rep, extra)
        if run(planned, rep).interrupted:
            raise ZlmError(f"interrupted during {run_dir} (checkpoint saved); run the same zlm "
                           "recipe command again to continue")
    moved = guard_moved(planned.run_dir)
    if moved:
        say(f"{planned.run_dir} was trained under an earlier overfitting guard ({moved}): it stands as trained")
    row = score_run(planned.run_dir, setting, planned.spec.train.device)
    if record is not None and (renew or not recorded):
        save_record(run_dir, record)
    return planned, row


def _finished(run_dir: Path) -> bool:
    return (run_dir / "results.json").is_file() and (run_dir / "metrics.jsonl").is_file() \
        and read_run(run_dir).finished


def _budget_of(run_dir: Path) -> dict:
    train = read_spec(run_dir).train
    if train.max_steps is not None:
        return {"max_steps": train.max_steps}
    return {"time_budget": train.time_budget}


def _check_budget(record: Path, config: BenchmarkConfig) -> None:
    if _budget_of(record) != config.budget():
        raise UsageError(f"{record} was recorded with {_budget_of(record)}, this run has "
                         f"{config.budget()}: pass the same budget or another --record")


def restore_record(record: Path, run_dir: Path, config: BenchmarkConfig) -> None:
    """Put a recorded finished run in place of run_dir unless run_dir holds a finished run
    (an unfinished one's checkpoints are superseded); a record of another budget is refused
    (one line, naming the fix)."""
    if not (record / RECORD_LOG).is_file() or _finished(run_dir):
        return
    _check_budget(record, config)
    with building(run_dir) as tmp:
        _copy(record, tmp, RECORD_FILES)
        (tmp / "metrics.jsonl").write_bytes(gzip.decompress((record / RECORD_LOG).read_bytes()))


def save_record(run_dir: Path, record: Path) -> None:
    """Write a finished run's RECORD_FILES and RECORD_LOG as record (the directory replaced
    only once whole)."""
    with open(run_dir / "metrics.jsonl", "rb") as f:
        lines = [(line, json.loads(line).get("event")) for line in f if line.strip()]
    train = [i for i, (_, event) in enumerate(lines) if event == "train"]
    every = -(-len(train) // RECORD_TRAIN_POINTS) if train else 1
    drop = set(train) - set(train[::-1][::every])
    kept = b"".join(line for i, (line, event) in enumerate(lines) if event != "step" and i not in drop)
    with building(record) as tmp:
        _copy(run_dir, tmp, RECORD_FILES)
        (tmp / RECORD_LOG).write_bytes(gzip.compress(kept, mtime=0))


def _copy(src: Path, dst: Path, names: tuple[str, ...]) -> None:
    for name in names:
        if (src / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / name, dst / name)


def corpus_info(corpus: benchmark.BenchCorpus, data: Dataset) -> dict:
    """What the table says about a corpus: kind, source, size, vocabulary, pin check."""
    splits, sha = data.meta.get("splits", {}), (data.meta.get("source") or {}).get("sha256")
    src, pinned = corpus.source, (corpus.text or {}).get("sha256")
    return {"name": corpus.name, "kind": corpus.kind, "license": corpus.license,
            "source": f"{src['package']} {src['version']}" if src["type"] == "deb"
            else src.get("name") or src.get("path"),
            "characters": sum(s.get("characters", 0) for s in splits.values()),
            "bytes": sum(s.get("bytes", 0) for s in splits.values()),
            "vocabulary": data.vocab_size, "text_sha256": sha,
            "pinned": None if pinned is None else sha == pinned}


def corpora_benchmark(config: BenchmarkConfig = BenchmarkConfig(),
                      make_reporter: ReporterFactory = Reporter) -> RecipeResult:
    """Every selected corpus x setting x seed: prepare, train, score; then the tables."""
    out = Path(config.out or Path("runs") / NAME)
    rep = make_reporter()
    corpora = benchmark.select(benchmark.load_benchmark(config.spec), config.only)
    runs = [(c, s, seed) for c in corpora for s in SETTINGS for seed in config.seeds]
    rows, infos, done, missing = [], [], set(), []
    for i, (corpus, setting, seed) in enumerate(runs):
        data = prepare_corpus(corpus, config, out, rep)
        if corpus.name not in done:
            infos.append(corpus_info(corpus, data))
            done.add(corpus.name)
        if not config.report:
            rep.message(f"[{i + 1}/{len(runs)}] {corpus.name}, {setting}, seed {seed}: "
                        f"{out / corpus.name / f'{setting}-seed{seed}'}")
        got = train_once(setting, data, seed, config, out / corpus.name, make_reporter)
        if got is None:
            missing.append(f"{corpus.name}/{setting}-seed{seed}")
            continue
        rows.append({**got[1], "corpus": corpus.name, "seed": seed})
    return _finish(out, config, infos, rows, rep, missing)


# ------------------------------------------------------------------ results


def summarize(rows: list[dict], settings: tuple[str, str] = SETTINGS, seeds: int | None = None) -> list[dict]:
    """Per corpus: the mean over seeds of each of the two settings' valid and test BPC, how
    many runs each mean is of ("<setting>_runs"), the differences (first - second: defaults
    - baseline) and whether the first wins by WIN_MARGIN on both ("<first>_win"; None, not
    decided yet, while a setting has fewer than `seeds` runs)."""
    first, second = settings
    out = []
    for corpus in dict.fromkeys(r["corpus"] for r in rows):
        entry = {"corpus": corpus}
        for setting in settings:
            mine = [r for r in rows if r["corpus"] == corpus and r["setting"] == setting]
            for split in ("valid", "test"):
                vals = [r[f"{split}_bpc"] for r in mine if r.get(f"{split}_bpc") is not None]
                entry[f"{setting}_{split}"] = statistics.fmean(vals) if vals else None
            entry[f"{setting}_characters"] = statistics.fmean(r["characters"] for r in mine) if mine else None
            entry[f"{setting}_runs"] = len(mine)
        for split in ("valid", "test"):
            a, b = entry[f"{first}_{split}"], entry[f"{second}_{split}"]
            entry[f"delta_{split}"] = None if a is None or b is None else a - b
        entry[f"{first}_win"] = all(entry[f"delta_{s}"] is not None and entry[f"delta_{s}"] <= -WIN_MARGIN
                                    for s in ("valid", "test"))
        if seeds is not None and min(entry[f"{s}_runs"] for s in settings) < seeds:
            entry[f"{first}_win"] = None
        out.append(entry)
    return out


def win_cell(entry: dict, first: str, seeds: int) -> str:
    """The table's verdict: yes | no | "pending (N of M runs)" while runs are missing."""
    win = entry[f"{first}_win"]
    if win is None:
        done = sum(v for k, v in entry.items() if k.endswith("_runs"))
        return f"pending ({done} of {2 * seeds} runs)"
    return "yes" if win else "no"


def report_lines(missing: list[str]) -> list[str]:
    """What a --report says is left: the runs not finished yet."""
    if not missing:
        return ["Every run is finished.", ""]
    return ["Not finished yet (the same command without --report trains them): " + ", ".join(missing) + ".", ""]


def stream_start(protocol: str | None) -> str:
    """How a run's evaluation streams started, read from its recorded protocol line."""
    if re.search(r"from the [\d,]+ tokens before it", protocol or ""):  # as many as fit its stretch
        return "each stream after the first read the tokens before it as context"
    if re.match(r"1 parallel streams", protocol or ""):
        return "one stream"
    return "every stream started from a zero state (scored before --stream-context)"


def protocol_lines(rows: list[dict]) -> list[str]:
    """How the runs' valid and test BPC were scored: one line, or a warning naming which
    runs were scored how when the records mix protocols (their BPC do not compare)."""
    starts: dict[str, list[str]] = {}
    for r in rows:
        run = f"{r['corpus']}/{r['setting']}-seed{r['seed']}"
        how = starts.setdefault(stream_start(r.get("protocol")), [])
        if run not in how:  # a held-out run that is also a grid run
            how.append(run)
    if len(starts) <= 1:
        return [f"Evaluation streams: {next(iter(starts))}.", ""] if starts else []
    return ["**The runs were scored under different protocols**, so their BPC do not all compare "
            "(`zlm eval RUN --split S` scores a run again): "
            + "; ".join(f"{how}: {', '.join(runs)}" for how, runs in starts.items()) + ".", ""]


def fmt(v, digits: int = 3, signed: bool = False) -> str:
    """A number of the tables: `digits` decimals (a sign with `signed`), "-" for None."""
    if v is None:
        return "-"
    return f"{v:+.{digits}f}" if signed else f"{v:.{digits}f}"


def _setting_line(rows: list[dict], setting: str) -> str:
    r = next((r for r in rows if r["setting"] == setting), None)
    if r is None:
        return f"- {setting}: no run"
    m, t = r["model"], r["train"] or {}
    sched = (t.get("schedule") or {}).get("kind", "?")
    return (f"- {setting}: {m.get('layers')}x{m.get('hidden')}, embed {m.get('embed')}, z_c "
            f"{m.get('zoneout_cell'):g}, z_h {m.get('zoneout_hidden'):g}, {t.get('optimizer')} "
            f"{t.get('lr'):g} {sched}, clip {t.get('clip'):g}, batch {t.get('batch_size')} x bptt "
            f"{t.get('bptt')}, state {t.get('state')}, reset_prob {t.get('reset_prob'):g}, "
            f"precision {t.get('precision')}, eval every {t.get('eval_every')} steps")


def benchmark_markdown(config: BenchmarkConfig, infos: list[dict], rows: list[dict],
                       summary: list[dict], missing: list[str] = ()) -> str:
    budget = (f"{config.max_steps:,} steps" if config.max_steps is not None
              else f"{config.minutes:g} minutes")
    lines = [f"Corpora benchmark: zlm's defaults vs the plain-LSTM baseline, {budget} of "
             f"training per run, seeds {', '.join(map(str, config.seeds))}, on {os.cpu_count()} "
             "CPU cores.", "", *(report_lines(list(missing)) if config.report else []),
             *protocol_lines(rows),
             "| corpus | kind | source | characters | vocabulary | text = pinned |",
             "|---|---|---|---|---|---|"]
    for c in infos:
        pin = {True: "yes", False: "NO", None: "-"}[c["pinned"]]
        lines.append(f"| {c['name']} | {c['kind']} | {c['source']} | {c['characters']:,} | "
                     f"{c['vocabulary']} | {pin} |")
    lines += ["", f"Mean of the seeds (Δ = defaults - baseline; the defaults win when Δ <= "
              f"-{WIN_MARGIN:g} on valid and test):", "",
              "| corpus | defaults valid | baseline valid | Δ valid | defaults test | "
              "baseline test | Δ test | defaults win |", "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['corpus']} | {fmt(s['defaults_valid'])} | {fmt(s['baseline_valid'])} | "
                     f"{fmt(s['delta_valid'], signed=True)} | {fmt(s['defaults_test'])} | "
                     f"{fmt(s['baseline_test'])} | {fmt(s['delta_test'], signed=True)} | "
                     f"{win_cell(s, 'defaults', len(config.seeds))} |")
    lines += ["", "Every run:", "",
              "| corpus | setting | seed | valid BPC | test BPC | characters seen | steps | "
              "best step | training minutes |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        minutes = None if r.get("elapsed_s") is None else r["elapsed_s"] / 60
        lines.append(f"| {r['corpus']} | {r['setting']} | {r['seed']} | {fmt(r['valid_bpc'])} | "
                     f"{fmt(r['test_bpc'])} | {r['characters']:,.0f} | {r['steps']:,} | "
                     f"{r.get('best_step', '-')} | {fmt(minutes, 1)} |")
    lines += ["", "Settings (as resolved for the first corpus):",
              _setting_line(rows, "defaults"), _setting_line(rows, "baseline"), "",
              "BPC: the best checkpoint (by validation) on the full split, state carried "
              "(`zlm eval` protocol, fp32). Splits 90/5/5 contiguous; vocabulary over the "
              "whole corpus.", ""]
    return "\n".join(lines)


def _finish(out: Path, config: BenchmarkConfig, infos: list[dict], rows: list[dict],
            rep: Reporter, missing: list[str] = ()) -> RecipeResult:
    """OUT/results.json, OUT/results.md and OUT/<corpus>/curves.png (skipped, with a note,
    without matplotlib)."""
    from zlm.tools.plot import plot_runs

    files = [out / "results.json", out / "results.md"]
    for info in infos:
        mine = [r["run"] for r in rows if r["corpus"] == info["name"]]
        target = out / info["name"] / "curves.png"
        try:
            plot_runs(read_runs(mine), target, title=f"{info['name']}: train (dashed) and "
                      "valid (solid) BPC, defaults vs baseline")
            files.append(target)
        except ZlmError as e:
            rep.message(f"{target} not written: {e}")
    summary = summarize(rows, seeds=len(config.seeds))
    md = benchmark_markdown(config, infos, rows, summary, missing)
    ckpt.write_json(out / "results.json", {
        "recipe": NAME, "budget": config.budget(), "seeds": list(config.seeds),
        "sizes": config.sizes or {}, "corpora": infos, "summary": summary, "missing": list(missing),
        "runs": rows})
    (out / "results.md").write_text(md, encoding="utf-8")
    return RecipeResult(NAME, out, rows, md, files)

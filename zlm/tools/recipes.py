"""Recipes: whole experiments as library functions (`zlm recipe NAME`).

Owns `zoneout_ablation(config)` and `equal_budget(config)`. Each prepares its corpus
once into OUT/data (char tokenizer, 90/5/5 contiguous split), trains into OUT/<run>,
scores the best checkpoint of every run on the full valid and test splits with the
function `zlm eval` uses (state carried, `EvalConfig()` defaults), and writes
RUN_DIR/results.json per run, OUT/results.json, OUT/results.md and OUT/curves.png.

A recipe can be re-run with the same command after any interruption: finished runs
(a "finish" event and results.json) are kept, an unfinished one resumes from its latest
checkpoint, and the ablation's step budget (measured on its first run) is kept in
OUT/plan.json so that every run sees the same number of characters.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from zlm.core import checkpoint as ckpt
from zlm.core.checkpoint import read_json_or_none
from zlm.core.config import Options
from zlm.core.reporter import Reporter
from zlm.data.dataset import Dataset
from zlm.errors import UsageError, ZlmError
from zlm.tools.curves import read_run, read_runs
from zlm.training.plan import plan
from zlm.training.presets import DEFAULT_PRESET
from zlm.training.runner import run

# (run directory, setting, z_c, z_h): the paper's (Krueger et al. 2016) ablation.
ABLATION = (
    ("no-zoneout", "no zoneout", 0.0, 0.0),
    ("zh-0.05", "z_h only (0.05)", 0.0, 0.05),
    ("zc-0.5", "z_c only (0.5)", 0.5, 0.0),
    ("zc-0.5-zh-0.05", "z_c 0.5 + z_h 0.05 (paper)", 0.5, 0.05),
)

# Published 10-minute CPU baselines on tiny Shakespeare, same 90/5/5 split (quoted, not measured here).
BASELINES = (
    ("torch.nn.LSTM 1x512 char model (Adam 2e-3, batch 32, bptt 100, no zoneout)", 2.09, 2.30),
    ('nanoGPT CPU "baby GPT"', 2.18, 2.37),
)


@dataclass(frozen=True)
class RecipeConfig:
    """Options shared by the recipes (None: the recipe's own default)."""

    corpus: str = "tinyshakespeare"  # a text file or a catalog corpus name
    out: Path | None = None  # default runs/<recipe name>
    mirror: Path | None = None  # local copy of catalog corpora (else $ZLM_CORPORA, cache)
    minutes: float | None = None  # training time per run (ablation: of the first run)
    max_steps: int | None = None  # a fixed step budget per run instead of --minutes
    hidden: int | None = None
    layers: int | None = None
    embed: int | None = None
    batch_size: int | None = None
    bptt: int | None = None
    lr: float | None = None
    eval_every: int | None = None
    log_every: int | None = None
    seed: int | None = None
    device: str | None = None

    def __post_init__(self):
        if self.minutes is not None and self.minutes <= 0:
            raise UsageError(f"--minutes must be > 0, got {self.minutes:g}")
        if self.max_steps is not None and self.max_steps < 1:
            raise UsageError(f"--max-steps must be >= 1, got {self.max_steps}")

    def overrides(self) -> dict:
        """The explicit model/training options (`zlm.core.config.Options` fields)."""
        keys = ("hidden", "layers", "embed", "batch_size", "bptt", "lr", "eval_every",
                "log_every", "seed", "device")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


# The ablation's model: the published 1x512 baseline's size, Adam 3e-3 (cpu-small's). On 2
# CPU cores 11 minutes is about 14 epochs of tiny Shakespeare (docs/results.md), past
# where a plain 1x512 LSTM's valid BPC bottoms out; results.md says whether it did.
ABLATION_DEFAULTS = dict(hidden=512, layers=1, embed=128, batch_size=32, bptt=100, lr=3e-3,
                         eval_every=200, log_every=10, seed=1234, device="cpu", reset_prob=0.0)
# Equal budget: cpu-small with the learning rate decayed (cosine) over the time budget
# (what it measured, against constant rates and no state resets: docs/results.md).
EQUAL_BUDGET_OVERRIDES = dict(lr=4e-3, schedule="cosine", eval_every=200, device="cpu")
ABLATION_MINUTES = 11.0  # x 4 runs (the zoneout ones ~10-20% slower per step): < 60 min
EQUAL_BUDGET_MINUTES = 10.0


@dataclass(frozen=True)
class RecipeResult:
    """What a recipe produced: one row per run, and the files it wrote."""

    name: str
    out: Path
    rows: list[dict]
    markdown: str
    files: list[Path]

    def to_dict(self) -> dict:
        return {"recipe": self.name, "out": str(self.out), "runs": self.rows,
                "files": [str(p) for p in self.files]}


ReporterFactory = Callable[[], Reporter]


def prepare_once(config: RecipeConfig, out: Path, rep: Reporter) -> Dataset:
    """OUT/data: the corpus prepared once (char, 90/5/5 contiguous); reused on re-runs."""
    data_dir = out / "data"
    if (data_dir / "dataset.json").is_file():
        rep.message(f"using the data already prepared in {data_dir}")
        return Dataset.open(data_dir)
    from zlm.data import catalog
    from zlm.data.prepare import PrepareConfig, prepare

    if not Path(config.corpus).exists() and config.corpus not in catalog.names():
        raise UsageError(f"--corpus {config.corpus}: no such file or corpus name; pass a text "
                         "file, e.g. --corpus input.txt")
    rep.message(f"preparing {config.corpus} into {data_dir} (char tokenizer, 90/5/5 split)")
    return prepare(config.corpus, data_dir, PrepareConfig(
        tokenizer="char", split=(0.9, 0.05, 0.05), mirror=config.mirror))


def train_run(run_dir: Path, data: Dataset, overrides: dict, preset: str | None,
              make_reporter: ReporterFactory) -> None:
    """Train (or resume, or skip when finished) one run of a recipe."""
    if (run_dir / "metrics.jsonl").is_file() and read_run(run_dir).finished:
        return
    resume = run_dir.is_dir() and any(p.name != "data" for p in run_dir.iterdir())
    rep = make_reporter()
    planned = plan(data.path, Options(**overrides), out=run_dir, preset=preset or DEFAULT_PRESET,
                   resume=resume, reporter=rep)
    if run(planned, rep).interrupted:
        raise ZlmError(f"interrupted during {run_dir.name} (checkpoint saved); run the same "
                       "zlm recipe command again to continue")


def score_run(run_dir: Path, setting: str, device: str) -> dict:
    """Valid and test BPC of the run's best checkpoint -> RUN_DIR/results.json (kept)."""
    from zlm.inference.evaluate import EvalConfig, evaluate

    results = read_json_or_none(run_dir / "results.json")
    if results is None:
        valid = evaluate(run_dir, EvalConfig(split="valid", device=device))
        test = evaluate(run_dir, EvalConfig(split="test", device=device))
        best = read_json_or_none(run_dir / "best" / "trainer.json") or {}
        results = {"setting": setting, "checkpoint": valid.checkpoint, "best_step": best.get("step"),
                   "valid_bpc": valid.score.bpc, "test_bpc": test.score.bpc,
                   "protocol": valid.protocol, "valid": valid.to_dict(), "test": test.to_dict()}
    curves = read_run(run_dir)
    results.update({
        "setting": setting, "run": str(run_dir), "model": curves.model, "train": curves.train_config,
        "steps": curves.steps, "characters": curves.steps * curves.chars_per_step,
        "elapsed_s": curves.elapsed_s, "parameters": curves.parameters,
        "train_bpc_end": curves.final_train_bpc,
        "valid_bpc_end": curves.valid.bpc[-1] if len(curves.valid) else None,
        "gap": None if curves.final_train_bpc is None else results["valid_bpc"] - curves.final_train_bpc,
    })
    ckpt.write_json(run_dir / "results.json", results)
    return results


def _finish(name: str, out: Path, rows: list[dict], markdown: str, extra: dict,
            rep: Reporter) -> RecipeResult:
    """OUT/results.json, OUT/results.md and OUT/curves.png (skipped, with a note, without
    matplotlib: the numbers are the expensive part)."""
    from zlm.tools.plot import plot_runs

    files = [out / "results.json", out / "results.md"]
    try:
        plot_runs(read_runs([r["run"] for r in rows]), out / "curves.png",
                  title=f"zlm recipe {name}: train (dashed) and valid (solid) BPC")
        files.append(out / "curves.png")
    except ZlmError as e:
        rep.message(f"curves.png not written: {e}")
    ckpt.write_json(out / "results.json", {"recipe": name, **extra, "runs": rows})
    (out / "results.md").write_text(markdown, encoding="utf-8")
    return RecipeResult(name, out, rows, markdown, files)


def _fmt(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _count(chars) -> str:
    if chars is None:
        return "-"
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if chars >= div:
            return f"{chars / div:.3g}{unit}"
    return f"{chars:.0f}"


# ------------------------------------------------------------------ zoneout ablation


def zoneout_ablation(config: RecipeConfig = RecipeConfig(),
                     make_reporter: ReporterFactory = Reporter) -> RecipeResult:
    """The same LSTM trained four times (no zoneout, z_h only, z_c only, both) for the
    same number of characters: the first run gets --minutes (or --max-steps), and the
    steps it made become --max-steps of the other three."""
    name = "zoneout-ablation"
    out = Path(config.out or Path("runs") / name)
    rep = make_reporter()
    data = prepare_once(config, out, rep)
    base = {**ABLATION_DEFAULTS, **config.overrides(), "dropout": 0.0}
    plan_path = out / "plan.json"
    plan = read_json_or_none(plan_path) or {}
    minutes = config.minutes if config.minutes is not None else ABLATION_MINUTES
    if config.max_steps is not None:
        plan = {"max_steps": config.max_steps, "how": "--max-steps"}
        out.mkdir(parents=True, exist_ok=True)
        ckpt.write_json(plan_path, plan)
    rows = []
    for i, (run_name, setting, zc, zh) in enumerate(ABLATION):
        run_dir = out / run_name
        budget = {"max_steps": plan["max_steps"]} if plan.get("max_steps") else \
            {"time_budget": minutes * 60.0}
        rep.message(f"[{i + 1}/{len(ABLATION)}] {setting}: {run_dir} "
                    + (f"({budget['max_steps']:,} steps)" if "max_steps" in budget
                       else f"({minutes:g} minutes; its steps set the others' budget)"))
        overrides = {**base, "zoneout_cell": zc, "zoneout_hidden": zh, **budget}
        train_run(run_dir, data, overrides, None, make_reporter)
        if not plan.get("max_steps"):
            plan = {"max_steps": read_run(run_dir).steps,
                    "how": f"steps made by {run_name} in {minutes:g} minutes"}
            ckpt.write_json(plan_path, plan)
        rows.append(score_run(run_dir, setting, base["device"]))
    md = ablation_markdown(rows, plan, base, data)
    return _finish(name, out, rows, md, {"plan": plan, "config": base, "data": str(data.path)}, rep)


def ablation_markdown(rows: list[dict], plan: dict, base: dict, data: Dataset) -> str:
    n = rows[0]["characters"] if rows else None
    lines = [
        f"Zoneout ablation: 1 run per setting, {base['layers']}x{base['hidden']} LSTM, embed "
        f"{base['embed']}, Adam {base['lr']:g}, batch {base['batch_size']} x bptt {base['bptt']}, "
        f"{plan.get('max_steps', 0):,} steps ({_count(n)} characters, {plan.get('how', '')}), "
        f"on {data.path} (90/5/5).", "",
        "| setting | best valid BPC | test BPC | train BPC at the end | train-valid gap "
        "| valid BPC at the end | best step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['setting']} | {_fmt(r['valid_bpc'])} | {_fmt(r['test_bpc'])} | "
                     f"{_fmt(r['train_bpc_end'])} | {_fmt(r['gap'])} | {_fmt(r['valid_bpc_end'])} "
                     f"| {r.get('best_step', '-')} |")
    lines += ["", "Valid and test BPC: the best checkpoint (by validation) on the full split, "
              "state carried (`zlm eval` protocol). Train BPC: training mode (zoneout masks "
              "drawn), averaged over the last logged steps; gap = valid - train.", ""]
    if rows:
        lines += [overfit_note(rows[0]), ""]
    return "\n".join(lines)


def overfit_note(row: dict) -> str:
    """Did the unregularized run overfit (valid BPC rising after its best)? The ablation
    only says something about regularization if it did."""
    best, end = row.get("valid_bpc"), row.get("valid_bpc_end")
    if best is None or end is None:
        return f"{row['setting']}: no validation recorded."
    if end - best > 0.01:
        return (f"{row['setting']} overfit: its valid BPC rose from {best:.3f} (step "
                f"{row.get('best_step')}) to {end:.3f} at the end.")
    return (f"{row['setting']} did not overfit within this budget (valid BPC {end:.3f} at the "
            f"end, best {best:.3f}): for a regularization comparison give it more --minutes.")


# ---------------------------------------------------------------------- equal budget


def equal_budget(config: RecipeConfig = RecipeConfig(),
                 make_reporter: ReporterFactory = Reporter) -> RecipeResult:
    """The cpu-small preset trained for --minutes (default 10) on tiny Shakespeare, scored
    next to the published 10-minute CPU baselines."""
    name = "equal-budget"
    out = Path(config.out or Path("runs") / name)
    rep = make_reporter()
    data = prepare_once(config, out, rep)
    minutes = config.minutes if config.minutes is not None else EQUAL_BUDGET_MINUTES
    budget = {"max_steps": config.max_steps} if config.max_steps is not None else \
        {"time_budget": minutes * 60.0}
    overrides = {**EQUAL_BUDGET_OVERRIDES, **config.overrides(), **budget}
    run_dir = out / "cpu-small"
    rep.message(f"cpu-small: {run_dir} ("
                + (f"{config.max_steps:,} steps)" if config.max_steps else f"{minutes:g} minutes)"))
    train_run(run_dir, data, overrides, "cpu-small", make_reporter)
    rows = [score_run(run_dir, "zlm cpu-small", overrides["device"])]
    md = equal_budget_markdown(rows[0], minutes if config.max_steps is None else None, data)
    extra = {"baselines": [{"model": m, "valid_bpc": v, "test_bpc": t} for m, v, t in BASELINES],
             "config": overrides, "data": str(data.path)}
    return _finish(name, out, rows, md, extra, rep)


def equal_budget_markdown(row: dict, minutes: float | None, data: Dataset) -> str:
    m = row["model"]
    budget = f"{minutes:g} minutes" if minutes is not None else f"{row['steps']:,} steps"
    t = row.get("train") or {}
    lr = f", Adam {t['lr']:g} {t['schedule']['kind']}" if "lr" in t else ""
    ours = (f"zlm cpu-small ({m.get('layers')}x{m.get('hidden')}, z_c {m.get('zoneout_cell'):g}, "
            f"z_h {m.get('zoneout_hidden'):g}{lr}; {budget}, {_count(row['characters'])} characters)")
    lines = [f"Equal budget: {budget} of training on {os.cpu_count()} CPU cores, "
             f"{data.path} (90/5/5); the baselines trained 10 minutes on 2 CPU cores, same "
             "split.", "",
             "| model | valid BPC | test BPC | source |", "|---|---|---|---|",
             f"| {ours} | {_fmt(row['valid_bpc'])} | {_fmt(row['test_bpc'])} | this run |"]
    for model, v, t in BASELINES:
        lines.append(f"| {model} | {v:.2f} | {t:.2f} | published, 10 minutes |")
    lines += ["", "zlm's numbers: the best checkpoint on the full split, state carried "
              "(`zlm eval` protocol).", ""]
    return "\n".join(lines)


def run_recipe(name: str, config: RecipeConfig, make_reporter: ReporterFactory = Reporter):
    """Dispatch by name: zoneout-ablation | equal-budget."""
    recipes = {"zoneout-ablation": zoneout_ablation, "equal-budget": equal_budget}
    if name not in recipes:
        raise UsageError(f"unknown recipe {name!r}; use {', '.join(recipes)}, corpora-benchmark or defaults-loco")
    return recipes[name](config, make_reporter)

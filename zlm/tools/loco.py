"""`zlm recipe defaults-loco`: the defaults rule's regularisation, chosen leave-one-corpus-out.

The rule (`zlm.training.defaults`) gives a run zoneout that grows with its expected passes
E over the text, linearly in log E: none up to ZONEOUT_FROM passes, z_c = ZONEOUT_CELL and
z_h = ZONEOUT_HIDDEN (half of it) from ZONEOUT_FULL passes on. Those three constants are
chosen by this procedure, and it reports how the rule does on corpora it was not fitted on:

1. Grid: every benchmark corpus is trained once (seed 1, the benchmark budget) at each z_c
   of GRID (z_h = z_c x HIDDEN_SHARE), everything else as the rule plans it; each run
   records the E the rule measured. One grid serves every fold.
2. Folds: for each corpus X, the `Constants` are the CANDIDATES that minimise the mean,
   over the *other* corpora, of their valid BPC at the z_c the constants give for their E
   (read off their grid row, linear between grid points) relative to the best of their
   row (`fit`). X's held-out z_c is those constants at X's E.
3. Held out: X is trained at its held-out z_c with every seed (the grid run is reused when
   that z_c is a grid point and the seed is 1) and scored on the full valid and test
   splits, next to the corpora benchmark's plain-LSTM baseline for the same seeds (its
   "baseline-seed<N>" runs: run both recipes with the same --out to share them).
4. The constants fitted on all corpora are the rule's (docs/defaults-rule.md says which
   run chose them).

Cost: corpora x (len(GRID) + seeds x 2, less the reused grid runs) runs of the budget;
with 9 corpora, 3 grid points, 2 seeds and 10 minutes 54 to 63 runs, 10 to 11 hours on 2 cores. Like the
other recipes it continues where it stopped: finished runs are kept, an unfinished one
resumes from its latest checkpoint, and with --record DIR the finished runs' records (no
weights) continue it on another machine. With --report it trains nothing and writes the
tables from the runs finished so far: the folds are fitted on the corpora whose grid row is
complete, a corpus without one has no held-out z_c yet, and a mean over fewer seeds than
asked is "pending". Writes OUT/loco.json and OUT/loco.md.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from zlm.core import checkpoint as ckpt
from zlm.core.config import Options
from zlm.core.reporter import Reporter
from zlm.data import benchmark_corpora as benchmark
from zlm.errors import ZlmError
from zlm.tools import benchmark as cb
from zlm.tools.recipes import RecipeResult, ReporterFactory
from zlm.training.defaults import zoneout_strength

NAME = "defaults-loco"
HELD_OUT = "heldout"  # the setting of a corpus's runs at the z_c chosen without it
GRID = (0.0, 0.1, 0.2)  # the z_c values every corpus is trained at
HIDDEN_SHARE = 0.5  # z_h = z_c x this, in the grid and in the rule
CANDIDATES = {"start": (1.0, 2.0, 4.0, 8.0), "full": (4.0, 8.0, 12.0, 16.0, 32.0), "cell": (0.1, 0.2)}


@dataclass(frozen=True)
class Constants:
    """The rule's zoneout constants: none up to `start` passes, z_c `cell` from `full` on."""

    start: float
    full: float
    cell: float

    def zoneout_cell(self, epochs: float) -> float:
        return round(self.cell * zoneout_strength(epochs, self.start, self.full), 4)


@dataclass(frozen=True)
class GridRow:
    """One corpus's grid: the expected passes E its runs had and valid BPC by z_c."""

    corpus: str
    epochs: float
    valid: dict[float, float]


def candidates() -> list[Constants]:
    """Every combination of CANDIDATES with start < full."""
    return [Constants(s, f, c) for s, f, c in itertools.product(*CANDIDATES.values()) if s < f]


def interpolate(valid: dict[float, float], z: float) -> float:
    """Valid BPC at z_c `z`: linear between the two grid points around it (the nearest end
    outside the grid)."""
    zs = sorted(valid)
    if z <= zs[0]:
        return valid[zs[0]]
    if z >= zs[-1]:
        return valid[zs[-1]]
    hi = next(i for i, g in enumerate(zs) if g >= z)
    a, b = zs[hi - 1], zs[hi]
    t = (z - a) / (b - a)
    return valid[a] + t * (valid[b] - valid[a])


def fit(rows: list[GridRow], exclude: str | None = None) -> tuple[Constants, float]:
    """The candidate with the lowest mean excess over `rows` but `exclude`, and that mean.

    A corpus's excess is its predicted valid BPC over the best of its grid row, less 1: a
    share, so every corpus weighs the same whatever its scale (a text of Chinese characters
    has about 4 times the bits per character of English; in plain BPC it would outweigh
    four English corpora). Ties go to less regularisation (smaller cell, later start and full)."""
    pool = [r for r in rows if r.corpus != exclude]
    if not pool:
        raise ZlmError(f"leave-one-corpus-out needs at least 2 corpora; the grid has {len(rows)}")

    def score(c: Constants) -> float:
        return statistics.fmean(interpolate(r.valid, c.zoneout_cell(r.epochs)) / min(r.valid.values()) - 1.0
                                for r in pool)

    scored = [(round(score(c), 9), c.cell, -c.start, -c.full, c) for c in candidates()]
    best = min(scored, key=lambda t: t[:4])
    return best[4], best[0]


# ------------------------------------------------------------------ running


def zoneout(z: float) -> Options:
    """z_c `z` and z_h HIDDEN_SHARE of it, given to the rule's plan."""
    return Options(zoneout_cell=z, zoneout_hidden=round(z * HIDDEN_SHARE, 4))


def grid_setting(z: float) -> str:
    return f"grid-zc{z:g}"


def defaults_loco(config: cb.BenchmarkConfig = cb.BenchmarkConfig(),
                  make_reporter: ReporterFactory = Reporter) -> RecipeResult:
    """The grid, the folds, the held-out runs and the baseline; then the tables."""
    out = Path(config.out or Path("runs") / cb.NAME)
    rep = make_reporter()
    corpora = benchmark.select(benchmark.load_benchmark(config.spec), config.only)
    datas = {c.name: cb.prepare_corpus(c, config, out, rep) for c in corpora}
    infos = [cb.corpus_info(c, datas[c.name]) for c in corpora]
    rows, grid, missing = [], [], []
    say = (lambda text: None) if config.report else rep.message

    def once(setting: str, corpus: str, seed: int, extra: Options = Options()):
        got = cb.train_once(setting, datas[corpus], seed, config, out / corpus, make_reporter, extra)
        if got is None:
            missing.append(f"{corpus}/{setting}-seed{seed}")
        return got

    total = len(corpora) * len(GRID)
    for i, (corpus, z) in enumerate(itertools.product(corpora, GRID)):
        say(f"[grid {i + 1}/{total}] {corpus.name}, z_c {z:g}")
        got = once(grid_setting(z), corpus.name, 1, zoneout(z))
        if got is not None:
            planned, row = got
            rows.append({**row, "corpus": corpus.name, "seed": 1, "zoneout_cell": z,
                         "epochs": planned.spec.rule.expected_epochs if planned.spec.rule else None})
    shown = []  # every grid row with a finished run, for the table
    for corpus in corpora:
        mine = [r for r in rows if r["corpus"] == corpus.name]
        epochs = [r["epochs"] for r in mine if r["epochs"] is not None]
        if mine:
            shown.append(GridRow(corpus.name, statistics.fmean(epochs) if epochs else 0.0,
                                 {r["zoneout_cell"]: r["valid_bpc"] for r in mine}))
            if len(mine) == len(GRID):  # only --report meets an incomplete row: no fit uses it
                grid.append(shown[-1])
    folds = {r.corpus: fit(grid, exclude=r.corpus) for r in grid} if len(grid) > 1 or not config.report else {}
    held, held_z = [], {}  # held_z: corpus -> its held-out z_c
    for corpus in corpora:
        if corpus.name in folds:
            g = next(g for g in grid if g.corpus == corpus.name)
            z = held_z[corpus.name] = folds[corpus.name][0].zoneout_cell(g.epochs)
            for seed in config.seeds:
                setting = grid_setting(z) if seed == 1 and z in GRID else f"heldout-zc{z:g}"
                say(f"[held out] {corpus.name}: z_c {z:g} (chosen without it), seed {seed}")
                got = once(setting, corpus.name, seed, zoneout(z))
                if got is not None:
                    held.append({**got[1], "corpus": corpus.name, "seed": seed, "zoneout_cell": z,
                                 "setting": HELD_OUT})
        elif any(g.corpus == corpus.name for g in grid):
            missing.append(f"{corpus.name}'s held-out runs (no other corpus's grid row is complete)")
        else:
            missing.append(f"{corpus.name}'s held-out runs (its grid row is not complete)")
        for seed in config.seeds:
            say(f"[baseline] {corpus.name}, seed {seed}")
            got = once("baseline", corpus.name, seed)
            if got is not None:
                held.append({**got[1], "corpus": corpus.name, "seed": seed, "setting": "baseline"})
    overall = fit(grid) if len(grid) > 1 else None
    summary = summarize(held, len(config.seeds), held_z)
    md = loco_markdown(config, infos, shown, folds, summary, overall, missing)
    ckpt.write_json(out / "loco.json", {
        "recipe": NAME, "budget": config.budget(), "seeds": list(config.seeds), "grid_points": list(GRID),
        "hidden_share": HIDDEN_SHARE, "candidates": CANDIDATES, "corpora": infos,
        "grid": [asdict(g) for g in grid],
        "folds": {k: {"constants": asdict(c), "mean_excess": s} for k, (c, s) in folds.items()},
        "all_corpora": None if overall is None else {"constants": asdict(overall[0]), "mean_excess": overall[1]},
        "summary": summary, "missing": missing, "grid_runs": rows, "runs": held})
    (out / "loco.md").write_text(md, encoding="utf-8")
    return RecipeResult(NAME, out, held, md, [out / "loco.json", out / "loco.md"])


# ------------------------------------------------------------------ results


def summarize(held: list[dict], seeds: int, held_z: dict[str, float]) -> list[dict]:
    """Per corpus (`cb.summarize`): held-out and baseline means over the seeds, Δ and
    whether the held-out rule wins by cb.WIN_MARGIN on valid and test (None while runs are
    missing); and its z_c from `held_z` (None without a fold)."""
    out = cb.summarize(held, (HELD_OUT, "baseline"), seeds)
    for entry in out:
        entry["zoneout_cell"] = held_z.get(entry["corpus"])
    return out


def loco_markdown(config: cb.BenchmarkConfig, infos: list[dict], grid: list[GridRow], folds: dict,
                  summary: list[dict], overall, missing: list[str] = ()) -> str:
    """OUT/loco.md: the held-out table, the grid (rows with any finished run) and each
    fold's constants, the constants fitted on all corpora, the corpora."""
    budget = (f"{config.max_steps:,} steps" if config.max_steps is not None else f"{config.minutes:g} minutes")
    lines = [f"Leave-one-corpus-out: the defaults rule's zoneout chosen without each corpus, scored on it "
             f"({budget} per run, seeds {', '.join(map(str, config.seeds))}; Δ = held out - baseline, a win "
             f"when Δ <= -{cb.WIN_MARGIN:g} on valid and test).", "",
             *(cb.report_lines(list(missing)) if config.report else []),
             "| corpus | E | z_c held out | held-out valid | baseline valid | Δ valid | held-out test | "
             "baseline test | Δ test | win |", "|---|---|---|---|---|---|---|---|---|---|"]
    epochs = {g.corpus: g.epochs for g in grid}
    for s in summary:
        e, z = epochs.get(s["corpus"]), s["zoneout_cell"]
        cells = [s["corpus"], cb.fmt(e, 1), "-" if z is None else f"{z:g}",
                 cb.fmt(s["heldout_valid"]), cb.fmt(s["baseline_valid"]), cb.fmt(s["delta_valid"], signed=True),
                 cb.fmt(s["heldout_test"]), cb.fmt(s["baseline_test"]), cb.fmt(s["delta_test"], signed=True),
                 cb.win_cell(s, HELD_OUT, len(config.seeds))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "The grid (seed 1, valid BPC by z_c; z_h = z_c x "
              f"{HIDDEN_SHARE:g}) and each fold's constants (chosen without the corpus):", "",
              "| corpus | E | " + " | ".join(f"z_c {z:g}" for z in GRID) + " | fold: start, full, cell |",
              "|---|---|" + "---|" * len(GRID) + "---|"]
    for g in grid:
        fold = folds.get(g.corpus)
        constants = "-" if fold is None else f"{fold[0].start:g}, {fold[0].full:g}, {fold[0].cell:g}"
        lines.append(f"| {g.corpus} | {g.epochs:.1f} | " + " | ".join(cb.fmt(g.valid.get(z)) for z in GRID)
                     + f" | {constants} |")
    if overall is not None:
        c, s = overall
        fitted = len(folds)
        on = "every corpus" if fitted == len(infos) else f"the {fitted} corpora whose grid row is complete"
        lines += ["", f"Fitted on {on}: ZONEOUT_FROM {c.start:g}, ZONEOUT_FULL {c.full:g}, "
                  f"ZONEOUT_CELL {c.cell:g}, ZONEOUT_HIDDEN {c.cell * HIDDEN_SHARE:g} (predicted valid "
                  f"{100 * s:.2f}% above each corpus's best grid point, on average)."]
    lines += ["", "Corpora: " + ", ".join(f"{i['name']} ({i['kind']}, {i['characters']:,} characters)"
                                          for i in infos) + ".", ""]
    return "\n".join(lines)

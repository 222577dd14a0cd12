"""`zlm recipe defaults-loco`: the defaults rule's regularisation, window and lr, chosen leave-one-corpus-out.

The rule (`zlm.training.defaults`) gives a run zoneout that grows with its expected passes
E over the text, linearly in log E: none up to ZONEOUT_FROM passes, z_c = ZONEOUT_CELL and
z_h = ZONEOUT_HIDDEN (half of it) from ZONEOUT_FULL passes on. Its window and lr ramp the
same way from the data-rich regime's (up to REGULARISED_FROM passes) to the regularised
regime's (from REGULARISED_FULL). Those five constants are chosen by this procedure, and it
reports how the rule does on corpora it was not fitted on:

1. Grid: every benchmark corpus is trained once (seed 1, the benchmark budget) at each z_c
   of GRID (z_h = z_c x HIDDEN_SHARE), everything else as the rule plans it; each run
   records the E the rule measured. One grid serves every fold.
2. Window grid: every corpus is also trained once at the window and lr of the regime end
   (`WINDOW_ENDS`) its grid run did not take, at the grid z_c nearest the rule's for its E
   (`window_zoneout`), so each corpus has valid BPC at both ends.
3. Folds: for each corpus X, the zoneout `Constants` are the CANDIDATES that minimise the
   mean, over the *other* corpora, of their valid BPC at the z_c the constants give for
   their E (read off their grid row, linear between grid points) relative to the best of
   their row (`fit`); the `WindowConstants` likewise from WINDOW_CANDIDATES and the window
   grid (linear in the share of the way between the ends, `fit_window`). X's held-out z_c,
   window and lr are those constants at X's E.
4. Held out: X is trained at its held-out z_c, window and lr with every seed (a grid run is
   reused when it is that setting and the seed is 1) and scored on the full valid and test
   splits, next to the corpora benchmark's plain-LSTM baseline for the same seeds (its
   "baseline-seed<N>" runs: run both recipes with the same --out to share them).
5. The constants fitted on all corpora are the rule's (docs/defaults-rule.md says which
   run chose them).

Cost: corpora x (len(GRID) + 1 + seeds x 2, less the reused grid runs) runs of the budget;
with 9 corpora, 3 grid points, 2 seeds and 10 minutes 63 to 72 runs, 11 to 12.5 hours on 2
cores. Like the other recipes it continues where it stopped: finished runs are kept, an
unfinished one resumes from its latest checkpoint, and with --record DIR the finished runs'
records (no weights) continue it on another machine. With --report it trains nothing and
writes the tables from the runs finished so far: the folds are fitted on the corpora whose
rows are complete, a corpus without a fold has no held-out setting yet, and a mean over
fewer seeds than asked is "pending". Writes OUT/loco.json and OUT/loco.md.
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
from zlm.training.defaults import window_at, window_share, zoneout_for, zoneout_strength

NAME = "defaults-loco"
HELD_OUT = "heldout"  # the setting of a corpus's runs at the z_c chosen without it
GRID = (0.0, 0.1, 0.2)  # the z_c values every corpus is trained at
HIDDEN_SHARE = 0.5  # z_h = z_c x this, in the grid and in the rule
CANDIDATES = {"start": (1.0, 2.0, 4.0, 8.0), "full": (4.0, 8.0, 12.0, 16.0, 32.0), "cell": (0.1, 0.2)}
WINDOW_ENDS = ("data-rich", "regularised")  # the regimes whose window and lr the window grid trains at
WINDOW_CANDIDATES = {"start": (1.0, 2.0, 4.0, 8.0, 10.0, 16.0, 32.0), "full": (4.0, 8.0, 12.0, 16.0, 32.0, 64.0)}


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


@dataclass(frozen=True)
class WindowConstants:
    """The rule's window and lr ramp: the data-rich regime's up to `start` passes, the
    regularised regime's from `full` on (REGULARISED_FROM, REGULARISED_FULL)."""

    start: float
    full: float

    def share(self, epochs: float) -> float:
        return window_share(epochs, self.start, self.full)


@dataclass(frozen=True)
class WindowRow:
    """One corpus's window grid: its E and valid BPC at either end's window and lr (`WINDOW_ENDS`),
    both at `zoneout_cell`."""

    corpus: str
    epochs: float
    zoneout_cell: float
    valid: dict[str, float]

    def at(self, share: float) -> float:
        """Valid BPC `share` of the way from the data-rich end to the regularised one (linear)."""
        rich, reg = (self.valid[end] for end in WINDOW_ENDS)
        return rich + share * (reg - rich)


def candidates() -> list[Constants]:
    """Every combination of CANDIDATES with start < full."""
    return [Constants(s, f, c) for s, f, c in itertools.product(*CANDIDATES.values()) if s < f]


def window_candidates() -> list[WindowConstants]:
    """Every combination of WINDOW_CANDIDATES with start < full."""
    return [WindowConstants(s, f) for s, f in itertools.product(*WINDOW_CANDIDATES.values()) if s < f]


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


def _lowest_excess(rows: list, exclude: str | None, what: str, scored: list[tuple]) -> tuple:
    """The shared part of `fit` and `fit_window`. `scored` holds (tie-breaking key, constants,
    predict) for each candidate, predict(row) its valid BPC on a row: -> the constants whose
    mean excess over `rows` but `exclude` is lowest (then the lowest key), and that mean. A
    row's excess is its predicted valid BPC over the best it measured, less 1."""
    pool = [r for r in rows if r.corpus != exclude]
    if not pool:
        raise ZlmError(f"leave-one-corpus-out needs at least 2 corpora; the {what} has {len(rows)}")
    best = min((round(statistics.fmean(predict(r) / min(r.valid.values()) - 1.0 for r in pool), 9), key, c)
               for key, c, predict in scored)
    return best[2], best[0]


def fit(rows: list[GridRow], exclude: str | None = None) -> tuple[Constants, float]:
    """The candidate with the lowest mean excess over `rows` but `exclude`, and that mean.

    A corpus's excess is its predicted valid BPC over the best of its grid row, less 1: a
    share, so every corpus weighs the same whatever its scale (a text of Chinese characters
    has about 4 times the bits per character of English; in plain BPC it would outweigh
    four English corpora). Ties go to less regularisation (smaller cell, later start and full)."""
    return _lowest_excess(rows, exclude, "grid", [
        ((c.cell, -c.start, -c.full), c, lambda r, c=c: interpolate(r.valid, c.zoneout_cell(r.epochs)))
        for c in candidates()])


def fit_window(rows: list[WindowRow], exclude: str | None = None) -> tuple[WindowConstants, float]:
    """The window ramp with the lowest mean excess over `rows` but `exclude`, and that mean:
    as `fit`, each corpus's predicted valid BPC over the better of its two ends, less 1. Ties
    go to the data-rich window (the later start and full)."""
    return _lowest_excess(rows, exclude, "window grid", [
        ((-c.start, -c.full), c, lambda r, c=c: r.at(c.share(r.epochs))) for c in window_candidates()])


def window_zoneout(epochs: float) -> float:
    """The z_c a corpus's window grid is trained at: the grid point nearest the rule's z_c at
    its E (the lower on a tie)."""
    z = zoneout_for(epochs).zoneout_cell
    return min(GRID, key=lambda g: (abs(g - z), g))


# ------------------------------------------------------------------ running


def zoneout(z: float) -> Options:
    """z_c `z` and z_h HIDDEN_SHARE of it, given to the rule's plan."""
    return Options(zoneout_cell=z, zoneout_hidden=round(z * HIDDEN_SHARE, 4))


def grid_setting(z: float) -> str:
    return f"grid-zc{z:g}"


def window(share: float) -> Options:
    """The window and lr `share` of the way from the data-rich regime's to the regularised one's."""
    w = window_at(share)
    return Options(bptt=w.bptt, lr=w.lr)


def window_setting(end: str, z: float) -> str:
    return f"window-{end}-zc{z:g}"


def held_out_setting(z: float, share: float | None) -> str:
    """A held-out run's setting: its z_c, and its window and lr where they are not the rule's."""
    if share is None:
        return f"heldout-zc{z:g}"
    w = window(share)
    return f"heldout-zc{z:g}-bptt{w.bptt}-lr{w.lr:g}"


@dataclass
class _Runner:
    """Trains (or keeps, or restores) one run of the procedure; notes the runs --report lacks."""

    config: cb.BenchmarkConfig
    out: Path
    datas: dict
    make_reporter: ReporterFactory
    missing: list[str]

    def say(self, text: str) -> None:
        if not self.config.report:
            self.make_reporter().message(text)

    def once(self, setting: str, corpus: str, seed: int, extra: Options = Options()):
        got = cb.train_once(setting, self.datas[corpus], seed, self.config, self.out / corpus,
                            self.make_reporter, extra)
        if got is None:
            self.missing.append(f"{corpus}/{setting}-seed{seed}")
        return got


def defaults_loco(config: cb.BenchmarkConfig = cb.BenchmarkConfig(),
                  make_reporter: ReporterFactory = Reporter) -> RecipeResult:
    """The grid, the window grid, the folds, the held-out runs and the baseline; then the tables."""
    out = Path(config.out or Path("runs") / cb.NAME)
    rep = make_reporter()
    corpora = benchmark.select(benchmark.load_benchmark(config.spec), config.only)
    datas = {c.name: cb.prepare_corpus(c, config, out, rep) for c in corpora}
    infos = [cb.corpus_info(c, datas[c.name]) for c in corpora]
    runner = _Runner(config, out, datas, make_reporter, [])
    rows, shown, grid = run_grid(runner, [c.name for c in corpora])
    windows, window_runs = run_window_grid(runner, grid, rows)
    folds = {r.corpus: fit(grid, exclude=r.corpus) for r in grid} if len(grid) > 1 or not config.report else {}
    window_folds = ({r.corpus: fit_window(windows, exclude=r.corpus) for r in windows}
                    if len(windows) > 1 or not config.report else {})
    held, held_z, held_w = run_held_out(runner, [c.name for c in corpora], grid, folds, windows, window_folds)
    overall = fit(grid) if len(grid) > 1 else None
    overall_window = fit_window(windows) if len(windows) > 1 else None
    summary = summarize(held, len(config.seeds), held_z, held_w)
    md = loco_markdown(config, infos, shown, folds, summary, overall, runner.missing, windows, window_folds,
                       overall_window, [*held, *rows, *window_runs])
    ckpt.write_json(out / "loco.json", {
        "recipe": NAME, "budget": config.budget(), "seeds": list(config.seeds), "grid_points": list(GRID),
        "hidden_share": HIDDEN_SHARE, "candidates": CANDIDATES, "window_candidates": WINDOW_CANDIDATES,
        "corpora": infos, "grid": [asdict(g) for g in grid],
        "folds": {k: _fitted(f) for k, f in folds.items()}, "all_corpora": _fitted(overall),
        "window_grid": [asdict(w) for w in windows],
        "window_folds": {k: _fitted(f) for k, f in window_folds.items()}, "window_all_corpora": _fitted(overall_window),
        "summary": summary, "missing": runner.missing, "grid_runs": rows, "window_runs": window_runs,
        "runs": held})
    (out / "loco.md").write_text(md, encoding="utf-8")
    return RecipeResult(NAME, out, held, md, [out / "loco.json", out / "loco.md"])


def _fitted(fitted: tuple | None) -> dict | None:
    """A fit's (constants, mean excess) for loco.json."""
    return None if fitted is None else {"constants": asdict(fitted[0]), "mean_excess": fitted[1]}


def run_grid(runner: _Runner, corpora: list[str]) -> tuple[list[dict], list[GridRow], list[GridRow]]:
    """Step 1: each corpus at each z_c of GRID. -> the runs' rows, every grid row with a
    finished run (for the table) and the complete rows (for the fits)."""
    rows, shown, grid = [], [], []
    total = len(corpora) * len(GRID)
    for i, (corpus, z) in enumerate(itertools.product(corpora, GRID)):
        runner.say(f"[grid {i + 1}/{total}] {corpus}, z_c {z:g}")
        got = runner.once(grid_setting(z), corpus, 1, zoneout(z))
        if got is not None:
            planned, row = got
            rule = planned.spec.rule
            rows.append({**row, "corpus": corpus, "seed": 1, "zoneout_cell": z,
                         "epochs": rule.expected_epochs if rule else None, "regime": rule.regime if rule else None})
    for corpus in corpora:
        mine = [r for r in rows if r["corpus"] == corpus]
        epochs = [r["epochs"] for r in mine if r["epochs"] is not None]
        if mine:
            shown.append(GridRow(corpus, statistics.fmean(epochs) if epochs else 0.0,
                                 {r["zoneout_cell"]: r["valid_bpc"] for r in mine}))
            if len(mine) == len(GRID):  # only --report meets an incomplete row: no fit uses it
                grid.append(shown[-1])
    return rows, shown, grid


def run_window_grid(runner: _Runner, grid: list[GridRow], rows: list[dict]) -> tuple[list[WindowRow], list[dict]]:
    """Step 2: each corpus with a complete grid row at the window end its grid run at
    `window_zoneout` did not take (both ends when that run was between them). -> the
    complete window rows and the window runs' rows."""
    windows, window_runs = [], []
    for g in grid:
        z = window_zoneout(g.epochs)
        base = next(r for r in rows if r["corpus"] == g.corpus and r["zoneout_cell"] == z)
        valid = {base["regime"]: base["valid_bpc"]} if base["regime"] in WINDOW_ENDS else {}
        for share, end in enumerate(WINDOW_ENDS):
            if end not in valid:
                runner.say(f"[window] {g.corpus}: the {end} regime's window and lr, z_c {z:g}")
                got = runner.once(window_setting(end, z), g.corpus, 1, zoneout(z) | window(share))
                if got is not None:
                    valid[end] = got[1]["valid_bpc"]
                    window_runs.append({**got[1], "corpus": g.corpus, "seed": 1, "zoneout_cell": z, "window": end})
        if len(valid) == len(WINDOW_ENDS):
            windows.append(WindowRow(g.corpus, g.epochs, z, {end: valid[end] for end in WINDOW_ENDS}))
    return windows, window_runs


def run_held_out(runner: _Runner, corpora: list[str], grid: list[GridRow], folds: dict, windows: list[WindowRow],
                 window_folds: dict) -> tuple[list[dict], dict[str, float], dict[str, Options]]:
    """Step 4: each corpus with both folds at its held-out z_c, window and lr, and the
    baseline, every seed. -> the runs' rows, and each corpus's held-out z_c and window."""
    held, held_z, held_w = [], {}, {}
    for corpus in corpora:
        if corpus in folds and corpus in window_folds:
            g = next(g for g in grid if g.corpus == corpus)
            z = held_z[corpus] = folds[corpus][0].zoneout_cell(g.epochs)
            share = window_folds[corpus][0].share(g.epochs)
            w = held_w[corpus] = window(share)
            own = None if share == window_share(g.epochs) else share  # None: the rule's window
            for seed in runner.config.seeds:
                setting = held_out_setting(z, own)
                if seed == 1 and z in GRID and own is None:
                    setting = grid_setting(z)
                elif seed == 1 and z in GRID and own in (0.0, 1.0):
                    setting = window_setting(WINDOW_ENDS[int(own)], z)
                runner.say(f"[held out] {corpus}: z_c {z:g}, bptt {w.bptt}, lr {w.lr:g} (chosen without it), "
                           f"seed {seed}")
                got = runner.once(setting, corpus, seed, zoneout(z) | (Options() if own is None else window(own)))
                if got is not None:
                    held.append({**got[1], "corpus": corpus, "seed": seed, "zoneout_cell": z, "bptt": w.bptt,
                                 "lr": w.lr, "setting": HELD_OUT})
        else:
            runner.missing.append(f"{corpus}'s held-out runs ({_why_no_fold(corpus, grid, folds, windows)})")
        for seed in runner.config.seeds:
            runner.say(f"[baseline] {corpus}, seed {seed}")
            got = runner.once("baseline", corpus, seed)
            if got is not None:
                held.append({**got[1], "corpus": corpus, "seed": seed, "setting": "baseline"})
    return held, held_z, held_w


def _why_no_fold(corpus: str, grid: list[GridRow], folds: dict, windows: list[WindowRow]) -> str:
    if corpus in folds:
        if any(w.corpus == corpus for w in windows):
            return "no other corpus's window row is complete"
        return "its window row is not complete"
    if any(g.corpus == corpus for g in grid):
        return "no other corpus's grid row is complete"
    return "its grid row is not complete"


# ------------------------------------------------------------------ results


def summarize(held: list[dict], seeds: int, held_z: dict[str, float], held_w: dict[str, Options]) -> list[dict]:
    """Per corpus (`cb.summarize`): held-out and baseline means over the seeds, Δ and
    whether the held-out rule wins by cb.WIN_MARGIN on valid and test (None while runs are
    missing); its z_c from `held_z` and its bptt and lr from `held_w` (None without a fold)."""
    out = cb.summarize(held, (HELD_OUT, "baseline"), seeds)
    for entry in out:
        entry["zoneout_cell"] = held_z.get(entry["corpus"])
        w = held_w.get(entry["corpus"])
        entry["bptt"], entry["lr"] = (None, None) if w is None else (w.bptt, w.lr)
    return out


def loco_markdown(config: cb.BenchmarkConfig, infos: list[dict], grid: list[GridRow], folds: dict,
                  summary: list[dict], overall, missing: list[str], windows: list[WindowRow],
                  window_folds: dict, overall_window, runs: list[dict] = ()) -> str:
    """OUT/loco.md: the held-out table, the grid (rows with any finished run) and each
    fold's constants, the window grid and each fold's window ramp, the constants fitted on
    all corpora, the corpora. runs: every run's row, for how they were scored."""
    budget = (f"{config.max_steps:,} steps" if config.max_steps is not None else f"{config.minutes:g} minutes")
    lines = [f"Leave-one-corpus-out: the defaults rule's zoneout, window and lr chosen without each corpus, "
             f"scored on it ({budget} per run, seeds {', '.join(map(str, config.seeds))}; Δ = held out - "
             f"baseline, a win when Δ <= -{cb.WIN_MARGIN:g} on valid and test).", "",
             *(cb.report_lines(list(missing)) if config.report else []), *cb.protocol_lines(list(runs)),
             "| corpus | E | z_c held out | bptt, lr held out | held-out valid | baseline valid | Δ valid | "
             "held-out test | baseline test | Δ test | win |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    epochs = {g.corpus: g.epochs for g in grid}
    for s in summary:
        e, z = epochs.get(s["corpus"]), s["zoneout_cell"]
        cells = [s["corpus"], cb.fmt(e, 1), "-" if z is None else f"{z:g}",
                 "-" if s["bptt"] is None else f"{s['bptt']}, {s['lr']:g}",
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
    ends = [window(share) for share in range(len(WINDOW_ENDS))]
    lines += ["", "The window grid (seed 1, valid BPC at either regime's window and lr, at the grid z_c nearest "
              "the rule's) and each fold's window ramp (chosen without the corpus):", "",
              "| corpus | E | z_c | " + " | ".join(f"{end} (bptt {w.bptt}, lr {w.lr:g})"
                                                  for end, w in zip(WINDOW_ENDS, ends, strict=True))
              + " | fold: start, full |", "|---|---|---|" + "---|" * len(WINDOW_ENDS) + "---|"]
    for w in windows:
        fold = window_folds.get(w.corpus)
        constants = "-" if fold is None else f"{fold[0].start:g}, {fold[0].full:g}"
        lines.append(f"| {w.corpus} | {w.epochs:.1f} | {w.zoneout_cell:g} | "
                     + " | ".join(cb.fmt(w.valid[end]) for end in WINDOW_ENDS) + f" | {constants} |")
    if overall is not None:
        c, s = overall
        lines += ["", f"Fitted on {_on(len(folds), len(infos), 'grid')}: ZONEOUT_FROM {c.start:g}, ZONEOUT_FULL {c.full:g}, "
                  f"ZONEOUT_CELL {c.cell:g}, ZONEOUT_HIDDEN {c.cell * HIDDEN_SHARE:g} (predicted valid "
                  f"{100 * s:.2f}% above each corpus's best grid point, on average)."]
    if overall_window is not None:
        c, s = overall_window
        lines += ["", f"Window fitted on {_on(len(windows), len(infos), 'window')}: REGULARISED_FROM {c.start:g}, REGULARISED_FULL {c.full:g} "
                  f"(predicted valid {100 * s:.2f}% above each corpus's better end, on average)."]
    lines += ["", "Corpora: " + ", ".join(f"{i['name']} ({i['kind']}, {i['characters']:,} characters)"
                                          for i in infos) + ".", ""]
    return "\n".join(lines)


def _on(fitted: int, corpora: int, row: str) -> str:
    return "every corpus" if fitted == corpora else f"the {fitted} corpora whose {row} row is complete"

"""The package's shape: layers import only downwards, no import cycles, short functions.

Every module of zlm/ and cli/ is parsed (not imported) and every import counted:
module-level, inside functions, `import a.b`, `from a import b` (b a module or a name),
relative imports, and `importlib.import_module("...")` / `__import__("...")` with a
literal name. Layers, lowest first:

    zlm.version, zlm.errors  <-  zlm.data  <-  zlm.model  <-  zlm.core
        <-  zlm.training | zlm.inference (never each other)  <-  zlm.tools | zlm.serve  <-  zlm.cli
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {  # package -> rank; a module may import its own rank or lower
    "zlm.version": 0, "zlm.errors": 0, "zlm.atomic": 0, "zlm.data": 1, "zlm.model": 2, "zlm.core": 3,
    "zlm.training": 4, "zlm.inference": 4, "zlm.tools": 5, "zlm.serve": 5, "zlm.cli": 6, "zlm.corpora": 0,
    "zlm.__main__": 7,
}
MAX_FUNCTION_LINES = 80
MAX_MODULES_PER_PACKAGE = 15
# cli/ is one module per command by design: it grows with them; zlm.training is one module
# per part of a run (plan, rule, probe, step, state, averaging, ...), and zlm.inference one
# per command's engine and per scorer (static, dynamic, cached), 16 at most.
MAX_MODULES = {"zlm.cli": 16, "zlm.training": 16, "zlm.inference": 16}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for zlm/ and cli/ (installed as zlm.cli)."""
    found = {}
    for base, prefix in ((ROOT / "zlm", "zlm"), (ROOT / "cli", "zlm.cli"), (ROOT / "corpora", "zlm.corpora")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every zlm module that `name` imports, in any form and anywhere in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()

    def add(dotted: str) -> None:
        # the module itself, or the nearest enclosing module that exists
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        if dotted:
            targets.add(dotted)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                add(full if full in known else base)
        elif isinstance(node, ast.Call):
            fn = node.func
            fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if fname in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                add(str(node.args[0].value))
    targets.discard(name)
    return {t for t in targets if t.startswith("zlm")}


def layer_of(module: str) -> tuple[str, int]:
    for pkg, rank in sorted(LAYERS.items(), key=lambda kv: -len(kv[0])):
        if module == pkg or module.startswith(pkg + "."):
            return pkg, rank
    if module == "zlm":
        return "zlm", 7  # the root package may expose anything (lazily: zlm.load)
    raise AssertionError(f"{module} is in no layer; add its package to LAYERS")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def test_the_parser_sees_every_form_of_import(tmp_path):
    """The counting itself: module-level, in-function, relative and importlib imports."""
    src = tmp_path / "m.py"
    src.write_text("import zlm.data.dataset\nfrom zlm.core import eval_protocol\n"
                   "def f():\n    from ..model import lm\n    import importlib\n"
                   "    importlib.import_module('zlm.inference.load')\n    from zlm.errors import UsageError\n")
    known = {"zlm.data.dataset", "zlm.core", "zlm.core.eval_protocol", "zlm.model", "zlm.model.lm",
             "zlm.inference.load", "zlm.errors", "zlm.training.x"}
    got = imports_of("zlm.training.x", src, known)
    assert got == {"zlm.data.dataset", "zlm.core.eval_protocol", "zlm.model.lm", "zlm.inference.load", "zlm.errors"}


def test_no_upward_or_sideways_imports(graph):
    bad = []
    for mod, targets in graph.items():
        pkg, rank = layer_of(mod)
        for t in targets:
            tpkg, trank = layer_of(t)
            if trank > rank or (trank == rank and tpkg != pkg and rank > 0):
                bad.append(f"{mod} -> {t}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_no_import_cycles(graph):
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_check_finds_a_cycle():
    """A guard that cannot fail is no guard: a planted cycle is found."""
    planted = {"zlm.a": {"zlm.b"}, "zlm.b": {"zlm.a"}}
    with pytest.raises(AssertionError, match="import cycles"):
        test_no_import_cycles(planted)


def test_functions_are_short():
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_packages_are_small():
    per_package = defaultdict(int)
    for name, path in modules().items():
        if path.name != "__init__.py":
            per_package[name.rpartition(".")[0]] += 1
    big = {p: n for p, n in per_package.items()
           if n > MAX_MODULES.get(p, MAX_MODULES_PER_PACKAGE)}
    assert not big, f"packages with more than {MAX_MODULES_PER_PACKAGE} modules: {big}"


def _calls_of(name: str, files=None) -> dict[str, int]:
    """Files (default: zlm/, cli/ and scripts/) that call `name(...)`, as a name or an
    attribute, with counts."""
    found: dict[str, int] = defaultdict(int)
    if files is None:
        files = [*modules().values(), *(p for p in (ROOT / "scripts").iterdir() if p.is_file())]
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except SyntaxError:  # a shell script in scripts/
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func
                if (fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)) == name:
                    found[str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name] += 1
    return dict(found)


def test_one_entry_point_to_training():
    """Every run is planned by `zlm.training.plan.plan` (the only maker of a RunSpec besides
    its loader, `RunSpec.from_dict`) and every Trainer is built from such a plan in one
    place, the runner (scripts/trainer-speed times the loop of a planned run's Trainer)."""
    assert set(_calls_of("Trainer")) == {"zlm/training/runner.py", "scripts/trainer-speed"}
    assert set(_calls_of("RunSpec")) == {"zlm/training/plan.py"}
    assert {"cli/train.py", "zlm/training/runner.py", "zlm/tools/benchmark.py", "zlm/tools/recipes.py",
            "scripts/trainer-speed"} <= set(_calls_of("plan"))


def test_the_entry_point_check_sees_a_second_trainer(tmp_path):
    """A guard that cannot fail is no guard: a file that builds a Trainer is found."""
    rogue = tmp_path / "rogue.py"
    rogue.write_text("from zlm.training.trainer import Trainer\nTrainer(None).fit()\n")
    assert _calls_of("Trainer", [rogue]) == {"rogue.py": 1}


# Module-level state that changes at run time, each with why it must live at module level.
# Everything else a module holds at its top level is a constant (never mutated).
MODULE_STATE = {
    "zlm.model.cells.cpu_ext._state": "the compiled extension: built or loaded once per process",
    "zlm.model.cells._compiled": "the compiled CPU cell function, made once from the extension",
    "zlm.model.cells.packed_gemm._cache": "oneDNN-packed weights, reused while the weights are unchanged",
    "zlm.model.cells.workspace._pool": "per-shape scratch buffers of the CPU cell, reused across windows",
}
_MUTATORS = {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add",
             "discard"}


def mutable_module_state(path: Path, name: str) -> set[str]:
    """Top-level names of `path` that a function mutates (item assignment, a mutating method,
    or a `global` rebinding)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        top.update(t.id for t in targets if isinstance(t, ast.Name))
    found = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                found.update(n for n in node.names if n in top)
            elif isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
                targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in top:
                        found.add(t.value.id)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in _MUTATORS and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id in top:
                found.add(node.func.value.id)
    return {f"{name}.{n}" for n in found}


def test_module_level_state_is_listed_with_its_reason():
    """No module keeps run-time state at its top level unless MODULE_STATE says why."""
    found = set()
    for name, path in modules().items():
        found |= mutable_module_state(path, name)
    assert found == set(MODULE_STATE), (f"unlisted: {sorted(found - set(MODULE_STATE))}; "
                                        f"listed but gone: {sorted(set(MODULE_STATE) - found)}")


def test_the_state_check_sees_a_cache(tmp_path):
    """A guard that cannot fail is no guard: a module-level dict filled by a function is found."""
    m = tmp_path / "m.py"
    m.write_text("_seen = {}\nLIMIT = 3\ndef remember(k, v):\n    _seen[k] = v\n    return LIMIT\n")
    assert mutable_module_state(m, "m") == {"m._seen"}

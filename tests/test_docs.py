"""The documentation stays true to the repository.

- docs/cli.md is what scripts/cli-reference renders from the Typer app today;
- every repository path named in code, comments and docs exists;
- every relative link of README.md and docs/*.md leads to a file (and heading) that exists;
- nothing refers to files outside the repository (the working notes and the corpora folder
  that used to sit beside the checkout);
- README.md stays short enough to read in five minutes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What is scanned for paths: code, comments and docs.
SCANNED_DIRS = ("zlm", "cli", "scripts", "tests")
SCANNED_FILES = ("README.md", "pyproject.toml")
TEXT_SUFFIXES = {"", ".py", ".md", ".cpp", ".h", ".cu", ".toml", ".sh"}
SKIP_PARTS = {"__pycache__", ".pytest_cache"}  # (the shipped corpus texts are .txt: not scanned)

# Paths rooted at a top-level folder of the repository, e.g. zlm/core/allocator.py, tests/,
# docs/cli.md; not when part of a longer path or URL (~/.cache/zlm/corpora, $X/docs/...).
ROOTED = re.compile(r"(?<![\w./$~{}<>*-])((?:zlm|cli|tests|scripts|docs|corpora)/[\w./-]*[\w/]|"
                    r"(?:zlm|cli|tests|scripts|docs|corpora)/)(?![\w{*<-])")
# .md and .py files written as paths (README.md, cells/fused.py, conftest.py).
FILES = re.compile(r"(?<![\w./$~{}<>*-])([\w][\w./-]*\.(?:md|py))(?![\w/(-])")
# Bare names checked everywhere: docs pages; bare .py names are checked in Markdown only
# (code names temporary files: tmp_path / "m.py", a child pytest's test_skipping.py).
CHECKED_BARE = re.compile(r"[\w.-]+\.md")

# The exceptions, all for things made at run time: paths under these placeholders (a run,
# a DATA_DIR, a command's OUT, a folder the user gives),
RUNTIME_ROOTS = {"runs", "RUN_DIR", "DATA_DIR", "OUT", "OUT_DIR", "DIR"}
# these files (a recipe's OUT/results.md; scripts/gpu-check's OUT/table*.md; the screenshot's temporary name),
RUNTIME_FILES = {"results.md", "table.md", "table-quality.md", "loco.md", "loco.json", "docs/score.png.tmp"}
# and prose that only looks like a path ("the same zlm/torch build").
NOT_PATHS = {"zlm/torch"}
# Installed packages whose source lives elsewhere in the repository (pyproject's package-dir).
INSTALLED_AS = {"zlm/cli": "cli", "zlm/corpora": "corpora"}

# Mentions of files outside the repository (spelled in pieces so this file passes itself).
FORBIDDEN = ("SPEC" ".md", "STYLE" ".md", ".." "/shared")


def scanned_files() -> list[Path]:
    files = [ROOT / name for name in SCANNED_FILES]
    files += sorted((ROOT / "docs").glob("*.md"))
    for top in SCANNED_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT)
            if (not path.is_file() or path.suffix not in TEXT_SUFFIXES
                    or SKIP_PARTS.intersection(rel.parts[1:-1]) or path.stat().st_size > 1_000_000):
                continue
            files.append(path)
    return files


def read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return ""


def all_names() -> set[str]:
    """Every file name in the repository's own folders (for bare names such as conftest.py)."""
    names = set()
    for top in ("zlm", "cli", "scripts", "tests", "docs", "corpora", ".ci"):
        names.update(p.name for p in (ROOT / top).rglob("*") if p.is_file())
    names.update(p.name for p in ROOT.iterdir() if p.is_file())
    return names


def exists(token: str) -> bool:
    """A path from the repository root exists (installed names mapped to their source)."""
    for installed, source in INSTALLED_AS.items():
        if token == installed or token.startswith(installed + "/"):
            token = source + token[len(installed):]
    return (ROOT / token).exists()


def resolves(token: str, source: Path) -> bool:
    """A relative path written in `source` exists: from the repository root, from the
    source's own folder (a link in docs, a module beside its package), or from zlm/ or
    zlm/model/ (model/lm.py, cells/fused.py)."""
    bases = [ROOT, source.parent, ROOT / "zlm", ROOT / "zlm" / "model"]
    return exists(token) or any((base / token).exists() for base in bases)


def path_problems() -> list[str]:
    names = all_names()
    problems = []
    for path in scanned_files():
        rel = path.relative_to(ROOT)
        for lineno, line in enumerate(read(path).splitlines(), 1):
            found = {}
            for m in ROOTED.finditer(line):
                token = m.group(1)
                if token in NOT_PATHS or token in RUNTIME_FILES:
                    continue
                found[m.start(1)] = token
                if not exists(token):
                    problems.append(f"{rel}:{lineno}: {token} does not exist")
            for m in FILES.finditer(line):
                token = m.group(1)
                first = token.split("/")[0]
                if any(m.start(1) <= start < m.end(1) for start in found) or first in RUNTIME_ROOTS \
                        or token in RUNTIME_FILES:
                    continue
                if "/" in token:
                    ok = resolves(token, path)
                elif CHECKED_BARE.fullmatch(token) or path.suffix == ".md":
                    ok = token in names
                else:
                    continue
                if not ok:
                    problems.append(f"{rel}:{lineno}: {token} does not exist")
    return sorted(set(problems), key=problems.index)


def test_repository_paths_named_in_code_and_docs_exist():
    problems = path_problems()
    assert not problems, ("paths named in code, comments or docs that do not exist (rename "
                          "them, or add a run-time path to RUNTIME_ROOTS):\n" + "\n".join(problems))


def test_nothing_refers_to_files_outside_the_repository():
    hits = []
    for path in scanned_files() + [ROOT / ".ci" / "run"]:
        for lineno, line in enumerate(read(path).splitlines(), 1):
            hits += [f"{path.relative_to(ROOT)}:{lineno}: {word}" for word in FORBIDDEN if word in line]
    assert not hits, "the repository must stand alone; these refer to files outside it:\n" + "\n".join(hits)


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    found, counts, fenced = set(), {}, False
    for line in read(md).splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.+)", line)
        if m:
            base = slug(m.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_relative_links_in_readme_and_docs_resolve():
    broken = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for lineno, line in enumerate(read(md).splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                dest = (md.parent / file).resolve() if file else md
                where = f"{md.relative_to(ROOT)}:{lineno}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{where} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_is_short():
    lines = read(ROOT / "README.md").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/ (at most 250)"


def test_cli_reference_is_current():
    script = ROOT / "scripts" / "cli-reference"
    if not (ROOT / "docs" / "cli.md").exists():
        pytest.fail("docs/cli.md is missing: run scripts/cli-reference")
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True,
                            text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, (
        "docs/cli.md is stale (a command's options or help changed): run scripts/cli-reference "
        f"and commit docs/cli.md\n{result.stdout}{result.stderr}")

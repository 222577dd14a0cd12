"""The benchmark corpora: `corpora/benchmark.json` turned into verified text files.

Owns the meaning of benchmark.json and `fetch_corpora(out)`, the library behind
`scripts/fetch-corpora OUT_DIR`. Each corpus is one kind of text (drama/verse, prose,
source code, technical documentation, markup, a dictionary, languages other than English)
made from material reachable without the open web:

- "deb": a Debian package at a pinned version, fetched with `apt-get download PKG=VERSION`,
  its .deb checked against the pinned SHA-256, unpacked with `dpkg-deb -x`, and its text
  assembled by a rule ("files": every file under a folder, sorted by relative path,
  filtered by suffix, optionally gunzipped - man pages, dictd's .dict.dz - and stripped of
  ANSI colour sequences, see `assemble_files`; "sword": a SWORD zText/zCom module decoded
  and its OSIS markup turned into plain lines);
- "repo": a text shipped in this repository (`repo_file`: tiny Shakespeare, which the
  tests read), else the catalog corpus of that name (mirror, cache);
- "builtin": zlm's own `stdlib` corpus (the running Python's sources), used by name.

Every produced OUT/<name>/input.txt is checked against the pinned SHA-256 of the text,
so the same bytes come out on every machine and every run; one already present and
verified is kept. OUT/manifest.json records where each text comes from, its size in
characters and bytes, its vocabulary and its license.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import pathlib
import re
import subprocess
import tempfile
import zlib
from collections.abc import Callable
from importlib import resources

from zlm.data import catalog, textio
from zlm.data.sword import osis_to_text, sword_blocks
from zlm.errors import DataError, UsageError

SOURCE_TYPES = ("deb", "repo", "builtin")
ENV_BENCH = "ZLM_BENCH_CORPORA"  # where the recipe looks for OUT_DIR by default
Fetcher = Callable[[dict, pathlib.Path], pathlib.Path]  # (source, workdir) -> unpacked root


@dataclasses.dataclass(frozen=True)
class BenchCorpus:
    """One corpus of the benchmark set, as benchmark.json pins it.

    source: {"type": "deb", "package", "version", "sha256"} | {"type": "repo", "path"}
        | {"type": "builtin", "name"}. assemble: the rule that turns the unpacked package
    into text (deb only). text: the pinned {"sha256", "characters", "bytes", "vocabulary"}
    of input.txt (absent for builtin corpora, whose text is the running Python's).
    """

    name: str
    kind: str
    source: dict
    license: str
    assemble: dict | None = None
    text: dict | None = None

    def __post_init__(self):
        if self.source.get("type") not in SOURCE_TYPES:
            raise DataError(f"benchmark.json: {self.name} has source type "
                            f"{self.source.get('type')!r}; use one of {', '.join(SOURCE_TYPES)}")


def load_benchmark(path=None) -> list[BenchCorpus]:
    """The corpora of benchmark.json (the packaged one, or `path`), in file order."""
    if path is None:
        text = resources.files("zlm.corpora").joinpath("benchmark.json").read_text("utf-8")
    else:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    doc = json.loads(text)
    return [BenchCorpus(name=name, **spec) for name, spec in doc["corpora"].items()]


def select(corpora: list[BenchCorpus], only: str | None, flag: str = "--only") -> list[BenchCorpus]:
    """The corpora named in a comma-separated `only` (all when None), in set order."""
    if not only:
        return corpora
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    known = [c.name for c in corpora]
    for n in wanted:
        if n not in known:
            raise UsageError(f"{flag} {n}: no such benchmark corpus; use some of {','.join(known)}")
    return [c for c in corpora if c.name in wanted]


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def verify_sha256(actual: str, expected: str, what: str, fix: str) -> None:
    """A DataError (one line) when `actual` is not the pinned `expected` digest."""
    if actual != expected:
        raise DataError(f"{what}: SHA-256 {actual[:16]}... is not the pinned {expected[:16]}... "
                        f"(corpora/benchmark.json); {fix}")


def text_stats(text: str) -> dict:
    """{"sha256", "characters", "bytes", "vocabulary"} of a corpus text (UTF-8)."""
    data = text.encode("utf-8")
    return {"sha256": sha256_bytes(data), "characters": len(text), "bytes": len(data),
            "vocabulary": len(set(text))}


# ------------------------------------------------------------------ text assembly


def decode_utf8(data: bytes, where: str) -> str:
    """Strict UTF-8, a leading byte order mark dropped, CRLF and CR normalised to LF."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 at byte {e.start}; the package is not the "
                        "pinned one") from None
    text = text.removeprefix("\ufeff")
    return text.replace("\r\n", "\n").replace("\r", "\n")


FILES_OPTIONS = ("method", "root", "suffix", "exclude_suffixes", "decompress", "strip_ansi", "recursive",
                 "max_bytes")
DECOMPRESS = ("gzip",)
# An ANSI SGR (colour) sequence: ESC [ parameters m (fortunes-zh colours its titles).
ANSI_SGR = re.compile(r"\x1b\[[0-9;]*m")


def rule_files(root: pathlib.Path, rule: dict) -> list[pathlib.Path]:
    """The files a "files" rule reads: under root/rule["root"], sorted by relative path
    (the order of its parts, not of the platform's directory listing), filtered by
    "suffix" and "exclude_suffixes" (on the file's name as the package has it, .gz
    included); symbolic links skipped (fortune's .u8 aliases, man page aliases); with
    "recursive": false, the files of the folder itself and none of its subfolders'."""
    base = root / rule["root"]
    if not base.is_dir():
        raise DataError(f"{rule['root']} is not a folder of the unpacked package; the package "
                        "is not the pinned one")
    found = []
    for folder, dirs, names in os.walk(base):
        if not rule.get("recursive", True):
            dirs.clear()  # the folder's own files only
        dirs.sort()
        for n in names:
            p = pathlib.Path(folder) / n
            if p.is_symlink() or not p.is_file():
                continue
            if rule.get("suffix") and not n.endswith(rule["suffix"]):
                continue
            if any(n.endswith(s) for s in rule.get("exclude_suffixes", ())):
                continue
            found.append(p)
    return sorted(found, key=lambda p: p.relative_to(base).parts)


def check_files_rule(rule: dict) -> None:
    """A DataError for an option a "files" rule does not have, or a value it cannot take."""
    unknown = sorted(set(rule) - set(FILES_OPTIONS))
    if unknown:
        raise DataError(f"benchmark.json: assemble option {unknown[0]!r} of method files; use "
                        f"some of {', '.join(FILES_OPTIONS[1:])}")
    if rule.get("decompress") not in (None, *DECOMPRESS):
        raise DataError(f"benchmark.json: decompress {rule['decompress']!r}; use "
                        f"{' or '.join(DECOMPRESS)}")
    if rule.get("recursive", True) not in (True, False):
        raise DataError(f"benchmark.json: recursive {rule['recursive']!r}; use true or false")
    cap = rule.get("max_bytes")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise DataError(f"benchmark.json: max_bytes {cap!r}; use a whole number of bytes, at least 1")


def gunzip(data: bytes, where: str) -> bytes:
    """A gzip file's contents (every member; a dictzip .dz is gzip with an index in its
    header); a DataError naming the file when it is not gzip."""
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{where}: not gzip data ({e}); the package is not the pinned "
                        "one") from None


def strip_ansi(text: str) -> str:
    """`text` without ANSI SGR sequences, removed until none is left (one split by
    another, as in `ESC[;ESC[34;1mm`, goes too)."""
    while True:
        stripped = ANSI_SGR.sub("", text)
        if stripped == text:
            return text
        text = stripped


def file_text(root: pathlib.Path, path: pathlib.Path, rule: dict) -> str:
    """One file of a "files" rule as text: gunzipped when the rule says "decompress":
    "gzip", strict UTF-8 (`decode_utf8`), ANSI colours dropped when "strip_ansi"."""
    where = path.relative_to(root).as_posix()
    data = path.read_bytes()
    if rule.get("decompress") == "gzip":
        data = gunzip(data, where)
    text = decode_utf8(data, where)
    return strip_ansi(text) if rule.get("strip_ansi") else text


def assemble_files(root: pathlib.Path, rule: dict) -> str:
    """Every file of the rule, in order, each ending with exactly the newline it has
    (one added where the file lacks it); nothing else between files.

    Options besides "root": "suffix" (only names ending so), "exclude_suffixes" (a list;
    names ending so are left out), "decompress": "gzip" (every file read is gzip - man
    pages' .gz, dictd's dictzip .dict.dz - and its contents are the text), "strip_ansi":
    true (ANSI SGR colour sequences removed from each file's text), "recursive": false
    (the root folder's own files only), "max_bytes": N (the text cut to its first N bytes
    of UTF-8, back to the last whole character: a large package's first few MB)."""
    check_files_rule(rule)
    parts = []
    for p in rule_files(root, rule):
        text = file_text(root, p, rule)
        parts.append(text if text.endswith("\n") or not text else text + "\n")
    if not parts:
        raise DataError(f"no files under {rule['root']} match the rule; the package is not "
                        "the pinned one")
    text = "".join(parts)
    if rule.get("max_bytes") is not None:
        text = text.encode("utf-8")[:rule["max_bytes"]].decode("utf-8", errors="ignore")
    return text


def assemble_sword(root: pathlib.Path, rule: dict) -> str:
    """A SWORD module's testaments in order, each block's OSIS turned into text."""
    module = root / rule["root"]
    if not module.is_dir():
        raise DataError(f"{rule['root']} is not a folder of the unpacked package; the package "
                        "is not the pinned one")
    osis = "".join(decode_utf8(b, f"{rule['root']} block") for t in rule["testaments"]
                   for b in sword_blocks(module, t, rule["ext"]))
    return osis_to_text(osis)


ASSEMBLERS = {"files": assemble_files, "sword": assemble_sword}


def source_files(root: pathlib.Path, rule: dict) -> list[str]:
    """The package paths a rule reads, in reading order (recorded in the manifest)."""
    if rule.get("method") == "sword":
        return [f"{rule['root']}/{t}.{rule['ext']}{s}" for t in rule["testaments"] for s in "sz"]
    return [p.relative_to(root).as_posix() for p in rule_files(root, rule)]


def assemble(root: pathlib.Path, rule: dict) -> str:
    """The corpus text of an unpacked package tree, by its rule's "method"."""
    if rule.get("method") not in ASSEMBLERS:
        raise DataError(f"benchmark.json: assemble method {rule.get('method')!r}; use one of "
                        f"{', '.join(ASSEMBLERS)}")
    return ASSEMBLERS[rule["method"]](root, rule)


# ------------------------------------------------------------------ fetching


def _run(cmd: list[str], cwd: pathlib.Path, what: str) -> str:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)
    except FileNotFoundError:
        raise DataError(f"{cmd[0]} is not installed; {what} needs Debian's apt-get and "
                        "dpkg-deb") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise DataError(f"{' '.join(cmd)} failed: {last}")
    return done.stdout


def apt_fetch(source: dict, workdir: pathlib.Path) -> pathlib.Path:
    """Download the pinned .deb with apt-get, check its SHA-256, unpack it; -> the tree."""
    pkg, version = source["package"], source["version"]
    try:
        subprocess.run(["apt-get", "download", f"{pkg}={version}"], cwd=workdir, check=True,
                       capture_output=True, text=True, timeout=900)
    except FileNotFoundError:
        raise DataError("apt-get is not installed; the benchmark corpora come from Debian "
                        "packages (run this on Debian or Ubuntu)") from None
    except subprocess.CalledProcessError as e:
        offered = _apt_candidate(pkg)
        raise DataError(f"apt-get download {pkg}={version} failed ("
                        f"{(e.stderr.strip().splitlines() or ['?'])[-1]}); apt offers {pkg} "
                        f"{offered}: run apt-get update, or pin that version and its SHA-256s "
                        "in corpora/benchmark.json") from None
    debs = sorted(workdir.glob(f"{pkg}_*.deb"))
    if len(debs) != 1:
        raise DataError(f"apt-get download {pkg}={version} left {len(debs)} .deb files in {workdir}")
    verify_sha256(catalog.sha256_file(debs[0]), source["sha256"], debs[0].name,
                  "apt serves other bytes under the pinned version: check the package and "
                  "update its pin in corpora/benchmark.json")
    root = workdir / "root"
    _run(["dpkg-deb", "-x", str(debs[0]), str(root)], workdir, "unpacking a .deb")
    return root


def _apt_candidate(pkg: str) -> str:
    try:
        out = subprocess.run(["apt-cache", "policy", pkg], capture_output=True, text=True,
                             timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return "(unknown: apt-cache failed)"
    m = re.search(r"Candidate:\s*(\S+)", out)
    return f"version {m.group(1)}" if m and m.group(1) != "(none)" else "no version"


def repo_file(source: dict) -> pathlib.Path:
    """A text shipped in this repository (path relative to its root), else - an installed
    zlm without the repository - the catalog corpus of that name (mirror, cache)."""
    path = pathlib.Path(__file__).resolve().parents[2] / source["path"]
    if path.is_file():
        return path
    name = source.get("catalog")
    if name:
        try:
            return catalog.locate(name).files[0]
        except Exception:  # noqa: BLE001 - any failure: the hint below is the fix
            pass
    raise DataError(f"{source['path']} is not in this installation; run from a clone of the zlm "
                    f"repository or fetch the corpus with scripts/fetch-corpora")


def corpus_text(corpus: BenchCorpus, workdir: pathlib.Path,
                fetcher: Fetcher) -> tuple[str, list[str]]:
    """The text of one non-builtin corpus, fetched and assembled (not yet verified), and
    the files it was made of."""
    if corpus.source["type"] == "repo":
        path = repo_file(corpus.source)
        return decode_utf8(path.read_bytes(), corpus.source["path"]), [str(path)]
    root = fetcher(corpus.source, workdir)
    rule = corpus.assemble or {}
    return assemble(root, rule), source_files(root, rule)


def _verified(path: pathlib.Path, pinned: dict) -> bool:
    return path.is_file() and catalog.sha256_file(path) == pinned["sha256"]


def fetch_one(corpus: BenchCorpus, out: pathlib.Path, fetcher: Fetcher = apt_fetch,
              say: Callable[[str], None] = lambda s: None) -> dict:
    """OUT/<name>/input.txt for one corpus (kept when present and verified) -> its
    manifest entry."""
    entry = {"name": corpus.name, "kind": corpus.kind, "source": corpus.source,
             "assemble": corpus.assemble, "license": corpus.license}
    if corpus.source["type"] == "builtin":
        say(f"{corpus.name}: built in (zlm's {corpus.source['name']} corpus), nothing to fetch")
        return {**entry, "input": corpus.source["name"], "files": None,
                "text": builtin_stats(corpus.source["name"])}
    target = out / corpus.name / "input.txt"
    record = out / corpus.name / "files.json"  # the package files it was made of
    pinned = corpus.text or {}
    if _verified(target, pinned):
        say(f"{corpus.name}: {target} present and verified")
    else:
        if target.exists():
            say(f"{corpus.name}: {target} does not match its pin; making it again")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
            say(f"{corpus.name}: fetching {_describe(corpus.source)}")
            text, files = corpus_text(corpus, pathlib.Path(tmp), fetcher)
            stats = text_stats(text)
            verify_sha256(stats["sha256"], pinned.get("sha256", "(none)"),
                          f"{corpus.name} text", "the assembly rule or the package changed; "
                          "fix the rule or re-pin the text")
            part = pathlib.Path(tmp) / "input.txt"
            part.write_bytes(text.encode("utf-8"))
            os.replace(part, target)
            record.write_text(json.dumps(files, indent=0) + "\n", encoding="utf-8")
    files = json.loads(record.read_text("utf-8")) if record.is_file() else None
    return {**entry, "input": str(target), "files": files, "text": dict(pinned)}


def _describe(source: dict) -> str:
    if source["type"] == "deb":
        return f"Debian package {source['package']} {source['version']}"
    return source.get("path", source.get("name", "?"))


def builtin_stats(name: str) -> dict:
    """Characters, bytes and vocabulary of a built-in corpus as `zlm prepare` reads it."""
    files = catalog.locate(name).files
    chars, nbytes, vocab = 0, 0, set()
    h = hashlib.sha256()
    for chunk in textio.iter_text(files):
        chars += len(chunk)
        data = chunk.encode("utf-8")
        nbytes += len(data)
        h.update(data)
        vocab.update(chunk)
    return {"sha256": h.hexdigest(), "characters": chars, "bytes": nbytes,
            "vocabulary": len(vocab), "pinned": False}


def fetch_corpora(out, only: str | None = None, spec=None, fetcher: Fetcher = apt_fetch,
                  say: Callable[[str], None] = lambda s: None) -> dict:
    """Every selected corpus into OUT/<name>/input.txt, and OUT/manifest.json -> the manifest."""
    out = pathlib.Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    corpora = load_benchmark(spec)
    fresh = {c.name: fetch_one(c, out, fetcher, say) for c in select(corpora, only)}
    old = {}  # entries of corpora not selected this time (--only) are kept
    if (out / "manifest.json").is_file():
        old = {e["name"]: e for e in json.loads((out / "manifest.json").read_text("utf-8"))["corpora"]}
    entries = [fresh.get(c.name) or old[c.name] for c in corpora if c.name in fresh or c.name in old]
    manifest = {"format": "zlm-benchmark-manifest", "version": 1, "corpora": entries}
    part = out / ".manifest.json.part"
    part.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(part, out / "manifest.json")
    return manifest


def corpus_source(corpus: BenchCorpus, corpora_dir: pathlib.Path) -> str:
    """What `zlm prepare` reads for a corpus: OUT_DIR/<name>/input.txt, a built-in corpus
    by name, or (tiny Shakespeare not fetched) the repository's copy (`repo_file`)."""
    if corpus.source["type"] == "builtin":
        return corpus.source["name"]
    path = corpora_dir / corpus.name / "input.txt"
    if path.is_file():
        return str(path)
    if corpus.source["type"] == "repo":
        return str(repo_file(corpus.source))
    raise UsageError(f"{path} is missing; run scripts/fetch-corpora {corpora_dir} first "
                     f"(or pass --corpora DIR, or set {ENV_BENCH})")

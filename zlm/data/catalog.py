"""Named corpora: where their files come from, verified by SHA-256.

Owns the meaning of `corpora/catalog.json` and turns a corpus name into local files:

1. `--mirror DIR` (or the `ZLM_CORPORA` environment variable): DIR/<name>/<file>;
2. the cache, `$XDG_CACHE_HOME/zlm/corpora/<name>/<file>` (default ~/.cache/zlm/...);
3. otherwise the published URL is downloaded into the cache (written to a temporary
   name, verified, renamed), and zip / tar.gz archives are unpacked there.

Every file is checked against the catalog's SHA-256. Where the catalog has no digest
(not published, not verified when the catalog was written), the first copy obtained is
trusted and its digest is recorded next to it in the cache, and later uses must match.
The built-in `stdlib` corpus is the running interpreter's standard-library sources.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import shutil
import sysconfig
import tarfile
import tempfile
import urllib.request
import zipfile
from collections.abc import Callable

from zlm.corpora import load_catalog
from zlm.errors import DataError, UsageError

ENV_MIRROR = "ZLM_CORPORA"
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test",
                "__pycache__"}

Progress = Callable[[int, int], None]


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A named corpus resolved to local files.

    files: every file, in reading order. split: the catalog's split convention, one of
    {"kind": "fractions", "fractions": [..3]}, {"kind": "counts", "counts": [..3]}
    (units from the start: train, valid, test) or {"kind": "files", "train": FILE, ...}.
    unit: what split positions and the metric count ("character" or "byte").
    unknown: the default policy for characters of valid/test not seen in train.
    """

    name: str
    files: tuple[pathlib.Path, ...]
    split: dict
    format: str
    unit: str
    tokenizer: str
    unknown: str = "error"

    def split_files(self) -> dict[str, list[pathlib.Path]] | None:
        """For a "files" split: {"train": [path], "valid": [...], "test": [...]}."""
        if self.split["kind"] != "files":
            return None
        by_name = {p.name: p for p in self.files}
        return {s: [by_name[self.split[s]]] for s in ("train", "valid", "test")}


def names() -> list[str]:
    """Corpus names in catalog order."""
    return list(load_catalog()["corpora"])


def entry(name: str) -> dict:
    """The catalog entry for `name` (UsageError if there is none)."""
    corpora = load_catalog()["corpora"]
    if name not in corpora:
        raise UsageError(f"{name!r} is not a corpus in the catalog; use one of "
                         f"{', '.join(corpora)} or pass a file or directory")
    return corpora[name]


def cache_dir() -> pathlib.Path:
    """Where downloaded corpora live: $XDG_CACHE_HOME/zlm/corpora or ~/.cache/zlm/corpora."""
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "zlm" / "corpora"


def mirror_dir(mirror=None) -> pathlib.Path | None:
    """--mirror if given, else $ZLM_CORPORA, else None."""
    chosen = mirror if mirror is not None else os.environ.get(ENV_MIRROR) or None
    if chosen is None:
        return None
    path = pathlib.Path(chosen).expanduser()
    if not path.is_dir():
        raise UsageError(f"mirror {path} is not a directory; pass --mirror DIR (or set "
                         f"{ENV_MIRROR}) pointing at a folder holding <name>/<file>")
    return path


def stdlib_files(root=None) -> list[pathlib.Path]:
    """The standard library's .py files, sorted by relative path, tests and packages out."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):  # pruned walk: site-packages can be huge
        dirs[:] = [d for d in dirs if d not in _STDLIB_SKIP and not d.startswith(".")]
        files += [pathlib.Path(folder) / n for n in names if n.endswith(".py")]
    files = [p for p in files if p.is_file()]
    if not files:
        raise DataError(f"no standard-library sources under {root}; pass a text file instead")
    return sorted(files, key=lambda p: p.relative_to(root).parts)


def locate(name: str, mirror=None, on_progress: Progress | None = None) -> Corpus:
    """Resolve a corpus name to verified local files, downloading into the cache if needed."""
    spec = entry(name)
    common = dict(name=name, split=spec["split"], format=spec["format"], unit=spec["unit"],
                  tokenizer=spec["tokenizer"], unknown=spec.get("unknown", "error"))
    if spec.get("builtin") == "stdlib":
        return Corpus(files=tuple(stdlib_files()), **common)
    mirror_root = mirror_dir(mirror)
    files = []
    for file_name, info in spec["files"].items():
        path = None
        if mirror_root is not None and (mirror_root / name / file_name).is_file():
            path = mirror_root / name / file_name
        elif (cache_dir() / name / file_name).is_file():
            path = cache_dir() / name / file_name
        else:
            _fetch(name, spec, mirror_root, on_progress)
            path = cache_dir() / name / file_name
        _verify(name, path, info.get("sha256"))
        files.append(path)
    return Corpus(files=tuple(files), **common)


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _verify(name: str, path: pathlib.Path, expected: str | None) -> None:
    """Check `path` against the catalog digest, or (cached files) the one recorded on
    first use. A mirror file without a catalog digest is trusted as it is."""
    record = cache_dir() / name / (path.name + ".sha256")
    in_cache = path.parent == record.parent
    if expected is None and in_cache and record.is_file():
        expected = record.read_text().split()[0]
    actual = sha256_file(path)
    if expected is None:
        if in_cache:
            record.write_text(f"{actual}  {path.name}\n")
    elif actual != expected:
        raise DataError(f"{path}: SHA-256 {actual[:16]}... does not match {name}'s "
                        f"{expected[:16]}...; delete the file and let zlm download it again "
                        "(or fix your mirror)")


def _fetch(name: str, spec: dict, mirror_root, on_progress: Progress | None) -> None:
    """Download (and unpack) the corpus into the cache; nothing is left half-written."""
    dl = spec["download"]
    target = cache_dir() / name
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target, prefix=".download-") as tmp:
        archive = pathlib.Path(tmp) / dl["url"].rsplit("/", 1)[-1]
        try:
            _download(dl["url"], archive, on_progress)
        except OSError as e:
            where = f"{mirror_root}/{name}/" if mirror_root else f"MIRROR/{name}/"
            raise DataError(
                f"could not download {name} from {dl['url']} ({e}); put its files "
                f"({', '.join(spec['files'])}) in {where} and pass --mirror or set "
                f"{ENV_MIRROR}"
            ) from None
        if dl.get("sha256") and sha256_file(archive) != dl["sha256"]:
            raise DataError(f"download of {name} from {dl['url']} does not match its "
                            "SHA-256; try again later or use --mirror")
        for file_name, info in spec["files"].items():
            out = pathlib.Path(tmp) / file_name
            _extract(dl.get("archive"), archive, info.get("member", file_name), out)
            os.replace(out, target / file_name)


def _download(url: str, dest: pathlib.Path, on_progress: Progress | None) -> None:
    with urllib.request.urlopen(url, timeout=60) as response, open(dest, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0)
        done = 0
        while chunk := response.read(1 << 20):
            out.write(chunk)
            done += len(chunk)
            if on_progress is not None:
                on_progress(done, total)


def _extract(kind: str | None, archive: pathlib.Path, member: str, out: pathlib.Path) -> None:
    if kind is None:
        if archive != out:
            os.replace(archive, out)
        return
    if kind == "zip":
        with zipfile.ZipFile(archive) as zf:
            match = [n for n in zf.namelist() if n == member or n.endswith("/" + member)]
            if not match:
                raise DataError(f"{archive.name} has no {member}; the download is not the "
                                "expected archive")
            with zf.open(match[0]) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        return
    with tarfile.open(archive, "r:gz") as tf:
        match = [m for m in tf.getmembers() if m.isfile() and m.name.endswith(member)]
        if not match:
            raise DataError(f"{archive.name} has no {member}; the download is not the "
                            "expected archive")
        with tf.extractfile(match[0]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)

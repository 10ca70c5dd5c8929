"""Which slurmagent runs: the version of the installed distribution, read from its metadata.

pyproject.toml's `version` is the only literal. `importlib.metadata` costs about as much to
import as the whole healthy prolog (the decision log of every prolog carries the version), so
the `slurmagent-<version>.dist-info` is looked up by hand: beside the package first (where pip
put this very code), then on sys.path as importlib.metadata would (an editable install); only
then `importlib.metadata` itself, and "0+unknown" without any. Read once per process.

Two builds of one version tell apart: the version carries the commit it was built from as a local
version label, `0.1.0+g<12 hex digits>` (`.dirty` after it: a wheel built from a tree with
uncommitted changes). A wheel has it in `slurmagent/build_commit.txt` (written by ci/wheel_commit.py
at `pip wheel .`); an editable install or a checkout on PYTHONPATH reads the checkout's HEAD from
`.git` (files only, no git process: the prolog pays for this read); neither: pyproject's version alone.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

UNKNOWN = "0+unknown"
COMMIT_FILE = "build_commit.txt"  # ci/wheel_commit.COMMIT_FILE
COMMIT_DIGITS = 12
_cached: str | None = None


def version() -> str:
    global _cached
    if _cached is None:
        package_site = str(Path(__file__).resolve().parents[2])
        _cached = next(filter(None, map(_dist_info_version, [package_site, *sys.path])), None)
        _cached = _with_commit(_cached or _from_importlib() or UNKNOWN, commit())
    return _cached


def _with_commit(base: str, built_from: str | None) -> str:
    """`0.1.0` + `1c2447b77567` -> `0.1.0+g1c2447b77567` (a version that has a local label keeps it)."""
    if not built_from:
        return base
    return f"0+g{built_from}" if base == UNKNOWN else base if "+" in base else f"{base}+g{built_from}"


def commit() -> str | None:
    """The commit this code was built from: the wheel's stamp, else the checkout's HEAD, else None."""
    package = Path(__file__).resolve().parents[1]
    try:
        stamped = (package / COMMIT_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return checkout_head(package.parent)
    return stamped or None


def checkout_head(repo: Path) -> str | None:
    """HEAD of the git checkout at `repo` (a worktree's `.git` file too), by reading git's files."""
    try:
        git = repo / ".git"
        if git.is_file():  # a worktree or a submodule: `gitdir: <path>`
            git = repo / _small_text(git).partition("gitdir:")[2].strip()
        head = _small_text(git / "HEAD").strip()
        if not head.startswith("ref: "):  # detached
            return _sha(head)
        ref = head[5:]
        common = git / _small_text(git / "commondir").strip() if (git / "commondir").is_file() else git
        for base in (git, common):
            if (base / ref).is_file():
                return _sha(_small_text(base / ref).strip())
        with open(common / "packed-refs", encoding="utf-8") as packed:
            for line in packed:
                sha, _, name = line.strip().partition(" ")
                if name == ref:
                    return _sha(sha)
    except OSError:
        pass
    return None


def _small_text(path: Path, limit: int = 4096) -> str:
    """A small regular file's text: a FIFO or a device named like git's files never blocks the prolog."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        return os.read(fd, limit).decode("utf-8", "replace")
    finally:
        os.close(fd)


def _sha(text: str) -> str | None:
    return text[:COMMIT_DIGITS] if len(text) >= COMMIT_DIGITS and all(c in "0123456789abcdef" for c in text) else None


def _dist_info_version(site: str) -> str | None:
    """`Version:` of the one `slurmagent-*.dist-info` in `site`, else None."""
    try:
        infos = [e.name for e in os.scandir(site or ".")
                 if e.name.startswith("slurmagent-") and e.name.endswith(".dist-info")]
    except OSError:
        return None
    if len(infos) != 1:  # none (a checkout) or a half-cleaned upgrade: let importlib.metadata choose
        return None
    site = Path(site or ".")
    try:
        with open(site / infos[0] / "METADATA", encoding="utf-8") as f:
            for line in f:
                if line.startswith("Version:"):
                    return line.partition(":")[2].strip() or None
                if not line.strip():  # end of the headers
                    break
    except OSError:
        pass
    return None


def _from_importlib() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("slurmagent")
    except metadata.PackageNotFoundError:
        return None

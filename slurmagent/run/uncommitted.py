"""What a checkpoint directory may show the trainer at start: this job's checkpoint only.

Files an earlier job left at the same node-local path (`/mnt/localssd/ckpt` outlives jobs on a
VM), or a step folder nobody committed, are moved aside before the trainer starts, single- and
multi-node alike, on every attempt, the first included: never shown to the trainer, never
uploaded. With a remote, "this job's checkpoint" is the committed manifest; without one, the
local directory is the only copy, so files the record beside the directory says this job wrote
(an earlier attempt of it) are kept, and any other job's are moved aside.

Each move goes into a **fresh set folder** `<dir>.uncommitted/<UTC time>Z-<pid>/`, so a move
can never be a no-op: `rename()` onto a hard link of the same inode (a restored file is a hard
link into the node-local cache, and an earlier move may have left that inode in the old flat
`<dir>.uncommitted/`) does nothing and returns success (POSIX), which once left an earlier
job's files in place to be committed by the next. Every move is checked (the name is gone
from the directory); a file that cannot be moved stops the start (`UnusableDirError`: the
job goes to another node), since the trainer would see it. `<dir>.uncommitted/` keeps the
newest `[checkpoint] keep_uncommitted` sets; older ones (and entries of the old flat layout)
are deleted and their sizes said.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from ..state.private_dirs import UNCOMMITTED_SUFFIX, UnusableDirError, beside, ensure_private_dir
from .job import DirRecord

KEEP_SETS = 3  # [checkpoint] keep_uncommitted's default


@dataclass
class SetAside:
    """What one `set_aside_uncommitted` did."""

    moved: list[str] = field(default_factory=list)  # relpaths moved into `folder`
    folder: Path | None = None  # the fresh set folder (None: nothing to move)
    dropped: list[tuple[str, int]] = field(default_factory=list)  # older sets deleted: (name, bytes)

    def __bool__(self) -> bool:
        return bool(self.moved or self.dropped)


def set_aside_uncommitted(ckpt_dir: Path, keep: Iterable[str], keep_sets: int = KEEP_SETS,
                          move: Callable[[Path, Path], None] = os.replace) -> SetAside:
    """Move every file of `ckpt_dir` that is not in `keep` into a fresh set folder of
    `<ckpt_dir>.uncommitted/` (private: 0700, the user's; a foreign one is refused), drop the
    folders left empty, and keep only the newest `keep_sets` sets there. `move`: the rename
    (a test passes one that, like rename() onto the same inode, does nothing)."""
    keep = set(keep)
    aside = beside(ckpt_dir, UNCOMMITTED_SUFFIX)
    done = SetAside()
    for dirpath, dirnames, filenames in os.walk(ckpt_dir, topdown=True):
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]  # moved, never followed
        dirnames[:] = [d for d in dirnames if d not in links]
        for name in (*filenames, *links):
            path = Path(dirpath, name)
            rel = path.relative_to(ckpt_dir).as_posix()
            if rel in keep:
                continue
            if done.folder is None:
                ensure_private_dir(aside, what="uncommitted dir", hint="; remove it")
                done.folder = _fresh_set(aside)
            dest = _dest(done.folder, rel)
            try:
                move(path, dest)
            except OSError as exc:
                raise _stuck(ckpt_dir, rel, exc.strerror or str(exc)) from None
            if os.path.lexists(path):  # rename() onto the same inode "succeeds" and moves nothing
                raise _stuck(ckpt_dir, rel, "it is still there after the move")
            done.moved.append(rel)
    for dirpath, _dirnames, _files in sorted(os.walk(ckpt_dir), key=lambda w: -len(w[0])):
        if Path(dirpath) != ckpt_dir:
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
    if done.folder is not None or os.path.isdir(aside):
        done.dropped = _prune(aside, keep_sets)
    return done


def _stuck(ckpt_dir: Path, rel: str, why: str) -> UnusableDirError:
    return UnusableDirError(f"cannot move {ckpt_dir / rel} (not this job's checkpoint) aside: {why}; the trainer "
                            "would see it, so this node does not start the job")


_SET_NAME = re.compile(r"\d{8}T\d{6}\.\d{9}Z-\d+(\.\d+)?")


def _fresh_set(aside: Path) -> Path:
    """A new, empty set folder named `<UTC time to the nanosecond>Z-<pid>`: names sort by time,
    and the name of a deleted set never comes back (a newer set never sorts before an older)."""
    ns = time.time_ns()
    stem = time.strftime("%Y%m%dT%H%M%S", time.gmtime(ns // 1_000_000_000)) + f".{ns % 1_000_000_000:09d}Z-{os.getpid()}"
    for n in range(1000):
        folder = aside / (stem if n == 0 else f"{stem}.{n}")
        try:
            os.mkdir(folder, 0o700)
            return folder
        except FileExistsError:
            continue
    raise UnusableDirError(f"cannot make a new set folder in {aside}: 1000 names taken")


def _is_set(name: str) -> bool:
    return _SET_NAME.fullmatch(name) is not None


def _prune(aside: Path, keep_sets: int) -> list[tuple[str, int]]:
    """Delete all but the newest `keep_sets` set folders of `aside` (names sort by time), and
    anything of the old flat layout; (name, bytes) of each deleted."""
    try:
        names = sorted(os.listdir(aside))
    except OSError:
        return []
    sets = [n for n in names if _is_set(n) and os.path.isdir(aside / n) and not os.path.islink(aside / n)]
    old = [n for n in names if n not in sets] + sets[: max(len(sets) - max(keep_sets, 1), 0)]
    dropped = []
    for name in old:
        path = aside / name
        size = _size(path)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                continue
        dropped.append((name, size))
    return dropped


def _size(path: Path) -> int:
    """Bytes of the files under `path` (links not followed)."""
    if not os.path.isdir(path) or os.path.islink(path):
        try:
            return os.lstat(path).st_size
        except OSError:
            return 0
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def _dest(folder: Path, rel: str) -> Path:
    """`folder/rel` with its directories made (the set folder is new: nothing is in the way)."""
    cur = folder
    for part in rel.split("/")[:-1]:
        cur = cur / part
        if not os.path.lexists(cur):
            os.mkdir(cur, 0o700)
    return folder / rel


def keep_own_files(ckpt_dir: Path, record: DirRecord, keep_sets: int = KEEP_SETS) -> SetAside:
    """No remote: keep the directory's files when its record says this job wrote them (an
    earlier attempt on this node), else move them all aside and record this job as their
    owner from now on. Returns what was moved."""
    if record.is_mine(record.read()):
        return SetAside()
    done = set_aside_uncommitted(ckpt_dir, (), keep_sets)
    record.write(manifest=None, files={})
    return done


def moved_message(ckpt_dir: Path, done: SetAside, why: str) -> str:
    """One line: what moved where, and which older sets went (with their sizes)."""
    parts = []
    if done.moved:
        parts.append(f"{len(done.moved)} file(s) {why} moved to {done.folder}/ (never shown to the job)")
    if done.dropped:
        total = sum(size for _name, size in done.dropped)
        parts.append(f"deleted {len(done.dropped)} older set(s) of {beside(ckpt_dir, UNCOMMITTED_SUFFIX)}/ "
                     f"({_human(total)}: " + ", ".join(f"{n} {_human(b)}" for n, b in done.dropped[:5])
                     + (", ..." if len(done.dropped) > 5 else "") + "; [checkpoint] keep_uncommitted keeps the newest)")
    return "; ".join(parts)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def moved_aside(ckpt_dir: Path, done: SetAside, say: Callable[[str], None], why: str) -> None:
    if done:
        say(moved_message(ckpt_dir, done, why))


def set_aside(ckpt_dir: Path, keep: Iterable[str], say: Callable[[str], None], keep_sets: int = KEEP_SETS) -> None:
    """`set_aside_uncommitted`, said in one line when it moved or deleted anything."""
    keep = set(keep)
    moved_aside(ckpt_dir, set_aside_uncommitted(ckpt_dir, keep, keep_sets), say,
                "not in the committed checkpoint" if keep else "not this job's")

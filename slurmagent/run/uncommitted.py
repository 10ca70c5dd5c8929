"""What a checkpoint directory may show the trainer at start: this job's checkpoint only.

Files an earlier job left at the same node-local path (`/mnt/localssd/ckpt` outlives jobs on a
VM), or a step folder nobody committed, are moved to `<dir>.uncommitted/` before the trainer
starts, single- and multi-node alike, on every attempt, the first included: never shown to
the trainer, never uploaded, never deleted. With a remote, "this job's checkpoint" is the
committed manifest; without one, the local directory is the only copy, so files the record
beside the directory says this job wrote (an earlier attempt of it) are kept, and any other
job's are moved aside.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Iterable

from ..state.private_dirs import UNCOMMITTED_SUFFIX, beside, ensure_private_dir
from .job import DirRecord


def set_aside_uncommitted(ckpt_dir: Path, keep: Iterable[str]) -> list[str]:
    """Move every file of `ckpt_dir` that is not in `keep` to `<ckpt_dir>.uncommitted/` (kept,
    never deleted; a later move replaces an older one), and drop the folders left empty.
    `<ckpt_dir>.uncommitted/` is private (0700, the user's; a foreign one is refused)."""
    keep = set(keep)
    aside = beside(ckpt_dir, UNCOMMITTED_SUFFIX)
    moved: list[str] = []
    for dirpath, dirnames, filenames in os.walk(ckpt_dir, topdown=True):
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]  # moved, never followed
        dirnames[:] = [d for d in dirnames if d not in links]
        for name in (*filenames, *links):
            path = Path(dirpath, name)
            rel = path.relative_to(ckpt_dir).as_posix()
            if rel in keep:
                continue
            if not moved:
                ensure_private_dir(aside, what="uncommitted dir", hint="; remove it")
            dest = _dest(aside, rel)
            if dest.is_dir() and not dest.is_symlink():
                shutil.rmtree(dest)
            os.replace(path, dest)
            moved.append(rel)
    for dirpath, _dirnames, _files in sorted(os.walk(ckpt_dir), key=lambda w: -len(w[0])):
        if Path(dirpath) != ckpt_dir:
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
    return moved


def _dest(aside: Path, rel: str) -> Path:
    """`aside/rel` with real directories on the way: a link or file an earlier move left
    where a folder is needed now is replaced, never followed."""
    cur = aside
    for part in rel.split("/")[:-1]:
        cur = cur / part
        if os.path.islink(cur) or (os.path.lexists(cur) and not cur.is_dir()):
            os.unlink(cur)
        if not os.path.lexists(cur):
            os.mkdir(cur, 0o700)
    return aside / rel


def keep_own_files(ckpt_dir: Path, record: DirRecord) -> list[str]:
    """No remote: keep the directory's files when its record says this job wrote them (an
    earlier attempt on this node), else move them all aside and record this job as their
    owner from now on. Returns what was moved."""
    if record.is_mine(record.read()):
        return []
    moved = set_aside_uncommitted(ckpt_dir, ())
    record.write(manifest=None, files={})
    return moved


def moved_message(ckpt_dir: Path, moved: list[str], why: str) -> str:
    return f"{len(moved)} file(s) {why} moved to {beside(ckpt_dir, UNCOMMITTED_SUFFIX)}/ (never shown to the job)"


def moved_aside(ckpt_dir: Path, moved: list[str], say: Callable[[str], None], why: str) -> None:
    if moved:
        say(moved_message(ckpt_dir, moved, why))


def set_aside(ckpt_dir: Path, keep: Iterable[str], say: Callable[[str], None]) -> None:
    """`set_aside_uncommitted`, said in one line when it moved anything."""
    keep = set(keep)
    moved_aside(ckpt_dir, set_aside_uncommitted(ckpt_dir, keep), say,
                "not in the committed checkpoint" if keep else "not this job's")

"""The trainer's word that a save is whole: `slurmagent.trainer.saved(paths, step=None)`.

The strongest evidence a commit can have (DESIGN "What a commit may hold"): after a save the
trainer names what it wrote. Each rank keeps its last `KEEP_PER_RANK` declarations in one
small file, `<ckpt_dir>/.slurmagent-saved/rank-<R>.json` (a reserved name: never synced, and
set aside with everything else at the next start), replaced atomically, so the syncer on the
rank's own node reads it -- the single-node wrapper or a multi-node job's node agent.

A declaration records each file as it was at the call (size, mtime, inode): a file rewritten
since no longer matches, so the declaration covers only the version the trainer vouched for.
A **set** is one call's files, or -- with `step` -- every rank's files of that step: a
step's set is whole when each of its files still matches on its writer's node, and a rank's
part is the files it named (in a step folder, a file nobody named means a rank has not said
yet). Sets go into a commit together or not at all (checkpoint/cut.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from .scan import RESERVED_PREFIX, is_in_progress_path

SAVED_DIR = RESERVED_PREFIX + "saved"
KEEP_PER_RANK = 16  # declarations a rank's file keeps (newest last): a few saves' worth
MAX_FILES_PER_SET = 100_000  # a declaration naming more is cut there (a folder of shards fits)
MAX_RANK_FILES = 4096  # rank files read per directory
MAX_BYTES = 16 << 20  # one rank file read at most


@dataclass(frozen=True)
class Declaration:
    rank: int
    seq: int  # the rank's call count: orders its declarations
    step: int | None
    files: dict[str, list[int]] = field(default_factory=dict)  # relpath -> [size, mtime_ns, inode] at the call

    @property
    def key(self) -> str:
        """The set it belongs to: every rank's files of one step, or this one call."""
        return f"step {self.step}" if self.step is not None else f"rank {self.rank} save {self.seq}"


def file_signature(path: str | os.PathLike) -> list[int] | None:
    """[size, mtime_ns, inode] of a file as a declaration records it (None: not there)."""
    try:
        st = os.lstat(path)
    except (OSError, ValueError):
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def declaration_files(ckpt_dir: str | os.PathLike, paths: Iterable[str | os.PathLike]) -> dict[str, list[int]]:
    """Relpath -> [size, mtime_ns, inode] of the files `paths` name (folders: every file below
    them), relative to `ckpt_dir`; paths outside it, temporaries and missing files are left out."""
    root = Path(os.path.abspath(ckpt_dir))
    out: dict[str, list[int]] = {}

    def add(path: Path) -> None:
        try:
            rel = path.relative_to(root).as_posix()
        except ValueError:
            return
        if rel in ("", ".") or is_in_progress_path(rel):
            return
        sig = file_signature(path)
        if sig is not None:
            out[rel] = sig

    for p in paths:
        path = Path(p)
        path = Path(os.path.abspath(path if path.is_absolute() else root / path))
        if path.is_dir() and not path.is_symlink():
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames.sort()
                for name in sorted(filenames):
                    if len(out) >= MAX_FILES_PER_SET:
                        return out
                    add(Path(dirpath, name))
        else:
            add(path)
    return out


def write_declarations(ckpt_dir: str | os.PathLike, rank: int, declarations: list[Declaration]) -> None:
    """Replace rank `rank`'s file with `declarations` (raises OSError: the trainer ignores it)."""
    folder = Path(ckpt_dir) / SAVED_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"rank-{int(rank)}.json"
    tmp = folder / f".rank-{int(rank)}.{os.getpid()}.tmp"
    body = json.dumps([{"rank": d.rank, "seq": d.seq, "step": d.step, "files": d.files} for d in declarations],
                      separators=(",", ":")).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_declarations(ckpt_dir: str | os.PathLike) -> list[Declaration]:
    """Every rank's declarations on this node; a malformed file (the job's own to write) is skipped."""
    out: list[Declaration] = []
    try:
        entries = os.scandir(Path(ckpt_dir) / SAVED_DIR)
    except OSError:
        return out
    with entries:
        for n, entry in enumerate(entries):
            if n >= MAX_RANK_FILES:
                break
            if not (entry.name.startswith("rank-") and entry.name.endswith(".json")):
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                with os.fdopen(fd, "rb") as fh:
                    out.extend(_parse(fh.read(MAX_BYTES + 1)))
            except (OSError, ValueError):
                continue
    return out


def _parse(raw: bytes) -> list[Declaration]:
    if len(raw) > MAX_BYTES:
        raise ValueError("too large")
    items = json.loads(raw)
    if not isinstance(items, list):
        raise ValueError("not a list")
    out = []
    for item in items:
        if not isinstance(item, dict) or not {"rank", "seq", "step", "files"} <= item.keys():
            raise ValueError("not a declaration")
        rank, seq, step, files = item["rank"], item["seq"], item["step"], item["files"]
        if not (type(rank) is int and type(seq) is int and (step is None or type(step) is int)
                and isinstance(files, dict)):
            raise ValueError("bad declaration")
        clean = {}
        for rel, st in files.items():
            if not (isinstance(rel, str) and isinstance(st, list) and len(st) == 3
                    and all(type(v) is int for v in st)):
                raise ValueError("bad file")
            clean[rel] = st
        out.append(Declaration(rank, seq, step, clean))
    return out


def declared_sets(declarations: Iterable[Declaration], before: Mapping[str, Mapping[str, list[int]]],
                  after: Mapping[str, Mapping[str, list[int]]]) -> list[list]:
    """[set key, [relpaths], whole] for this node, for its report: `whole` when every file is as
    declared both before and after this round's upload (`cut.unit_files`), so the bytes uploaded
    are the version the trainer vouched for. A rank's newer declaration of the same set wins; a
    declared file gone from the node (a rotated checkpoint) leaves its set, an emptied set goes."""
    def flat(units: Mapping[str, Mapping[str, list[int]]]) -> dict[str, list[int]]:
        return {rel: st for files in units.values() for rel, st in files.items()}

    b, a = flat(before), flat(after)
    newest: dict[tuple[str, int], Declaration] = {}
    for d in declarations:
        k = (d.key, d.rank)
        if k not in newest or d.seq > newest[k].seq:
            newest[k] = d
    vouched: dict[str, dict[str, list[list[int]]]] = {}  # set -> file -> versions some rank declared
    for (key, _rank), d in sorted(newest.items()):
        files = vouched.setdefault(key, {})
        for rel, st in d.files.items():
            if rel in b or rel in a:  # deleted (a rotated checkpoint): it leaves by the rotation rules
                files.setdefault(rel, []).append(st)
    # a file is as declared when it matches what one of the ranks said of it (two ranks of a node
    # may both name the node's folder, one of them before the other's file was done)
    return [[key, sorted(files), all(b.get(rel) in sts and a.get(rel) in sts for rel, sts in files.items())]
            for key, files in vouched.items() if files]

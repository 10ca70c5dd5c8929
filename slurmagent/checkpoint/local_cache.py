"""The node-local cache of committed blobs: a restart on a node that held the bytes reads no bucket.

After a sync or a restore, the files of the checkpoint are entered into a per-user directory
beside ``--ckpt-dir`` (default ``<parent of D>/.slurmagent-cache-<uid>``, mode 0700; or
``[checkpoint] local_cache_dir``), each under its content id (``blake3-<hex>``). An entry is a
hard link to the checkpoint's own file wherever the file system allows (no byte is stored
twice: while ``D`` still holds the file the entry costs nothing), else a copy. An entry is
taken by a restore only when its bytes are known to be the content id the manifest names (its
record below, else hashed now; a trainer that rewrote the file in place: the entry is dropped
and the blob comes from the bucket); a restore puts a taken entry in place by hard link too.

Verified once: the cache keeps a record (``.verified.json``: content id -> device, inode, size,
mtime) of each entry whose bytes are known to be its content id's, made when a sync enters a
file its hash cache vouches for, or when a take hashed the entry. A take whose entry still
matches its record links it without reading it again. This is the hash cache's own rule
(:mod:`slurmagent.checkpoint.hash_cache`), which the sync and the restore already trust for the
files of ``D``: a rewrite in place (``torch.save`` over the same path, through the shared hard
link) changes the mtime, a new file changes the inode; a record is made only when the entry's
mtime is older than ``RACY_WINDOW_S`` (a write in the same clock tick would not show). What it
does not catch, like the hash cache: a disk that flips bits under an unchanged inode, or a writer
that puts the old mtime back on purpose.

Bound: ``[checkpoint] local_cache_gib`` counts the bytes only the cache holds (entries whose
file ``D`` no longer names: a hard link count of 1); shared entries cost nothing on disk.
0 (the default): room for ``keep_commits`` checkpoints the size of the one at hand; a
negative value turns the cache off. The cache is trimmed before a restore stages anything and
after every sync: entries the checkpoint at hand does not name go first (oldest first), then
the largest.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

from . import hashing as checkpoint_hash
from .errors import CheckpointError
from .hash_cache import RACY_WINDOW_S
from .hashing import is_content_id
from .manifest import entry_content_id
from .scan import LocalFile
from ..state.private_dirs import ensure_private_dir

__all__ = ["BlobCache", "CACHE_PREFIX", "default_cache_dir", "open_cache"]

CACHE_PREFIX = ".slurmagent-cache-"
GiB = 1 << 30
TMP = ".tmp-"  # an entry being entered: never taken, removed by the next trim
RECORDS = ".verified.json"  # content id -> [dev, ino, size, mtime_ns] of entries known to hold it


def default_cache_dir(ckpt_dir: str | os.PathLike) -> Path:
    """``<parent of D>/.slurmagent-cache-<uid>``: the same file system as ``D`` (hard links work),
    outside it (never synced, kept when a job empties ``D``), one per user."""
    return Path(os.path.abspath(ckpt_dir)).parent / f"{CACHE_PREFIX}{os.geteuid()}"


def open_cache(ckpt_dir: str | os.PathLike, limit_gib: float, cache_dir: str | os.PathLike = "",
               warn: Callable[[str], None] | None = None, copies: int = 2) -> BlobCache | None:
    """The cache for ``ckpt_dir`` (created 0700), or None when it is off (``limit_gib`` < 0) or its
    directory cannot be used (said once through ``warn``: the restore goes on without it).
    ``limit_gib`` 0: room for ``copies`` checkpoints (see :meth:`BlobCache.fit`)."""
    if limit_gib is None or limit_gib < 0:
        return None
    root = Path(cache_dir) if cache_dir else default_cache_dir(ckpt_dir)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)  # a restore creates D's parents too
        ensure_private_dir(root, what="checkpoint cache dir")
    except Exception as exc:  # refused (another user's, a symlink) or not creatable: no cache, never a failure
        if warn is not None:
            warn(f"node-local checkpoint cache off: {exc}")
        return None
    return BlobCache(root, int(limit_gib * GiB), copies=copies)


@dataclass
class Entry:
    cid: str
    path: str
    size: int
    only_here: bool  # hard link count 1: bytes only the cache holds
    mtime: float


def file_name(cid: str) -> str:
    return cid.replace(":", "-")


class BlobCache:
    """Entries named by content id under ``root``, bounded by ``limit`` bytes only they hold."""

    def __init__(self, root: str | os.PathLike, limit: int, copies: int = 2) -> None:
        self.root = Path(root)
        self.limit = int(limit)
        self.auto = self.limit <= 0  # sized by the checkpoint at hand (fit)
        self.copies = max(1, copies)
        self.taken = 0  # files a restore took from here (verified: by their record, or hashed)
        self.taken_bytes = 0
        self.seconds = 0.0  # spent taking (hash checks and links), for the restore's line
        self.hashed = 0  # taken files whose bytes were read and hashed (the others matched their record)
        self.rejected: list[str] = []  # content ids dropped because their bytes no longer matched
        self._records: dict[str, list[int]] | None = None  # loaded on first use
        self._changed = False
        self._lock = threading.RLock()  # takes run a few at once

    def fit(self, checkpoint_bytes: int) -> None:
        """An automatic bound (``local_cache_gib`` 0) becomes room for ``copies`` checkpoints of
        ``checkpoint_bytes`` (the one being restored or synced); a set one stays."""
        if self.auto:
            self.limit = self.copies * max(0, int(checkpoint_bytes))

    def path_of(self, cid: str) -> str:
        return os.path.join(self.root, file_name(cid))

    def entries(self) -> list[Entry]:
        """What the cache holds now (entries being entered left out)."""
        out = []
        try:
            it = os.scandir(self.root)
        except OSError:
            return out
        with it:
            for d in it:
                if d.name.startswith(TMP):
                    continue
                algo, sep, hexd = d.name.partition("-")
                cid = f"{algo}:{hexd}"
                if not sep or not is_content_id(cid):
                    continue
                try:
                    st = d.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    out.append(Entry(cid, d.path, st.st_size, st.st_nlink <= 1, st.st_mtime))
        return out

    def ids(self) -> set[str]:
        return {e.cid for e in self.entries()}

    def held_bytes(self) -> int:
        """Bytes only the cache holds (what counts against the bound)."""
        return sum(e.size for e in self.entries() if e.only_here)

    def trim(self, keep: Iterable[str] = (), limit: int | None = None) -> int:
        """Remove entries until the bytes only the cache holds fit ``limit`` (default the bound):
        entries not in ``keep`` first, oldest first, then the largest. Half-entered ones always go.
        Returns the bytes freed."""
        limit = self.limit if limit is None else limit
        self._drop_tmp()
        entries = [e for e in self.entries() if e.only_here]
        held = sum(e.size for e in entries)
        keep = set(keep)
        order = sorted((e for e in entries if e.cid not in keep), key=lambda e: e.mtime) + sorted(
            (e for e in entries if e.cid in keep), key=lambda e: -e.size)
        freed = 0
        for e in order:
            if held <= limit:
                break
            try:
                os.unlink(e.path)
            except FileNotFoundError:
                pass
            held -= e.size
            freed += e.size
        return freed

    def _drop_tmp(self) -> None:
        try:
            names = [n for n in os.listdir(self.root) if n.startswith(TMP)]
        except OSError:
            return
        for n in names:
            try:
                os.unlink(os.path.join(self.root, n))
            except OSError:
                pass

    # -- verification records

    def records(self) -> dict[str, list[int]]:
        with self._lock:
            if self._records is None:
                self._records = self._read_records()
            return self._records

    def _read_records(self) -> dict[str, list[int]]:
        try:
            with open(os.path.join(self.root, RECORDS), "rb") as fh:
                raw = json.load(fh)
        except (OSError, ValueError):
            return {}
        got = raw.get("entries") if isinstance(raw, dict) else None
        if not isinstance(got, dict):
            return {}
        return {cid: v for cid, v in got.items() if is_content_id(cid) and isinstance(v, list) and len(v) == 4
                and all(isinstance(x, int) for x in v)}

    def record(self, cid: str, st: os.stat_result, at: float | None = None) -> None:
        """``cid``'s entry, as ``st`` shows it, holds exactly its content (checked at ``at``, now by
        default); not recorded when its mtime is too recent for a rewrite to show (racy)."""
        at = time.time() if at is None else at
        recs = self.records()
        with self._lock:
            if at - st.st_mtime_ns / 1e9 > RACY_WINDOW_S:
                recs[cid] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
            elif recs.pop(cid, None) is None:
                return
            self._changed = True

    def unchanged(self, cid: str, st: os.stat_result) -> bool:
        """Does the entry still look as it did when its bytes were last known to be ``cid``'s?"""
        return self.records().get(cid) == [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]

    def save_records(self) -> None:
        """Write the records (merged with what another process of this user wrote meanwhile),
        those of entries no longer there left out. A failure costs a hash on the next take."""
        with self._lock:
            if not self._changed or self._records is None:
                return
            merged = {**self._read_records(), **self._records}
            self._changed = False
        here = {e.cid for e in self.entries()}
        merged = {cid: v for cid, v in merged.items() if cid in here}
        tmp = os.path.join(self.root, f"{TMP}records-{os.getpid()}-{threading.get_ident()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump({"version": 1, "entries": merged}, fh)
            os.replace(tmp, os.path.join(self.root, RECORDS))
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass

    # -- entering

    def enter(self, path: str, entry: Mapping, expect: tuple[int, int, int] | None = None,
              verified: bool = True) -> bool:
        """Enter the file at ``path``, known to hold ``entry``'s content (checked on download, or
        hashed by a sync as ``expect``: (inode, size, mtime_ns)), by hard link, else by copy.
        A file that changed since (another inode, size or mtime) is not entered. ``verified``: its
        bytes are vouched for as they are now (a restore placed them, the hash cache holds them):
        the entry is recorded (see :meth:`record`), a take need not read it again."""
        cid = entry_content_id(entry)
        final = self.path_of(cid)
        if os.path.lexists(final):
            if verified:
                self._record_same(final, path, cid, expect)
            return True
        tmp = os.path.join(self.root, f"{TMP}{os.getpid()}-{file_name(cid)}")
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_size != entry["size"]:
                return False
            if expect is not None and (st.st_ino, st.st_size, st.st_mtime_ns) != tuple(expect):
                return False
            try:
                os.link(path, tmp, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                if self.held_bytes() + st.st_size > self.limit:
                    return False  # a copy would take room the bound does not give
                shutil.copyfile(path, tmp, follow_symlinks=False)
                copied = os.stat(tmp)
                if copied.st_size != st.st_size or os.stat(path).st_mtime_ns != st.st_mtime_ns:
                    raise OSError(errno.EAGAIN, "changed while copied")
            entered = os.lstat(tmp)
            if expect is not None and entered.st_mtime_ns != expect[2]:
                raise OSError(errno.EAGAIN, "changed while entered")
            os.rename(tmp, final)
            if verified:
                self.record(cid, entered)
            return True
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False

    def _record_same(self, final: str, path: str, cid: str, expect: tuple[int, int, int] | None) -> None:
        """An entry already there that is ``path`` itself (the same inode, as ``expect`` says):
        recorded as ``path`` is vouched for."""
        try:
            st, there = os.lstat(path), os.lstat(final)
        except OSError:
            return
        if (st.st_dev, st.st_ino) != (there.st_dev, there.st_ino) or not stat.S_ISREG(there.st_mode):
            return
        if expect is None or (st.st_ino, st.st_size, st.st_mtime_ns) == tuple(expect):
            self.record(cid, there)

    def enter_many(self, root: str | os.PathLike, files: Mapping[str, Mapping],
                   stats: Mapping[str, tuple[int, int, int]] | None = None) -> int:
        """Enter every regular file of ``files`` (relpath -> manifest entry) found under ``root``
        (vouched for: placed by a restore, or as ``stats`` says the hash cache holds it)."""
        n = 0
        for rel, entry in files.items():
            if "link" in entry:
                continue
            path = os.path.join(root, *rel.split("/"))
            if stats is not None and rel not in stats:
                continue  # not known to hold this content
            n += self.enter(path, entry, stats[rel] if stats is not None else None)
        return n

    # -- taking

    def take(self, entry: Mapping, dest: str, rel: str = "") -> bool:
        """Put the cached bytes of ``entry`` at ``dest`` (absent), hard link, else copy: an entry
        unchanged since its record as it is, any other hash-checked against the entry's content id
        first (and recorded). False (nothing at ``dest``) when the cache does not hold it or its
        bytes no longer match (the entry is dropped)."""
        cid = entry_content_id(entry)
        src = self.path_of(cid)
        try:
            st = os.lstat(src)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != entry["size"]:
            self.drop(cid)
            return False
        if not self.unchanged(cid, st):
            hashed_at = time.time()
            if not self.matches(src, st, entry, rel):
                self.drop(cid)
                return False
            self.record(cid, st, hashed_at)
            with self._lock:
                self.hashed += 1
        try:
            try:
                os.link(src, dest, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                shutil.copyfile(src, dest, follow_symlinks=False)
        except OSError:
            try:
                os.unlink(dest)
            except OSError:
                pass
            return False
        with self._lock:
            self.taken += 1
            self.taken_bytes += st.st_size
        return True

    @staticmethod
    def matches(path: str, st: os.stat_result, entry: Mapping, rel: str = "") -> bool:
        want_sha = not entry.get("blake3")
        f = LocalFile(rel or path, path, st.st_size, st.st_mtime_ns, st.st_ino)
        try:
            d = checkpoint_hash.hash_file(path, want_sha256=want_sha, expect=f, threads=4)[0]
        except (OSError, CheckpointError):
            return False
        if d.crc32c != entry["crc32c"]:
            return False
        return d.sha256 == entry["sha256"] if want_sha else d.blake3 == entry["blake3"]

    def drop(self, cid: str) -> None:
        try:
            os.unlink(self.path_of(cid))
        except FileNotFoundError:
            return
        except OSError:
            return
        with self._lock:
            if self.records().pop(cid, None) is not None:
                self._changed = True
            self.rejected.append(cid)

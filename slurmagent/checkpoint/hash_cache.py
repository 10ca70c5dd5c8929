"""The hash cache: a file's digest is computed once, and which blobs each remote holds.

Digests are cached in a small JSON state file kept *outside* the checkpoint
directory, keyed by ``(relpath, size, mtime_ns, inode)``: an unchanged file is
never read again.  A file whose mtime is within :data:`RACY_WINDOW_S` of the
moment it was hashed is not cached (the "racy git" rule).  The state file also
remembers which blobs a remote holds.  A missing or unreadable state file only
costs a re-hash.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Iterable, Mapping

from . import hashing as checkpoint_hash
from .errors import CheckpointError
from .hashing import FileDigest, is_content_id, is_crc32c_b64, is_hex_digest
from .scan import LocalFile
from ..state.fsutil import replace_private

__all__ = ["LocalState", "RACY_WINDOW_S", "STATE_VERSION", "state_file_for"]

STATE_VERSION = 2
RACY_WINDOW_S = 2.0


def state_file_for(ckpt_dir) -> Path:
    """Where the hash cache of ``ckpt_dir`` lives: beside it, never inside (the wrapper and a
    node agent must agree, so that what a restore records is what the next sync reads)."""
    return Path(str(ckpt_dir).rstrip("/") + ".sync-state.json")


class LocalState:
    """The hash cache and the blobs known to be on each remote, in one JSON file.

    The file must live outside the checkpoint directory (it would otherwise be
    synced, and it changes on every sync).  Thread-safe.  Format (``version`` 2;
    a version 1 file's sha256 entries are carried over)::

        {"version": 2, "ckpt_dir": "/abs/dir",
         "files": {"relpath": {"size": 1, "mtime_ns": 2, "ino": 3, "blake3": "..",
                               "sha256": "..", "crc32c": ".."}},
         "remote_blobs": {"gs://b/p": ["blake3:<hex>", "sha256:<hex>", ...]},
         "verified": {"gs://b/p": {"run": "<job id>/<attempt>", "ids": ["pack:<hex>", ...]}}}

    ``verified``: the objects a node agent's syncs saw in the bucket during one run (a new
    process every round), so each is checked once per run (``slurmagent.checkpoint.gcs.verify``).
    """

    def __init__(self, state_file: str | os.PathLike, ckpt_dir: str | os.PathLike) -> None:
        self.path = Path(state_file).absolute()
        self.ckpt_dir = Path(ckpt_dir).absolute()
        resolved_dir = self.ckpt_dir.resolve()
        resolved_state = self.path.resolve()
        if resolved_state == resolved_dir or resolved_dir in resolved_state.parents:
            raise CheckpointError(
                f"checkpoint state file {self.path} must be outside the checkpoint directory {self.ckpt_dir}"
            )
        self._lock = threading.Lock()
        self.files: dict[str, dict] = {}
        self.remote_blobs: dict[str, set[str]] = {}
        self.verified_runs: dict[str, tuple[str, set[str]]] = {}  # remote -> (run key, object ids)
        self.hashed_files = 0  # how many files were actually read by digest()
        self.hashed_bytes = 0
        self._load()

    def _load(self) -> None:
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return  # missing/corrupt cache: just hash again
        if not isinstance(raw, dict) or raw.get("version") not in (1, STATE_VERSION):
            return
        files = raw.get("files")
        if raw.get("ckpt_dir") == str(self.ckpt_dir) and isinstance(files, dict):
            for rel, e in files.items():
                if not (
                    isinstance(e, dict)
                    and isinstance(e.get("size"), int)
                    and isinstance(e.get("mtime_ns"), int)
                    and is_crc32c_b64(e.get("crc32c"))
                ):
                    continue
                b3, sha = e.get("blake3"), e.get("sha256")
                if (b3 is None and sha is None) or (b3 is not None and not is_hex_digest(b3)):
                    continue
                if sha is not None and not is_hex_digest(sha):
                    continue
                self.files[rel] = {k: e[k] for k in ("size", "mtime_ns", "ino", "blake3", "sha256", "crc32c") if k in e}
        remotes = raw.get("remote_blobs")
        if isinstance(remotes, dict):
            for url, ids in remotes.items():
                if isinstance(ids, list):
                    known = set()
                    for i in ids:
                        if is_hex_digest(i):  # version 1: bare sha256
                            known.add(f"sha256:{i}")
                        elif is_content_id(i):
                            known.add(i)
                    self.remote_blobs[url] = known
        verified = raw.get("verified")
        if isinstance(verified, dict):
            for url, v in verified.items():
                if isinstance(v, dict) and isinstance(v.get("run"), str) and isinstance(v.get("ids"), list):
                    self.verified_runs[url] = (v["run"], {i for i in v["ids"] if isinstance(i, str)})

    def cached(self, f: LocalFile, want_sha256: bool = False) -> FileDigest | None:
        """The cached digest of ``f`` when (relpath, size, mtime_ns, inode) match; else None."""
        with self._lock:
            e = self.files.get(f.relpath)
        if e is None or e["size"] != f.size or e["mtime_ns"] != f.mtime_ns:
            return None
        if "ino" in e and f.ino and e["ino"] != f.ino:
            return None
        if want_sha256 and not e.get("sha256"):
            return None
        if not want_sha256 and not e.get("blake3") and not e.get("sha256"):
            return None
        return FileDigest(crc32c=e["crc32c"], size=e["size"], blake3=e.get("blake3"), sha256=e.get("sha256"))

    def remember(self, f: LocalFile, d: FileDigest, st: os.stat_result, hashed_at: float) -> None:
        """Cache ``d`` for ``f`` unless its mtime is too close to ``hashed_at`` (racy window)."""
        with self._lock:
            self.hashed_files += 1
            self.hashed_bytes += d.size
            if hashed_at - st.st_mtime_ns / 1e9 > RACY_WINDOW_S:
                e = {"size": d.size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "crc32c": d.crc32c}
                if d.blake3:
                    e["blake3"] = d.blake3
                if d.sha256:
                    e["sha256"] = d.sha256
                self.files[f.relpath] = e
            else:
                self.files.pop(f.relpath, None)

    def seed(self, relpath: str, st: os.stat_result, entry: Mapping) -> None:
        """Record a file just written with known content (a restore): no re-hash on the next sync."""
        with self._lock:
            e = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "crc32c": entry["crc32c"]}
            for algo in ("blake3", "sha256"):
                if entry.get(algo):
                    e[algo] = entry[algo]
            # The content is known from the manifest, not from reading the file: the
            # racy-timestamp rule does not apply (a later rewrite changes mtime, size or inode).
            self.files[relpath] = e

    def digest(self, f: LocalFile, want_sha256: bool = False) -> FileDigest:
        """The digest of ``f``: from the cache when it matches, else read and hashed."""
        hit = self.cached(f, want_sha256)
        if hit is not None:
            return hit
        started = time.time()
        d, st, _ = checkpoint_hash.hash_file(f.path, want_sha256=want_sha256)
        self.remember(f, d, st, started)
        return d

    def known_blobs(self, remote: str) -> set[str]:
        with self._lock:
            return set(self.remote_blobs.get(remote, ()))

    def add_known_blobs(self, remote: str, ids: Iterable[str]) -> None:
        with self._lock:
            self.remote_blobs.setdefault(remote, set()).update(ids)

    def forget_blobs(self, remote: str, ids: Iterable[str]) -> None:
        """These blobs are not (or no longer) on ``remote``."""
        with self._lock:
            self.remote_blobs.get(remote, set()).difference_update(ids)

    def verified(self, remote: str, run: str) -> set[str]:
        """The objects seen on ``remote`` during run ``run`` (empty for another run)."""
        with self._lock:
            key, ids = self.verified_runs.get(remote, ("", set()))
            return set(ids) if run and key == run else set()

    def set_verified(self, remote: str, run: str, ids: Iterable[str]) -> None:
        with self._lock:
            self.verified_runs[remote] = (run, set(ids))

    def save(self, keep_relpaths: Iterable[str] | None = None, keep_blobs: Iterable[str] | None = None) -> None:
        """Write atomically.  ``keep_relpaths`` / ``keep_blobs`` prune entries of files/blobs no longer present."""
        with self._lock:
            files = self.files
            remotes = self.remote_blobs
            if keep_relpaths is not None:
                keep = set(keep_relpaths)
                files = {k: v for k, v in files.items() if k in keep}
            if keep_blobs is not None:
                live = set(keep_blobs)
                remotes = {u: s & live for u, s in remotes.items()}
            data = {
                "version": STATE_VERSION,
                "ckpt_dir": str(self.ckpt_dir),
                "files": files,
                "remote_blobs": {u: sorted(s) for u, s in remotes.items()},
            }
            if self.verified_runs:
                data["verified"] = {u: {"run": r, "ids": sorted(i)} for u, (r, i) in self.verified_runs.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_private(self.path, json.dumps(data, separators=(",", ":")))

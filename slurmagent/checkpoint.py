"""Checkpoint store, local part (stdlib only): scan, hash cache, manifest, remote URL.

The job-step wrapper (``slurmagent run``) gives the trainer a local directory
(``SLURMAGENT_CKPT_DIR``).  This module decides which files in it make up the
checkpoint, hashes them once, and describes a complete checkpoint as a
:class:`Manifest`.  The Cloud Storage side lives in :mod:`slurmagent.gcp.storage`.

Which files are part of a checkpoint (the "in-progress" rule)
-------------------------------------------------------------
The directory is scanned recursively.  A path is *skipped* when any of its
components (a directory on the way or the file name itself)

* starts with ``.slurmagent`` (slurmagent's own working files, e.g. the restore
  staging directory; other dotfiles such as DCP's ``.metadata`` are checkpoint files),
* ends with ``.tmp``, ``.part``, ``.partial`` or ``~`` (case-insensitive), or
* contains ``.tmp.`` (e.g. ``model.tmp.1234``, as written by many "write to a
  temporary name then rename" helpers).

Such names are what trainers use while a file is still being written; the
file joins the checkpoint once it is renamed to its final name.  Only regular
files are taken; a symlink to a regular file is read through (its content is
stored as a regular file), symlinks to directories are not followed, and
sockets, FIFOs and devices are ignored.

Hash cache
----------
Every file's sha256 and CRC32C are computed in one streamed pass and cached in
a small JSON state file kept *outside* the checkpoint directory, keyed by
``(relpath, size, mtime_ns)``: an unchanged file is never read again.  A file
whose mtime is within :data:`RACY_WINDOW_S` of the moment it was hashed is not
cached (the "racy git" rule: a same-size rewrite inside the file system's
timestamp granularity would otherwise go unnoticed); it is simply hashed
again next time.  The state file also remembers which content blobs a remote
already holds (see :class:`LocalState`).  A missing or unreadable state file
only costs a re-hash.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Protocol

from slurmagent.errors import SlurmagentError

__all__ = [
    "CheckpointError",
    "RemoteURLError",
    "ManifestError",
    "StaleAttemptError",
    "StorageUnavailableError",
    "RestoreError",
    "LocalChangedError",
    "Manifest",
    "LocalFile",
    "LocalState",
    "FileDigest",
    "is_in_progress_name",
    "no_progress_after",
    "is_in_progress_path",
    "scan_checkpoint_dir",
    "hash_file",
    "parse_remote",
    "MANIFEST_SCHEMA",
]

MANIFEST_SCHEMA = 1
STATE_VERSION = 1
RACY_WINDOW_S = 2.0
_READ_CHUNK = 4 * 1024 * 1024


# --------------------------------------------------------------------------- errors


class CheckpointError(SlurmagentError):
    """Base class of checkpoint-store failures (one line for the user)."""

    exit_code = 1


class RemoteURLError(CheckpointError):
    """The checkpoint remote is not a valid ``gs://BUCKET[/PREFIX]`` URL."""

    exit_code = 2


class ManifestError(CheckpointError):
    """A checkpoint manifest is not valid JSON or does not follow the schema."""


class StaleAttemptError(CheckpointError):
    """A newer attempt (restart) already owns the remote checkpoint; ours must not overwrite it."""


class StorageUnavailableError(CheckpointError):
    """Cloud Storage kept failing (transient errors) until the caller's deadline, or refused."""


class RestoreError(CheckpointError):
    """A checkpoint could not be restored (missing or corrupt blob); nothing was put in place."""


class LocalChangedError(CheckpointError):
    """A checkpoint file changed while it was being hashed or uploaded; sync again later."""


# ------------------------------------------------------------------- in-progress rule

_PARTIAL_SUFFIXES = (".tmp", ".part", ".partial", "~")


# Dotfiles that frameworks write as part of a checkpoint (DCP's index, written last by rank 0).
_CHECKPOINT_DOTFILES = frozenset({".metadata"})


def is_in_progress_name(name: str) -> bool:
    """True if one path component names something still being written (see module doc)."""
    low = name.lower()
    return low.startswith(".slurmagent") or low.endswith(_PARTIAL_SUFFIXES) or ".tmp." in low


def is_in_progress_path(relpath: str) -> bool:
    """True if any component of a ``/``-separated relative path is in progress."""
    return any(is_in_progress_name(part) for part in relpath.split("/"))


# ------------------------------------------------------------------------- scanning


@dataclass(frozen=True)
class LocalFile:
    relpath: str  # "/"-separated, relative to the checkpoint dir
    path: str  # absolute path
    size: int
    mtime_ns: int


def scan_checkpoint_dir(ckpt_dir: str | os.PathLike) -> list[LocalFile]:
    """Regular files of the checkpoint, in-progress names skipped, sorted by relpath.

    A missing directory is an empty checkpoint.
    """
    root = Path(ckpt_dir)
    out: list[LocalFile] = []

    def walk(dirpath: str, relprefix: str) -> None:
        try:
            it = os.scandir(dirpath)
        except FileNotFoundError:
            return
        with it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            if is_in_progress_name(entry.name):
                continue
            rel = f"{relprefix}{entry.name}"
            try:
                if entry.is_dir(follow_symlinks=False):
                    walk(entry.path, rel + "/")
                    continue
                st = os.stat(entry.path)  # follows a symlink to a file
            except FileNotFoundError:
                continue  # vanished (or dangling link)
            if stat.S_ISREG(st.st_mode):
                out.append(LocalFile(rel, os.path.abspath(entry.path), st.st_size, st.st_mtime_ns))

    walk(str(root), "")
    out.sort(key=lambda f: f.relpath)
    return out


# -------------------------------------------------------------------------- hashing


class Checksum(Protocol):  # google_crc32c.Checksum has this shape
    def update(self, data: bytes) -> None: ...

    def digest(self) -> bytes: ...


def _make_crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C_TABLE: list[int] | None = None


class PyCrc32c:
    """Pure-Python CRC32C (Castagnoli), the fallback when no C implementation is passed.

    Slow (a few MB/s): :mod:`slurmagent.gcp.storage` passes ``google_crc32c.Checksum``.
    """

    def __init__(self, data: bytes = b"") -> None:
        global _CRC32C_TABLE
        if _CRC32C_TABLE is None:
            _CRC32C_TABLE = _make_crc32c_table()
        self._crc = 0
        if data:
            self.update(data)

    def update(self, data: bytes) -> None:
        table = _CRC32C_TABLE
        crc = self._crc ^ 0xFFFFFFFF
        for b in bytes(data):
            crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
        self._crc = crc ^ 0xFFFFFFFF

    def digest(self) -> bytes:
        return self._crc.to_bytes(4, "big")


CrcFactory = Callable[[], Checksum]


@dataclass(frozen=True)
class FileDigest:
    sha256: str  # lowercase hex
    crc32c: str  # base64 of the big-endian 4-byte CRC32C, as GCS reports it
    size: int


def hash_file(path: str, crc32c_factory: CrcFactory = PyCrc32c) -> tuple[FileDigest, os.stat_result]:
    """Stream ``path`` once: sha256 + CRC32C.  Returns the digest and the stat taken before reading.

    Raises :class:`LocalChangedError` if size or mtime changed while reading and
    ``FileNotFoundError`` if the file vanished.
    """
    sha = hashlib.sha256()
    crc = crc32c_factory()
    size = 0
    with open(path, "rb", buffering=0) as fh:
        before = os.fstat(fh.fileno())
        while True:
            chunk = fh.read(_READ_CHUNK)
            if not chunk:
                break
            sha.update(chunk)
            crc.update(chunk)
            size += len(chunk)
    after = os.stat(path)
    if (
        size != before.st_size
        or after.st_size != before.st_size
        or after.st_mtime_ns != before.st_mtime_ns
        or after.st_ino != before.st_ino
    ):
        raise LocalChangedError(
            f"checkpoint file {path} changed while it was being hashed "
            "(write it under a temporary name, then rename); sync again later"
        )
    return FileDigest(sha.hexdigest(), base64.b64encode(crc.digest()).decode("ascii"), size), before


# ---------------------------------------------------------------------- local state


class LocalState:
    """The hash cache and the set of blobs known to be on each remote, in one JSON file.

    The file must live outside the checkpoint directory (it would otherwise be
    synced, and it changes on every sync).  Thread-safe for :meth:`digest`.
    Format (``version`` 1)::

        {"version": 1, "ckpt_dir": "/abs/dir",
         "files": {"relpath": {"size": 1, "mtime_ns": 2, "sha256": "..", "crc32c": ".."}},
         "remote_blobs": {"gs://b/p": ["<sha256>", ...]}}
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
        self.hashed_files = 0  # how many files were actually read by digest()
        self.hashed_bytes = 0
        self._load()

    def _load(self) -> None:
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return  # missing/corrupt cache: just hash again
        if not isinstance(raw, dict) or raw.get("version") != STATE_VERSION:
            return
        files = raw.get("files")
        if raw.get("ckpt_dir") == str(self.ckpt_dir) and isinstance(files, dict):
            for rel, e in files.items():
                if (
                    isinstance(e, dict)
                    and isinstance(e.get("size"), int)
                    and isinstance(e.get("mtime_ns"), int)
                    and _valid_sha256(e.get("sha256"))
                    and _valid_crc32c(e.get("crc32c"))
                ):
                    self.files[rel] = e
        remotes = raw.get("remote_blobs")
        if isinstance(remotes, dict):
            for url, shas in remotes.items():
                if isinstance(shas, list):
                    self.remote_blobs[url] = {s for s in shas if _valid_sha256(s)}

    def digest(self, f: LocalFile, crc32c_factory: CrcFactory = PyCrc32c) -> FileDigest:
        """The digest of ``f``: from the cache when (relpath, size, mtime_ns) match, else hashed."""
        with self._lock:
            e = self.files.get(f.relpath)
        if e is not None and e["size"] == f.size and e["mtime_ns"] == f.mtime_ns:
            return FileDigest(e["sha256"], e["crc32c"], e["size"])
        started = time.time()
        d, st = hash_file(f.path, crc32c_factory)
        with self._lock:
            self.hashed_files += 1
            self.hashed_bytes += d.size
            if started - st.st_mtime_ns / 1e9 > RACY_WINDOW_S:
                self.files[f.relpath] = {
                    "size": d.size,
                    "mtime_ns": st.st_mtime_ns,
                    "sha256": d.sha256,
                    "crc32c": d.crc32c,
                }
            else:
                self.files.pop(f.relpath, None)
        return d

    def known_blobs(self, remote: str) -> set[str]:
        with self._lock:
            return set(self.remote_blobs.get(remote, ()))

    def add_known_blobs(self, remote: str, shas: Iterable[str]) -> None:
        with self._lock:
            self.remote_blobs.setdefault(remote, set()).update(shas)

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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(data, fh, separators=(",", ":"))
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


# ------------------------------------------------------------------------- manifest

_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def _valid_sha256(v: object) -> bool:
    return isinstance(v, str) and _SHA256_RE.fullmatch(v) is not None


def _valid_crc32c(v: object) -> bool:
    if not isinstance(v, str):
        return False
    try:
        return len(base64.b64decode(v, validate=True)) == 4
    except (binascii.Error, ValueError):
        return False


def _relpath_problem(rel: object) -> str | None:
    if not isinstance(rel, str) or not rel:
        return "is not a non-empty string"
    if "\\" in rel or "\x00" in rel or rel.startswith("/"):
        return "is not a relative '/'-separated path"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "has an empty, '.' or '..' component"
    return None


def utc_now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Manifest:
    """A complete checkpoint: what ``PREFIX/manifest.json`` holds.

    JSON::

        {"schema": 1, "attempt": 2, "created": "2026-11-30T05:00:00Z",
         "files": {"step100/model.pt": {"sha256": "<64 hex>", "size": 123, "crc32c": "AAAAAA=="}}}

    ``attempt`` is the restart count of the job that wrote it (fencing: a lower
    attempt never overwrites a higher one); ``crc32c`` is base64 of the
    big-endian CRC32C as Cloud Storage reports it.  Unknown keys are ignored.

    A multi-node job's manifest also says how many nodes wrote it and which node
    indexes held each file (``"node_count": 2, "writers": {"rank1.pt": [1]}``), so a
    restore can give each node only its own files (``--restore-scope node``).
    """

    attempt: int
    created: str = field(default_factory=utc_now_rfc3339)
    files: dict[str, dict] = field(default_factory=dict)
    node_count: int = 0  # 0: a single-node checkpoint (no writers recorded)
    writers: dict[str, list[int]] = field(default_factory=dict)
    no_progress: int = 0  # restarts in a row whose committed files equal the restored ones

    @property
    def total_bytes(self) -> int:
        return sum(e["size"] for e in self.files.values())

    def to_json(self) -> str:
        body: dict = {"schema": MANIFEST_SCHEMA, "attempt": self.attempt, "created": self.created, "files": self.files}
        if self.node_count:
            body.update(node_count=self.node_count, writers=self.writers)
        if self.no_progress:
            body["no_progress"] = self.no_progress
        return json.dumps(body, sort_keys=True, indent=1)

    def same_content(self, files: dict[str, dict]) -> bool:
        """Same file names with the same content hashes (sizes and CRCs follow from them)."""
        return {k: e["sha256"] for k, e in self.files.items()} == {k: e["sha256"] for k, e in files.items()}

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "manifest") -> "Manifest":
        """Parse and validate; any problem is a :class:`ManifestError` naming ``source`` and the field."""

        def bad(why: str) -> ManifestError:
            return ManifestError(f"malformed checkpoint manifest {source}: {why}")

        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad(f"not JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise bad("not a JSON object")
        if raw.get("schema") != MANIFEST_SCHEMA:
            raise bad(f"unsupported schema {raw.get('schema')!r} (expected {MANIFEST_SCHEMA})")
        attempt = raw.get("attempt")
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
            raise bad(f"attempt {attempt!r} is not an integer >= 0")
        created = raw.get("created")
        if not isinstance(created, str):
            raise bad("created is missing or not a string")
        try:
            dt = datetime.fromisoformat(created.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise bad(f"created {created!r} is not an RFC 3339 time") from None
        if dt.tzinfo is None:
            raise bad(f"created {created!r} has no time zone")
        files = raw.get("files")
        if not isinstance(files, dict):
            raise bad("files is missing or not an object")
        clean: dict[str, dict] = {}
        for rel, e in files.items():
            problem = _relpath_problem(rel)
            if problem:
                raise bad(f"file name {rel!r} {problem}")
            if not isinstance(e, dict):
                raise bad(f"files[{rel!r}] is not an object")
            if not _valid_sha256(e.get("sha256")):
                raise bad(f"files[{rel!r}].sha256 is not 64 lowercase hex digits")
            size = e.get("size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise bad(f"files[{rel!r}].size is not an integer >= 0")
            if not _valid_crc32c(e.get("crc32c")):
                raise bad(f"files[{rel!r}].crc32c is not base64 of 4 bytes")
            clean[rel] = {"sha256": e["sha256"], "size": size, "crc32c": e["crc32c"]}
        node_count = raw.get("node_count", 0)
        if not isinstance(node_count, int) or isinstance(node_count, bool) or node_count < 0:
            raise bad(f"node_count {node_count!r} is not an integer >= 0")
        writers = raw.get("writers", {}) if node_count else {}
        if not isinstance(writers, dict):
            raise bad("writers is not an object")
        for rel, nodes in writers.items():
            if rel not in clean:
                raise bad(f"writers names {rel!r}, which is not in files")
            if not isinstance(nodes, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < node_count for i in nodes
            ):
                raise bad(f"writers[{rel!r}] is not a list of node indexes below node_count {node_count}")
        no_progress = raw.get("no_progress", 0)
        if not isinstance(no_progress, int) or isinstance(no_progress, bool) or no_progress < 0:
            raise bad(f"no_progress {no_progress!r} is not an integer >= 0")
        return cls(attempt=attempt, created=created, files=clean, node_count=node_count,
                   writers={rel: sorted(set(nodes)) for rel, nodes in writers.items()}, no_progress=no_progress)


def no_progress_after(restored: Manifest | None, files: dict[str, dict]) -> int:
    """The no-progress streak of a manifest committing ``files`` in an attempt that restored
    ``restored``: 0 when the attempt changed the checkpoint (or started without one), else one
    more than the restored manifest's streak. The wrapper's requeue budget is read from it."""
    if restored is None or not restored.same_content(files):
        return 0
    return restored.no_progress + 1


# ------------------------------------------------------------------------ remote URL

# Bucket names: https://cloud.google.com/storage/docs/buckets#naming
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")


def parse_remote(url: str) -> tuple[str, str]:
    """``gs://BUCKET[/PREFIX]`` -> ``(bucket, prefix)``; the prefix has no leading/trailing ``/``.

    Raises :class:`RemoteURLError` (one line) for anything else.
    """

    def bad(why: str) -> RemoteURLError:
        return RemoteURLError(f"bad checkpoint remote {url!r}: {why} (expected gs://BUCKET/PREFIX)")

    if not isinstance(url, str) or not url:
        raise bad("empty")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        raise bad("contains control characters")
    if not url.startswith("gs://"):
        raise bad("must start with gs://")
    rest = url[len("gs://") :]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise bad("no bucket name")
    if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket or (len(bucket) > 63 and "." not in bucket):
        raise bad(f"invalid bucket name {bucket!r}")
    if any(len(part) > 63 for part in bucket.split(".")):
        raise bad(f"invalid bucket name {bucket!r}")
    prefix = prefix.strip("/")
    if prefix:
        if any(part in ("", ".", "..") for part in prefix.split("/")):
            raise bad("prefix has an empty, '.' or '..' component")
        if "#" in prefix or "?" in prefix or "*" in prefix or "[" in prefix:
            raise bad("prefix contains one of # ? * [")
        if len(prefix.encode("utf-8")) > 900:
            raise bad("prefix is too long")
    return bucket, prefix

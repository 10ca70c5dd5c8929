"""Checkpoint store, local part: which files make a checkpoint, their content ids, the manifest.

The job-step wrapper (``slurmagent run``) gives the trainer a local directory
(``SLURMAGENT_CKPT_DIR``).  This module decides which entries of it make up the
checkpoint, hashes them once, and describes a complete checkpoint as a
:class:`Manifest`.  The Cloud Storage side lives in :mod:`slurmagent.gcp.storage`.

Which entries are part of a checkpoint
--------------------------------------
Everything a framework writes, dotfiles included (DCP's ``.metadata``, zarr's
``.zarray``), except

* *temporary names*, i.e. files still being written (:func:`is_temporary_name`):
  a name ending in ``.tmp``, ``.temp``, ``.part``, ``.partial``, ``.swp``, ``~``
  or ``.__lock`` (TensorStore), containing ``.tmp.`` (``model.tmp.1234``) or
  ``.orbax-checkpoint-tmp-`` (Orbax's step directory before its rename), or
  Python's ``tempfile`` default ``tmpXXXXXXXX``.  The file joins the checkpoint
  once it is renamed to its final name;
* slurmagent's own working files: any name starting with :data:`RESERVED_PREFIX`
  (``.slurmagent-``), e.g. the restore staging directory;
* sockets, FIFOs and devices.

A symlink is never followed.  One that leads, inside the directory, to a file
or directory of the checkpoint (Lightning's ``save_last="link"``) is kept as a
link: the manifest records its target relative to the link's directory and a
restore recreates the link.  One that leads outside (or nowhere) is left out.
Every entry left out, except slurmagent's own, is reported once through the
``on_skip`` callback; nothing is dropped silently.

Names: one rule (:func:`name_problem`) decides what a manifest may hold; the
scan leaves out (and reports) what the rule refuses, and a restore refuses a
manifest breaking it, so a synced checkpoint is always restorable.

Content ids
-----------
A file's content id is ``blake3:<hex>`` (BLAKE3 of its bytes, as ``b3sum``
prints it).  Manifests written before BLAKE3 name contents ``sha256:<hex>``;
they stay readable and restorable, and a file that still matches such an entry
keeps it (no re-upload after an upgrade).  Every file's CRC32C (what Cloud
Storage checks) is computed in the same read.

Hash cache
----------
Digests are cached in a small JSON state file kept *outside* the checkpoint
directory, keyed by ``(relpath, size, mtime_ns, inode)``: an unchanged file is
never read again.  A file whose mtime is within :data:`RACY_WINDOW_S` of the
moment it was hashed is not cached (the "racy git" rule).  The state file also
remembers which blobs a remote holds.  A missing or unreadable state file only
costs a re-hash.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import posixpath
import re
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Mapping, Protocol

from slurmagent.errors import SlurmagentError

__all__ = [
    "CheckpointError",
    "RemoteURLError",
    "ManifestError",
    "StaleAttemptError",
    "StorageUnavailableError",
    "SyncDeadlineError",
    "RestoreError",
    "LocalChangedError",
    "Manifest",
    "LocalFile",
    "LocalState",
    "FileDigest",
    "CheckpointLag",
    "RESERVED_PREFIX",
    "is_temporary_name",
    "is_reserved_name",
    "is_in_progress_name",
    "is_in_progress_path",
    "name_problem",
    "scan_checkpoint_dir",
    "hash_file",
    "entry_content_id",
    "parent_dirs",
    "no_progress_after",
    "crc32c_combine",
    "checkpoint_lag",
    "parse_remote",
    "MANIFEST_SCHEMA",
]

MANIFEST_SCHEMA = 2  # 1: sha256 entries only (still read); 2: + blake3 and link entries
STATE_VERSION = 2
RACY_WINDOW_S = 2.0
RESERVED_PREFIX = ".slurmagent-"
HASH_BUFFER = 8 * 1024 * 1024  # read size of the hashing pass of a large file
_SMALL_READ = 1024 * 1024

SkipCallback = Callable[[str, str], None]  # (relpath, why)


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


class SyncDeadlineError(StorageUnavailableError):
    """A sync or restore did not finish within its deadline; what was left is named.

    ``unfinished``: relpaths not transferred; ``unfinished_bytes``: their size.
    """

    def __init__(self, message: str, unfinished: Iterable[str] = (), unfinished_bytes: int = 0) -> None:
        super().__init__(message)
        self.unfinished = tuple(unfinished)
        self.unfinished_bytes = unfinished_bytes


class RestoreError(CheckpointError):
    """A checkpoint could not be restored (missing or corrupt blob); nothing was put in place."""


class LocalChangedError(CheckpointError):
    """A checkpoint file changed while it was being hashed or uploaded; sync again later."""


# ------------------------------------------------------------------------ name rules

_TEMP_SUFFIXES = (".tmp", ".temp", ".part", ".partial", ".swp", "~", ".__lock")
_TEMP_INFIXES = (".tmp.", ".orbax-checkpoint-tmp-")
_MKSTEMP_RE = re.compile(r"tmp[a-z0-9_]{8}")  # tempfile's default names


def is_temporary_name(name: str) -> bool:
    """True if one path component names something still being written (see module doc)."""
    low = name.lower()
    return (
        low.endswith(_TEMP_SUFFIXES)
        or any(infix in low for infix in _TEMP_INFIXES)
        or _MKSTEMP_RE.fullmatch(name) is not None
    )


def is_reserved_name(name: str) -> bool:
    """True for slurmagent's own working files inside a checkpoint directory (never synced)."""
    return name.startswith(RESERVED_PREFIX)


def is_in_progress_name(name: str) -> bool:
    """True if one path component is left out of a checkpoint: temporary or slurmagent's own."""
    return is_temporary_name(name) or is_reserved_name(name)


def is_in_progress_path(relpath: str) -> bool:
    """True if any component of a ``/``-separated relative path is left out."""
    return any(is_in_progress_name(part) for part in relpath.split("/"))


def name_problem(relpath: object) -> str | None:
    """Why ``relpath`` cannot be a name in a checkpoint manifest, or None when it can.

    The one rule shared by sync (which leaves such a file out, with a warning)
    and restore (which refuses such a manifest).  Any byte but ``/`` and NUL is
    allowed in a component (backslashes included: on Linux they are ordinary
    characters); a name must be relative, without empty, ``.`` or ``..``
    components, and not one of slurmagent's reserved names.
    """
    if not isinstance(relpath, str) or not relpath:
        return "is not a non-empty string"
    if "\x00" in relpath or relpath.startswith("/"):
        return "is not a relative '/'-separated path"
    parts = relpath.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "has an empty, '.' or '..' component"
    if any(is_reserved_name(part) for part in parts):
        return f"uses slurmagent's reserved prefix {RESERVED_PREFIX!r}"
    try:
        os.fsencode(relpath)
    except UnicodeError:
        return "cannot be encoded as a file name"
    return None


def _link_problem(relpath: str, target: object) -> str | None:
    """Why a link entry ``relpath -> target`` cannot be restored inside the directory."""
    if not isinstance(target, str) or not target or "\x00" in target or target.startswith("/"):
        return "link target is not a relative path"
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(relpath), target))
    if resolved in (".", "") or resolved == ".." or resolved.startswith("../") or resolved.startswith("/"):
        return "link target leads outside the checkpoint"
    if name_problem(resolved):
        return f"link target {resolved!r} {name_problem(resolved)}"
    return None


# ------------------------------------------------------------------------- scanning


@dataclass(frozen=True, slots=True)
class LocalFile:
    """One entry of the checkpoint directory: a regular file, or a kept symlink (``link``)."""

    relpath: str  # "/"-separated, relative to the checkpoint dir
    path: str  # absolute path
    size: int
    mtime_ns: int
    ino: int = 0
    link: str | None = None  # a kept symlink: its target, relative to the link's directory

    @property
    def is_link(self) -> bool:
        return self.link is not None


def scan_checkpoint_dir(ckpt_dir: str | os.PathLike, on_skip: SkipCallback | None = None) -> list[LocalFile]:
    """Regular files and kept symlinks of the checkpoint, sorted by relpath (see module doc).

    ``on_skip(relpath, why)`` hears about every entry left out except
    slurmagent's own.  A missing directory is an empty checkpoint.  Nothing is
    followed through a symlink.
    """
    root = os.path.abspath(os.fspath(ckpt_dir))
    real_root = os.path.realpath(root)
    out: list[LocalFile] = []
    links: list[tuple[str, str, os.stat_result]] = []  # (rel, abs path, lstat)

    def skip(rel: str, why: str) -> None:
        if on_skip is not None:
            on_skip(rel, why)

    def walk(dirpath: str, relprefix: str) -> None:
        try:
            with os.scandir(dirpath) as it:
                entries = sorted(it, key=lambda e: e.name)
        except FileNotFoundError:
            return
        except NotADirectoryError:
            return
        except OSError as exc:
            if relprefix:
                skip(relprefix, f"unreadable directory ({exc.strerror or exc})")
                return
            raise CheckpointError(f"cannot read checkpoint directory {root}: {exc.strerror or exc}") from None
        for entry in entries:
            rel = f"{relprefix}{entry.name}"
            if is_reserved_name(entry.name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # vanished since the listing
            except OSError as exc:
                skip(rel, f"unreadable ({exc.strerror or exc})")
                continue
            if stat.S_ISDIR(st.st_mode):
                if is_temporary_name(entry.name):
                    skip(rel + "/", "a temporary name (still being written); it joins once renamed")
                else:
                    walk(entry.path, rel + "/")
                continue
            if is_temporary_name(entry.name):
                skip(rel, "a temporary name (still being written); it joins once renamed")
                continue
            problem = name_problem(rel)
            if problem:
                skip(rel, f"name {problem}")
                continue
            if stat.S_ISLNK(st.st_mode):
                links.append((rel, entry.path, st))
            elif stat.S_ISREG(st.st_mode):
                out.append(LocalFile(rel, entry.path, st.st_size, st.st_mtime_ns, st.st_ino))
            else:
                skip(rel, "not a regular file (socket, FIFO or device)")

    walk(root, "")
    kept_dirs = {d for f in out for d in parent_dirs(f.relpath)}
    kept_files = {f.relpath for f in out}
    for rel, path, st in links:
        target, why = _inside_target(real_root, path)
        if target is None:
            skip(rel, why)
            continue
        if target not in kept_files and target not in kept_dirs:
            skip(rel, f"a symlink to {target!r}, which is not part of the checkpoint")
            continue
        link_text = posixpath.relpath(target, posixpath.dirname(rel) or ".")
        out.append(LocalFile(rel, path, 0, st.st_mtime_ns, st.st_ino, link=link_text))
    out.sort(key=lambda f: f.relpath)
    return out


def parent_dirs(relpath: str) -> list[str]:
    """The directories on the way to ``relpath``: "a/b/c" -> ["a", "a/b"]."""
    parts = relpath.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _inside_target(real_root: str, link_path: str) -> tuple[str | None, str]:
    """(the relpath a symlink finally leads to, "") when that is inside ``real_root``; else (None, why).

    Only link texts are read (``realpath``), never the target's content.
    """
    try:
        resolved = os.path.realpath(link_path, strict=True)
    except (OSError, RuntimeError):
        return None, "a symlink leading nowhere (dangling or a loop)"
    base = real_root.rstrip("/") + "/"
    if not resolved.startswith(base):
        return None, "a symlink leading outside the checkpoint directory (not followed)"
    rel = resolved[len(base) :]
    if is_in_progress_path(rel) or name_problem(rel):
        return None, f"a symlink to {rel!r}, which is not part of the checkpoint"
    return rel, ""


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
    """Pure-Python CRC32C (Castagnoli), the fallback when google_crc32c is missing (slow)."""

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


def default_crc32c_factory() -> CrcFactory:
    """google_crc32c's C implementation when installed (it is a google-cloud-storage dependency)."""
    try:
        import google_crc32c

        return google_crc32c.Checksum
    except ImportError:  # pragma: no cover
        return PyCrc32c


def _gf2_times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (zlib's crc32_combine method).

    Lets parallel ranged transfers verify a whole file from the CRCs of its parts.
    """
    if len2 <= 0:
        return crc1
    odd = [0x82F63B78] + [1 << n for n in range(31)]  # operator for one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def crc32c_b64(value: int) -> str:
    """Cloud Storage's form of a CRC32C: base64 of the 4 big-endian bytes."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def crc32c_int(b64: str) -> int:
    return int.from_bytes(base64.b64decode(b64), "big")


EMPTY_CRC32C = "AAAAAA=="


@dataclass(frozen=True, slots=True)
class FileDigest:
    """What a file's bytes are: content id(s), CRC32C (base64, as GCS reports it) and size."""

    crc32c: str
    size: int
    blake3: str | None = None  # lowercase hex
    sha256: str | None = None  # lowercase hex; only when a legacy manifest entry needed it

    @property
    def content_id(self) -> str:
        """``blake3:<hex>``, or ``sha256:<hex>`` for a digest from a legacy cache entry."""
        if self.blake3:
            return f"blake3:{self.blake3}"
        return f"sha256:{self.sha256}"

    def entry(self, content_id: str | None = None) -> dict:
        """The manifest entry for this content under ``content_id`` (default :attr:`content_id`)."""
        algo, _, hexd = (content_id or self.content_id).partition(":")
        return {algo: hexd, "size": self.size, "crc32c": self.crc32c}


def blake3_hex(data: bytes) -> str:
    import blake3

    return blake3.blake3(data).hexdigest()


def _blake3(threads: int = 1):
    import blake3

    if threads > 1:
        return blake3.blake3(max_threads=threads)
    return blake3.blake3()


def open_nofollow(path: str) -> int:
    """Open a checkpoint file for reading without following a symlink in its last component.

    Raises :class:`LocalChangedError` if it is no longer a regular file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LocalChangedError(f"checkpoint file {path} is no longer a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _changed(path: str) -> LocalChangedError:
    return LocalChangedError(
        f"checkpoint file {path} changed while it was being read "
        "(write it under a temporary name, then rename); sync again later"
    )


def hash_file(
    path: str,
    crc32c_factory: CrcFactory | None = None,
    *,
    want_sha256: bool = False,
    expect: LocalFile | None = None,
    keep_bytes: int = 0,
    threads: int = 1,
) -> tuple[FileDigest, os.stat_result, bytes | None]:
    """Read ``path`` once: BLAKE3 + CRC32C (+ SHA-256 when ``want_sha256``).

    Returns the digest, the stat taken before reading, and the bytes themselves
    when the file is at most ``keep_bytes`` long (so a small file is uploaded
    from memory, read once).  ``expect``: the scan's view of the file; a
    different inode/size/mtime is a :class:`LocalChangedError`, as is a change
    during the read.  ``threads`` > 1 hashes chunks of a large file in parallel.
    Raises ``FileNotFoundError`` if it vanished, ``PermissionError``/``OSError``
    if it cannot be read; a symlink is never followed.
    """
    crc = (crc32c_factory or default_crc32c_factory())()
    fd = open_nofollow(path)
    try:
        before = os.fstat(fd)
        if expect is not None and (
            before.st_ino != expect.ino or before.st_size != expect.size or before.st_mtime_ns != expect.mtime_ns
        ):
            raise _changed(path)
        size = before.st_size
        b3 = _blake3(threads if size >= 4 * HASH_BUFFER else 1)
        sha = hashlib.sha256() if want_sha256 else None
        kept: bytes | None = None
        if size <= keep_bytes:
            chunks = []
            read_size = 0
            while True:
                chunk = os.read(fd, size - read_size + 1)
                if not chunk:
                    break
                chunks.append(chunk)
                read_size += len(chunk)
                if read_size > size:
                    raise _changed(path)
            kept = b"".join(chunks)
            for hasher in (b3, crc, sha):
                if hasher is not None and kept:
                    hasher.update(kept)
        else:
            read_size = 0
            while True:
                chunk = os.read(fd, HASH_BUFFER)
                if not chunk:
                    break
                for hasher in (b3, crc, sha):
                    if hasher is not None:
                        hasher.update(chunk)
                read_size += len(chunk)
                if read_size > size:
                    raise _changed(path)
                del chunk
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if read_size != size or after.st_size != size or after.st_mtime_ns != before.st_mtime_ns:
        raise _changed(path)
    digest = FileDigest(
        crc32c=base64.b64encode(crc.digest()).decode("ascii"),
        size=size,
        blake3=b3.hexdigest(),
        sha256=sha.hexdigest() if sha is not None else None,
    )
    return digest, before, kept


# ---------------------------------------------------------------------- local state


class LocalState:
    """The hash cache and the blobs known to be on each remote, in one JSON file.

    The file must live outside the checkpoint directory (it would otherwise be
    synced, and it changes on every sync).  Thread-safe.  Format (``version`` 2;
    a version 1 file's sha256 entries are carried over)::

        {"version": 2, "ckpt_dir": "/abs/dir",
         "files": {"relpath": {"size": 1, "mtime_ns": 2, "ino": 3, "blake3": "..",
                               "sha256": "..", "crc32c": ".."}},
         "remote_blobs": {"gs://b/p": ["blake3:<hex>", "sha256:<hex>", ...]}}
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
        if not isinstance(raw, dict) or raw.get("version") not in (1, STATE_VERSION):
            return
        files = raw.get("files")
        if raw.get("ckpt_dir") == str(self.ckpt_dir) and isinstance(files, dict):
            for rel, e in files.items():
                if not (
                    isinstance(e, dict)
                    and isinstance(e.get("size"), int)
                    and isinstance(e.get("mtime_ns"), int)
                    and _valid_crc32c(e.get("crc32c"))
                ):
                    continue
                b3, sha = e.get("blake3"), e.get("sha256")
                if (b3 is None and sha is None) or (b3 is not None and not _valid_hex(b3)):
                    continue
                if sha is not None and not _valid_hex(sha):
                    continue
                self.files[rel] = {k: e[k] for k in ("size", "mtime_ns", "ino", "blake3", "sha256", "crc32c") if k in e}
        remotes = raw.get("remote_blobs")
        if isinstance(remotes, dict):
            for url, ids in remotes.items():
                if isinstance(ids, list):
                    known = set()
                    for i in ids:
                        if _valid_hex(i):  # version 1: bare sha256
                            known.add(f"sha256:{i}")
                        elif _valid_content_id(i):
                            known.add(i)
                    self.remote_blobs[url] = known

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

    def digest(self, f: LocalFile, crc32c_factory: CrcFactory | None = None, want_sha256: bool = False) -> FileDigest:
        """The digest of ``f``: from the cache when it matches, else read and hashed."""
        hit = self.cached(f, want_sha256)
        if hit is not None:
            return hit
        started = time.time()
        d, st, _ = hash_file(f.path, crc32c_factory, want_sha256=want_sha256)
        self.remember(f, d, st, started)
        return d

    def known_blobs(self, remote: str) -> set[str]:
        with self._lock:
            return set(self.remote_blobs.get(remote, ()))

    def add_known_blobs(self, remote: str, ids: Iterable[str]) -> None:
        with self._lock:
            self.remote_blobs.setdefault(remote, set()).update(ids)

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

_HEX64_RE = re.compile(r"[0-9a-f]{64}")
_CONTENT_ALGOS = ("blake3", "sha256")


def _valid_hex(v: object) -> bool:
    return isinstance(v, str) and _HEX64_RE.fullmatch(v) is not None


_valid_sha256 = _valid_hex


def _valid_content_id(v: object) -> bool:
    if not isinstance(v, str):
        return False
    algo, _, hexd = v.partition(":")
    return algo in _CONTENT_ALGOS and _valid_hex(hexd)


def _valid_crc32c(v: object) -> bool:
    if not isinstance(v, str):
        return False
    try:
        return len(base64.b64decode(v, validate=True)) == 4
    except (binascii.Error, ValueError):
        return False


def entry_content_id(entry: Mapping) -> str:
    """``blake3:<hex>`` / ``sha256:<hex>`` for a file entry, ``link:<target>`` for a link."""
    if "link" in entry:
        return f"link:{entry['link']}"
    for algo in _CONTENT_ALGOS:
        if entry.get(algo):
            return f"{algo}:{entry[algo]}"
    raise ValueError(f"manifest entry without a content id: {entry!r}")


def utc_now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Manifest:
    """A complete checkpoint: what ``PREFIX/manifest.json`` holds.

    JSON (schema 2; schema 1, written before BLAKE3, has sha256 entries only)::

        {"schema": 2, "attempt": 2, "created": "2026-11-30T05:00:00Z",
         "files": {"step100/model.pt": {"blake3": "<64 hex>", "size": 123, "crc32c": "AAAAAA=="},
                   "step100/.metadata": {"blake3": "<64 hex>", "size": 9, "crc32c": "AAAAAA==",
                                         "pack": "<64 hex>", "offset": 4096},
                   "old.pt": {"sha256": "<64 hex>", "size": 5, "crc32c": "AAAAAA=="},
                   "last.ckpt": {"link": "step100/model.pt"}}}

    ``attempt`` is the restart count of the job that wrote it (fencing: a lower
    attempt never overwrites a higher one); ``crc32c`` is base64 of the
    big-endian CRC32C as Cloud Storage reports it.  A file's bytes are the
    object ``blobs/blake3-<hex>`` (``blobs/<sha256>`` for a sha256 entry), or,
    with ``pack``, ``size`` bytes at ``offset`` of ``blobs/pack-<pack>``: small
    files travel together.  A ``link`` entry is a symlink, its target relative
    to the link's directory.  Unknown keys are ignored.

    A multi-node job's manifest also says how many nodes wrote it and which node
    indexes held each file (``"node_count": 2, "writers": {"rank1.pt": [1]}``), so a
    restore can give each node only its own files (``--restore-scope node``);
    ``no_progress`` counts the restarts in a row whose committed checkpoint
    equals the one they restored (the wrapper's requeue budget).
    """

    attempt: int
    created: str = field(default_factory=utc_now_rfc3339)
    files: dict[str, dict] = field(default_factory=dict)
    node_count: int = 0  # 0: a single-node checkpoint (no writers recorded)
    writers: dict[str, list[int]] = field(default_factory=dict)
    no_progress: int = 0  # restarts in a row whose committed files equal the restored ones

    @property
    def total_bytes(self) -> int:
        return sum(e.get("size", 0) for e in self.files.values())

    def regular_files(self) -> dict[str, dict]:
        return {rel: e for rel, e in self.files.items() if "link" not in e}

    def links(self) -> dict[str, str]:
        return {rel: e["link"] for rel, e in self.files.items() if "link" in e}

    def content_signature(self) -> tuple[tuple[str, str], ...]:
        """(name, content id) of every entry, sorted: equal iff two checkpoints hold the same."""
        return content_signature(self.files)

    def same_content(self, files: Mapping[str, dict]) -> bool:
        """Same names with the same contents (content ids; where the bytes are stored does not count)."""
        return self.content_signature() == content_signature(files)

    def to_json(self) -> str:
        body: dict = {"schema": MANIFEST_SCHEMA, "attempt": self.attempt, "created": self.created, "files": self.files}
        if self.node_count:
            body.update(node_count=self.node_count, writers=self.writers)
        if self.no_progress:
            body["no_progress"] = self.no_progress
        return json.dumps(body, sort_keys=True, indent=1)

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
        schema = raw.get("schema")
        if schema not in (1, MANIFEST_SCHEMA) or isinstance(schema, bool):
            raise bad(f"unsupported schema {schema!r} (expected 1 or {MANIFEST_SCHEMA}; a newer slurmagent wrote it?)")
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
            problem = name_problem(rel)
            if problem:
                raise bad(f"file name {rel!r} {problem}")
            if not isinstance(e, dict):
                raise bad(f"files[{rel!r}] is not an object")
            if "link" in e and schema != 1:
                problem = _link_problem(rel, e["link"])
                if problem:
                    raise bad(f"files[{rel!r}]: {problem}")
                clean[rel] = {"link": e["link"]}
                continue
            algos = ("sha256",) if schema == 1 else _CONTENT_ALGOS
            present = [a for a in algos if a in e]
            if len(present) != 1:
                want = " or ".join(algos)
                raise bad(f"files[{rel!r}] needs exactly one of {want}")
            algo = present[0]
            if not _valid_hex(e[algo]):
                raise bad(f"files[{rel!r}].{algo} is not 64 lowercase hex digits")
            size = e.get("size")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise bad(f"files[{rel!r}].size is not an integer >= 0")
            if not _valid_crc32c(e.get("crc32c")):
                raise bad(f"files[{rel!r}].crc32c is not base64 of 4 bytes")
            clean[rel] = {algo: e[algo], "size": size, "crc32c": e["crc32c"]}
            if "pack" in e or "offset" in e:
                offset = e.get("offset")
                if algo != "blake3" or not _valid_hex(e.get("pack")):
                    raise bad(f"files[{rel!r}].pack is not 64 lowercase hex digits of a blake3 entry")
                if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
                    raise bad(f"files[{rel!r}].offset is not an integer >= 0")
                clean[rel].update(pack=e["pack"], offset=offset)
        _check_tree(clean, bad)
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
        return cls(
            attempt=attempt,
            created=created,
            files=clean,
            node_count=node_count,
            writers={rel: sorted(set(nodes)) for rel, nodes in writers.items()},
            no_progress=no_progress,
        )


def content_signature(files: Mapping[str, dict]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((rel, entry_content_id(e)) for rel, e in files.items()))


def no_progress_after(restored: Manifest | None, files: Mapping[str, dict]) -> int:
    """The no-progress streak of a manifest committing ``files`` in an attempt that restored
    ``restored``: 0 when the attempt changed the checkpoint (or started without one), else one
    more than the restored manifest's streak. The wrapper's requeue budget is read from it."""
    if restored is None or not restored.same_content(files):
        return 0
    return restored.no_progress + 1


def _check_tree(files: Mapping[str, dict], bad: Callable[[str], ManifestError]) -> None:
    """No entry below another file or link: a restore never writes through a link."""
    for rel in files:
        for parent in parent_dirs(rel):
            if parent in files:
                what = "link" if "link" in files[parent] else "file"
                raise bad(f"file name {rel!r} lies below the {what} {parent!r}")


# ------------------------------------------------------------------------------ lag


@dataclass(frozen=True)
class CheckpointLag:
    """How far the bucket is behind the local directory.

    ``seconds``: age of the oldest local change not yet committed (0 when none);
    ``newest_seconds``: age of the newest such change; ``files``/``bytes``: how
    many entries / bytes are not yet committed.
    """

    seconds: float
    newest_seconds: float
    files: int
    bytes: int


def checkpoint_lag(
    local: Iterable[LocalFile], committed: Mapping[str, tuple[int, int]], now: float | None = None
) -> CheckpointLag:
    """Compare a scan with what the last commit held (relpath -> (size, mtime_ns))."""
    now = time.time() if now is None else now
    pending = [f for f in local if committed.get(f.relpath) != (f.size, f.mtime_ns)]
    if not pending:
        return CheckpointLag(0.0, 0.0, 0, 0)
    ages = [max(0.0, now - f.mtime_ns / 1e9) for f in pending]
    return CheckpointLag(max(ages), min(ages), len(pending), sum(f.size for f in pending))


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

"""Checkpoint store, local part: the names the rest of the package imports.

The job-step wrapper (``slurmagent run``) gives the trainer a local directory
(``SLURMAGENT_CKPT_DIR``).  The store decides which entries of it make up the
checkpoint, hashes them once, and describes a complete checkpoint as a
:class:`Manifest`; the Cloud Storage side lives in :mod:`slurmagent.gcp.storage`.
This module is its front: callers import from here, the parts live beside it:

* :mod:`slurmagent.checkpoint_errors`: one error class per thing a user can act on;
* :mod:`slurmagent.checkpoint_names`: which entries are part of a checkpoint, the name rule, the scan;
* :mod:`slurmagent.checkpoint_hash`: content ids (BLAKE3, legacy SHA-256) and CRC32C in one read;
* :mod:`slurmagent.checkpoint_cache`: the hash cache, so an unchanged file is never read again;
* :mod:`slurmagent.checkpoint_manifest`: the manifest format and its validation.

Here: how far the bucket is behind (:func:`checkpoint_lag`) and the remote URL
(:func:`parse_remote`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Iterable, Mapping

from slurmagent.checkpoint_cache import LocalState, state_file_for
from slurmagent.checkpoint_errors import (
    CheckpointError,
    LocalChangedError,
    ManifestError,
    RemoteURLError,
    RestoreError,
    StaleAttemptError,
    StorageUnavailableError,
    SyncDeadlineError,
)
from slurmagent.checkpoint_hash import (
    EMPTY_CRC32C,
    FileDigest,
    PyCrc32c,
    blake3_hex,
    crc32c_b64,
    crc32c_combine,
    hash_file,
    open_nofollow,
)
from slurmagent.checkpoint_manifest import MANIFEST_SCHEMA, Manifest, entry_content_id, no_progress_after
from slurmagent.checkpoint_names import (
    RESERVED_PREFIX,
    LocalFile,
    is_in_progress_name,
    is_in_progress_path,
    is_reserved_name,
    is_temporary_name,
    name_problem,
    parent_dirs,
    scan_checkpoint_dir,
)

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
    "state_file_for",
    "LocalState",
    "FileDigest",
    "CheckpointLag",
    "RESERVED_PREFIX",
    "EMPTY_CRC32C",
    "PyCrc32c",
    "is_temporary_name",
    "is_reserved_name",
    "is_in_progress_name",
    "is_in_progress_path",
    "name_problem",
    "scan_checkpoint_dir",
    "hash_file",
    "blake3_hex",
    "open_nofollow",
    "entry_content_id",
    "parent_dirs",
    "no_progress_after",
    "crc32c_b64",
    "crc32c_combine",
    "checkpoint_lag",
    "parse_remote",
    "MANIFEST_SCHEMA",
]


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

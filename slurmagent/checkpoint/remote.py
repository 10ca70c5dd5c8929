"""Where a checkpoint's remote is (`gs://BUCKET/PREFIX`) and how far the bucket is behind."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Iterable, Mapping
from .errors import RemoteURLError
from .scan import LocalFile


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

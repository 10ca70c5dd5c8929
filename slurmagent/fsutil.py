"""Crash-safe small-file writes shared by the snapshot, cursor, journal and state files."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written: a short write (disk nearly full) must not leave a
    truncated file that is then renamed into place (the next write raises ENOSPC instead)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(28, "No space left on device")
        view = view[n:]


def unsafe_for_root(path: str | os.PathLike[str]) -> str | None:
    """Why a root process must not trust `path` (owned by another user, or writable by group or
    others without the sticky bit), or None: trusted, absent, or not running as root."""
    if os.geteuid() != 0:
        return None
    try:
        lst, st = os.lstat(path), os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot stat it ({exc.strerror})"
    for s in (lst, st):
        if s.st_uid != 0:
            return f"owned by uid {s.st_uid}"
    sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_dir:
        return f"writable by non-root users (mode {stat.filemode(st.st_mode)})"
    return None


def atomic_write_text(path: str | os.PathLike[str], text: str, mode: int = 0o644, durable: bool = True) -> None:
    """Write to a temp name in the same directory, fsync, rename, fsync the directory:
    a reader sees the old file or the new one, never half of either. `durable=False` skips
    the fsyncs for files that may be lost in a crash (metrics)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            write_all(fd, text.encode("utf-8"))
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk must not keep the half-written temp file
            os.unlink(tmp)
        raise
    if not durable:
        return
    with contextlib.suppress(OSError):
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

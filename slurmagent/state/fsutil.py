"""Crash-safe small-file writes shared by the snapshot, cursor, journal and state files."""

from __future__ import annotations

import _thread  # get_native_id without importing threading (the healthy prolog's start-up)
import contextlib
import errno
import os
import stat
import tempfile
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


class UntrustedFile(PermissionError):
    """A file root must not read: a user could have written it or what leads to it."""

    def why(self) -> str:
        """What is wrong, without repeating the file's own name when the file itself is the cause."""
        prefix = f"{self.filename} is "
        return self.strerror[len(prefix):] if self.strerror.startswith(prefix) else self.strerror


_MAX_LINKS = 40


def _unsafe_stat(st: os.stat_result) -> str | None:
    if st.st_uid != 0:
        return f"owned by uid {st.st_uid}"
    sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_dir:
        return f"writable by non-root users (mode {stat.filemode(st.st_mode)})"
    return None


def _walk(path: str | os.PathLike[str], follow_final: bool) -> tuple[str | None, str, os.stat_result | None]:
    """Resolve `path` the way the kernel does, one name at a time, judging every directory on
    the way and every symlink met (the names as written, not only where they lead): a name that
    a user could change or re-point means a user could choose what root reads.

    Returns (why it is untrusted or None, the resolved path, its lstat or None when absent)."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        text = os.path.join(os.getcwd(), text)
    todo = text.split("/")[::-1]
    cur, st, links = "/", os.lstat("/"), 0
    why = _unsafe_stat(st)
    if why:
        return f"/ is {why}", cur, None
    while todo:
        name = todo.pop()
        if name in ("", "."):
            continue
        if name == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, name)
        try:
            st = os.lstat(nxt)
        except (FileNotFoundError, NotADirectoryError):  # absent: nothing to trust or distrust
            return None, os.path.join(nxt, *todo[::-1]), None
        except OSError as exc:
            return f"{nxt}: cannot stat it ({exc.strerror})", nxt, None
        final = all(p in ("", ".") for p in todo)
        if stat.S_ISLNK(st.st_mode):
            if final and not follow_final:
                return f"{nxt} is a symbolic link", nxt, st
            if st.st_uid != 0:
                return f"{nxt} is a symbolic link owned by uid {st.st_uid}", nxt, st
            links += 1
            if links > _MAX_LINKS:
                return f"{text}: too many symbolic links", nxt, st
            target = os.readlink(nxt)
            if target.startswith("/"):
                cur = "/"
            todo.extend(target.split("/")[::-1])
            continue
        why = _unsafe_stat(st)
        if why:
            return f"{nxt} is {why}", nxt, st
        cur = nxt
    return None, cur, st


def untrusted_reason(path: str | os.PathLike[str], *, follow_final: bool = False) -> str | None:
    """Why `path` (a file or a directory) is not one only root could have written or placed,
    whoever asks; None when it is trusted or absent. A final symlink counts as untrusted unless
    `follow_final` (then it must be root's, in a root-only directory, like what it leads to)."""
    return _walk(path, follow_final)[0]


def unsafe_for_root(path: str | os.PathLike[str]) -> str | None:
    """Why a root process must not trust `path` (it, a symlink, or a directory on the way to it
    is owned by another user or writable by group or others without the sticky bit), or None:
    trusted, absent, or not running as root."""
    if os.geteuid() != 0:
        return None
    return untrusted_reason(path)


def open_trusted(path: str | os.PathLike[str], *, follow_final: bool = False) -> int:
    """Open (read-only, as a file descriptor) a file only root could have written: the path is
    judged (see `untrusted_reason`), then opened once without following a final link, and the
    open file itself is judged, so what is checked is what is read. Raises UntrustedFile,
    FileNotFoundError or OSError."""
    why, resolved, walked = _walk(path, follow_final)
    if why:
        raise UntrustedFile(errno.EPERM, why, os.fspath(path))
    fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        why = _unsafe_stat(st) or ("not a regular file" if not stat.S_ISREG(st.st_mode) else None)
        if not why and walked is not None and (walked.st_dev, walked.st_ino) != (st.st_dev, st.st_ino):
            why = "replaced while it was opened"
        if why:
            raise UntrustedFile(errno.EPERM, f"{resolved} is {why}", os.fspath(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_fd(fd: int) -> bytes:
    """Everything from `fd` to its end, then close it."""
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_trusted(path: str | os.PathLike[str], *, follow_final: bool = False) -> bytes:
    """The bytes of a file only root could have written (see `open_trusted`)."""
    return read_fd(open_trusted(path, follow_final=follow_final))


def open_state_file(path: str | os.PathLike[str]) -> int:
    """A file of the state dir, opened: as root only one that only root could have written
    (else UntrustedFile); a user's own process (the wrapper) opens what it may."""
    if os.geteuid() != 0:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    return open_trusted(path)


def read_state_file(path: str | os.PathLike[str]) -> bytes:
    return read_fd(open_state_file(path))


def root_dir_problem(st: os.stat_result) -> str | None:
    """Why root must not write by name into the directory `st` describes (None: root's own)."""
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory" + (" (a symbolic link: name the directory itself)" if stat.S_ISLNK(st.st_mode) else "")
    if st.st_uid != 0:
        return f"owned by uid {st.st_uid}, not root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):  # sticky or not: others could plant names there
        return f"writable by non-root users (mode {stat.filemode(st.st_mode)})"
    return None


def open_root_dir(path: str | os.PathLike[str]) -> int:
    """The directory `path` as a file descriptor, refused (EPERM) unless root owns it and no one
    else can write it. Root then writes through the descriptor: a service account that owns the
    parent (`/var/lib/prometheus` is prometheus's) may swap the name, never what root writes into."""
    try:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        why = root_dir_problem(os.lstat(path))
        raise PermissionError(errno.EPERM, f"{os.fspath(path)} is {why}", os.fspath(path)) from None
    why = root_dir_problem(os.fstat(fd))
    if why:
        os.close(fd)
        raise PermissionError(errno.EPERM, f"{os.fspath(path)} is {why}", os.fspath(path))
    return fd


def atomic_write_text(path: str | os.PathLike[str], text: str, mode: int = 0o644, durable: bool = True,
                      parents: bool = True, root_dir: bool = False) -> None:
    """Write to a temp name in the same directory, fsync, rename, fsync the directory:
    a reader sees the old file or the new one, never half of either. `durable=False` skips
    the fsyncs for files that may be lost in a crash (metrics); `parents=False` creates no
    directory (a user's output path: a typo must not create a tree); `root_dir`: as root,
    only into a directory root owns and only root can write (`open_root_dir`)."""
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    if root_dir and os.geteuid() == 0:
        dfd = open_root_dir(path.parent)
    else:  # O_PATH: a directory one may write but not list (0733) still takes the file
        dfd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        tmp = f".{path.name}.{os.getpid()}.{_thread.get_native_id()}.tmp"  # one writer per name
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)  # a crashed writer's: O_EXCL below never opens a planted link
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
        try:
            try:
                write_all(fd, text.encode("utf-8"))
                os.fchmod(fd, mode)  # the umask's bits back, on what was opened (not by name)
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):  # a full disk must not keep the half-written temp file
                os.unlink(tmp, dir_fd=dfd)
            raise
        if durable:
            with contextlib.suppress(OSError):
                sync_fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    os.fsync(sync_fd)
                finally:
                    os.close(sync_fd)
    finally:
        os.close(dfd)


def replace_private(path: Path, text: str) -> None:
    """Write `text` to a 0600 temp file beside `path` (`.<name>.*.tmp`), then rename it over
    `path`: a reader sees the old file or the new one. No fsync: for caches and records that
    only cost a full scan or restore when lost."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise

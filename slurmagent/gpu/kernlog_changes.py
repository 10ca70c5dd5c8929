"""Whether the kernel log may hold something new, asked before it is read: a read of
journalctl or dmesg costs a process, and the watch loop polls several times a second.

`/dev/kmsg` says so through an fd at its end (the loop can also sleep in `poll` on it), a
plain file through one `stat`, and the process-backed sources are read every SLOW_SOURCE_S.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from typing import Protocol

from .kernlog import FileSource, KmsgSource, Source

SLOW_SOURCE_S = 5.0  # journalctl/dmesg cost a process each: poll them this often


class ChangeDetector(Protocol):
    fd: int | None  # readable when the log grew (None: nothing to wait on)

    def changed(self) -> bool: ...

    def close(self) -> None: ...


class _Always:
    """Sources that cost a process to read (journalctl, dmesg): read every SLOW_SOURCE_S."""

    def __init__(self, period: float):
        self.period = period
        self.next = 0.0

    fd = None

    def changed(self) -> bool:
        now = time.monotonic()
        if now >= self.next:
            self.next = now + self.period
            return True
        return False

    def close(self) -> None:
        pass


class _FileStat:
    """A plain file: changed when its inode, size or mtime changed (one stat per poll)."""

    fd = None

    def __init__(self, path: str):
        self.path = path
        self.last: tuple | None = None

    def changed(self) -> bool:
        try:
            st = os.stat(self.path)
            key: tuple = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            key = ()
        if key != self.last:
            self.last = key
            return True
        return False

    def close(self) -> None:
        pass


class _KmsgPoll:
    """/dev/kmsg: an fd at the end of the buffer becomes readable when a record is added."""

    def __init__(self, path: str):
        self.fd: int | None = None
        with contextlib.suppress(OSError):
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.lseek(self.fd, 0, os.SEEK_END)

    def changed(self) -> bool:
        if self.fd is None:
            return True
        readable, _, _ = select.select([self.fd], [], [], 0)
        if not readable:
            return False
        while True:  # drain what arrived; the source reads it from the cursor
            try:
                if not os.read(self.fd, 65536):
                    break
            except BlockingIOError:
                break
            except OSError:  # EPIPE: overwritten records; keep draining
                continue
        return True

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def change_detector(source: Source) -> ChangeDetector:
    """The cheapest way to tell that this source may hold new lines."""
    if isinstance(source, FileSource):
        return _FileStat(str(source.path))
    if isinstance(source, KmsgSource):
        return _KmsgPoll(source.path)
    return _Always(SLOW_SOURCE_S)

"""NVRM Xid lines from the kernel log, read from a cursor so each XID is judged once.

The lines are parsed by `kernel_xid.py`. The kernel log is read through a
*source* (a plain file, ``/dev/kmsg``, ``journalctl`` or ``dmesg``); a *cursor*
``{"boot_id", "source", "position"}`` saved atomically at ``<state_dir>/kernlog.cursor``
records how far the log has been judged, across process restarts. A new boot, or a
different source, starts again from the beginning of the current boot's log.

Typical use is "read, judge, then commit" so an XID is not lost if judging fails::

    batch = read_since(source, state_dir)
    act_on(batch.xids)                # drain etc.
    commit_cursor(state_dir, batch.cursor)

``read_new(..., commit=False)`` is a peek for read-only commands. Nothing runs at import.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import subprocess

from ..state import host
from ..state.fsutil import UntrustedFile, atomic_write_text, read_state_file
from ..errors import SlurmagentError
from ..core.kernel_xid import KernelXid, parse_lines

CURSOR_FILE = "kernlog.cursor"
LOCK_FILE = "kernlog.lock"
DEFAULT_TIMEOUT_S = 10.0

Position = int | str | None  # byte offset, kmsg sequence, journal cursor, line count


class KernlogError(SlurmagentError):
    """The kernel log could not be read (tool failed or timed out, cursor unwritable)."""

    exit_code = 1


# --- sources ------------------------------------------------------------------------------


class Source(Protocol):
    """A kernel log that can be read from a position onwards.

    ``read(None)`` starts at the beginning of the current boot's log. It returns the new
    lines (a source may drop lines that cannot hold an Xid) and the position after them.
    """

    name: str

    def read(self, position: Position) -> tuple[list[str], Position]: ...


def _may_hold_xid(line: str) -> bool:
    return "Xid" in line


class FileSource:
    """A plain text file (``[health] kernel_log``, tests); position is a byte offset.

    Only complete lines are consumed. A file shorter than the offset was truncated or
    rotated, so it is read again from 0; a missing file reads as empty.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.name = f"file:{os.path.abspath(self.path)}"

    def read(self, position: Position) -> tuple[list[str], Position]:
        start = position if isinstance(position, int) and position >= 0 else 0
        lines: list[str] = []
        try:
            with open(self.path, "rb") as fh:
                if os.fstat(fh.fileno()).st_size < start:
                    start = 0
                fh.seek(start)
                consumed = start
                for chunk in fh:  # binary iteration splits after b"\n"
                    if not chunk.endswith(b"\n"):
                        break
                    consumed += len(chunk)
                    text = chunk.decode("utf-8", errors="replace")
                    if _may_hold_xid(text):
                        lines.append(text.rstrip("\r\n"))
        except FileNotFoundError:
            return [], 0
        except OSError as e:
            raise KernlogError(f"cannot read kernel log {self.path}: {e.strerror}") from e
        return lines, consumed


class KmsgSource:
    """``/dev/kmsg`` records; position is the record sequence number.

    Read non-blocking until EAGAIN (or EOF). Records with ``seq <= position`` are skipped;
    continuation lines (``" KEY=value"``) are ignored. EPIPE means records were
    overwritten under us: reading simply continues with the oldest one still there.
    """

    _READ_SIZE = 65536

    def __init__(self, path: str = "/dev/kmsg") -> None:
        self.path = path
        self.name = "kmsg" if path == "/dev/kmsg" else f"kmsg:{path}"

    def _chunks(self) -> Iterator[bytes]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise KernlogError(f"cannot open {self.path}: {e.strerror}") from e
        try:
            while True:
                try:
                    data = os.read(fd, self._READ_SIZE)
                except BlockingIOError:
                    return
                except OSError as e:
                    if e.errno == errno.EPIPE:
                        continue
                    if e.errno == errno.EINTR:
                        continue
                    raise KernlogError(f"cannot read {self.path}: {e.strerror}") from e
                if not data:
                    return
                yield data
        finally:
            os.close(fd)

    def read(self, position: Position) -> tuple[list[str], Position]:
        after = position if isinstance(position, int) else -1
        last = after
        lines: list[str] = []
        pending = b""
        for data in self._chunks():
            # A device read is one whole record; a regular file (tests) may split anywhere.
            data = pending + data
            *records, pending = data.split(b"\n")
            for rec in records:
                seq = _kmsg_seq(rec)
                if seq is None or seq <= after:
                    continue
                last = max(last, seq)
                text = rec.decode("utf-8", errors="replace")
                if _may_hold_xid(text):
                    lines.append(text)
        return lines, (last if last >= 0 else position)


def _kmsg_seq(record: bytes) -> int | None:
    """The sequence number of a ``pri,seq,usec,flags;message`` header, else None."""
    if not record or record[:1] in (b" ", b"\t"):
        return None
    head, sep, _ = record.partition(b";")
    if not sep:
        return None
    fields = head.split(b",")
    if len(fields) < 3:
        return None
    try:
        return int(fields[1])
    except ValueError:
        return None


def _run(argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[bytes]:
    import subprocess  # journalctl/dmesg only: a kernel log file (the prolog's usual source) needs none, start-up speed

    try:
        return subprocess.run(
            list(argv), stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise KernlogError(f"{argv[0]} did not answer within {timeout:g}s") from e
    except OSError as e:
        raise KernlogError(f"cannot run {argv[0]}: {e.strerror}") from e


def _first_line(data: bytes) -> str:
    text = data.decode("utf-8", errors="replace").strip()
    return text.splitlines()[0] if text else "no output"


class JournalSource:
    """``journalctl -k -o json`` of the current boot; position is the journal ``__CURSOR``.

    A cursor journalctl rejects (exit status non-zero) is dropped once and the boot is read
    from its start, so a corrupt cursor cannot wedge the reader.
    """

    def __init__(self, journalctl: str = "journalctl", timeout: float = DEFAULT_TIMEOUT_S):
        self.journalctl = journalctl
        self.timeout = timeout
        self.name = "journal"

    def argv(self, position: Position) -> list[str]:
        argv = [self.journalctl, "-k", "-b", "-o", "json", "--no-pager", "-q"]
        if isinstance(position, str) and position:
            argv.append(f"--after-cursor={position}")
        return argv

    def read(self, position: Position) -> tuple[list[str], Position]:
        proc = _run(self.argv(position), self.timeout)
        if proc.returncode != 0 and isinstance(position, str) and position:
            position = None
            proc = _run(self.argv(None), self.timeout)
        if proc.returncode != 0:
            raise KernlogError(
                f"{self.journalctl} failed (exit {proc.returncode}): {_first_line(proc.stderr)}"
            )
        lines: list[str] = []
        last = position
        for raw in proc.stdout.splitlines():
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(entry, dict):
                continue
            cursor = entry.get("__CURSOR")
            if isinstance(cursor, str) and cursor:
                last = cursor
            message = _journal_message(entry.get("MESSAGE"))
            if message and _may_hold_xid(message):
                lines.extend(message.splitlines())
        return lines, last


def _journal_message(value: object) -> str:
    """MESSAGE is a string, or a list of byte values when it is not valid UTF-8."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, int) and 0 <= b < 256 for b in value):
        return bytes(value).decode("utf-8", errors="replace")
    return ""


class DmesgSource:
    """``dmesg`` output, the last resort; position is the number of lines already seen.

    Fewer lines than the position means the ring buffer was cleared: start again at 0.
    Once the ring buffer is full and wraps, the count no longer tracks new lines exactly;
    prefer KmsgSource or JournalSource where they work.
    """

    def __init__(self, dmesg: str = "dmesg", timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.dmesg = dmesg
        self.timeout = timeout
        self.name = "dmesg"

    def read(self, position: Position) -> tuple[list[str], Position]:
        proc = _run([self.dmesg], self.timeout)
        if proc.returncode != 0:
            raise KernlogError(
                f"{self.dmesg} failed (exit {proc.returncode}): {_first_line(proc.stderr)}"
            )
        all_lines = proc.stdout.decode("utf-8", errors="replace").splitlines()
        start = position if isinstance(position, int) and position >= 0 else 0
        if len(all_lines) < start:
            start = 0
        return [ln for ln in all_lines[start:] if _may_hold_xid(ln)], len(all_lines)


def kmsg_readable(path: str = "/dev/kmsg") -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        os.read(fd, KmsgSource._READ_SIZE)
    except BlockingIOError:
        pass
    except OSError as e:
        return e.errno == errno.EPIPE
    finally:
        os.close(fd)
    return True


def default_source() -> Source:
    """/dev/kmsg when readable, else journalctl when installed, else dmesg."""
    if kmsg_readable():
        return KmsgSource()
    journalctl = shutil.which("journalctl")
    if journalctl:
        return JournalSource(journalctl)
    return DmesgSource()


def source_for(kernel_log: str = "") -> Source:
    """The source for the ``[health] kernel_log`` setting: that file, or the kernel log."""
    return FileSource(kernel_log) if kernel_log else default_source()


# --- cursor -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cursor:
    """How far ``source`` has been judged during boot ``boot_id``."""

    boot_id: str
    source: str
    position: Position

    def to_json(self) -> str:
        return json.dumps(
            {"boot_id": self.boot_id, "source": self.source, "position": self.position},
            sort_keys=True,
        )


@dataclass(frozen=True)
class Batch:
    """XIDs read since the saved cursor, and the cursor to commit once they are judged."""

    xids: list[KernelXid]
    cursor: Cursor


def cursor_path(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / CURSOR_FILE


def load_cursor(state_dir: str | os.PathLike[str]) -> Cursor | None:
    """The saved cursor; None when there is none or it is unreadable (start over).

    As root, a cursor file a non-root user could have written is ignored (said on stderr):
    moving it past an XID would hide the fault, and starting over can only judge more."""
    try:
        data = json.loads(read_state_file(cursor_path(state_dir)).decode("utf-8"))
    except UntrustedFile as exc:
        import sys

        print(f"slurmagent: ignoring kernel-log cursor {cursor_path(state_dir)}: {exc.why()}; reading this "
              "boot's log from its start", file=sys.stderr)
        return None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    boot_id, source, position = data.get("boot_id"), data.get("source"), data.get("position")
    if not isinstance(boot_id, str) or not isinstance(source, str):
        return None
    if position is not None and (isinstance(position, bool) or
                                 not isinstance(position, (int, str))):
        return None
    return Cursor(boot_id, source, position)


@contextlib.contextmanager
def locked(state_dir: str | os.PathLike[str], timeout: float) -> Iterator[None]:
    """Serialize read-and-commit between processes (watch, healthcheck, hooks)."""
    path = Path(state_dir) / LOCK_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise KernlogError(f"cannot open {path}: {e.strerror}") from e
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise KernlogError(f"{path} is held by another process") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def commit_cursor(state_dir: str | os.PathLike[str], cursor: Cursor) -> None:
    """Save ``cursor`` atomically (temp file, fsync, rename)."""
    try:
        atomic_write_text(cursor_path(state_dir), cursor.to_json() + "\n")
    except OSError as e:
        raise KernlogError(f"cannot save {cursor_path(state_dir)}: {e.strerror}") from e


def read_since(
    source: Source, state_dir: str | os.PathLike[str], *, boot_id: str | None = None
) -> Batch:
    """XIDs logged since the saved cursor, without moving it (see :func:`commit_cursor`)."""
    bid = host.boot_id() if boot_id is None else boot_id
    saved = load_cursor(state_dir)
    start: Position = None
    if saved is not None and saved.boot_id == bid and saved.source == source.name:
        start = saved.position
    lines, position = source.read(start)
    return Batch(parse_lines(lines), Cursor(bid, source.name, position))


def read_new(
    source: Source,
    state_dir: str | os.PathLike[str],
    *,
    commit: bool = True,
    boot_id: str | None = None,
    lock_timeout: float = 30.0,
) -> list[KernelXid]:
    """XIDs since the cursor; ``commit=True`` advances the cursor past them, False peeks."""
    if not commit:
        return read_since(source, state_dir, boot_id=boot_id).xids
    with locked(state_dir, lock_timeout):
        batch = read_since(source, state_dir, boot_id=boot_id)
        commit_cursor(state_dir, batch.cursor)
    return batch.xids

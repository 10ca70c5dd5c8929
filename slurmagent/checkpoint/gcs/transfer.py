"""The machinery of one transfer under a deadline, shared by every checkpoint upload and restore.

A :class:`Deadline` ends the whole sync or restore; :class:`WorkerPool` runs its
tasks on daemon threads (one stuck in a dead connection never holds up the
caller or the process's exit); :class:`FileRange` streams part of a file as a
request body, checking the deadline every block; :func:`is_transient` says what
is worth retrying.  Nothing here knows about buckets or manifests.
"""

from __future__ import annotations

import base64
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..errors import LocalChangedError

__all__ = [
    "Aborted",
    "BLOCK",
    "Deadline",
    "FileRange",
    "GiB",
    "MiB",
    "Notices",
    "SizeMismatch",
    "TransferCorrupt",
    "TransferSettings",
    "WorkerPool",
    "human_size",
    "is_not_found",
    "is_precondition_failed",
    "is_transient",
    "one_line",
    "some_names",
    "status_of",
]

log = logging.getLogger("slurmagent.checkpoint.gcs.store")

TRANSIENT_HTTP_STATUS = frozenset({408, 429, 500, 502, 503, 504})
MiB = 1024 * 1024
GiB = 1024 * MiB
BLOCK = 1 * MiB  # read/write unit of a streamed transfer (also the deadline's granularity)


@dataclass(frozen=True)
class TransferSettings:
    """The store's tunables, as one sync or restore reads them when it starts (see GcsCheckpointStore)."""

    max_workers: int
    small_file_max: int
    pack_file_max: int
    pack_size: int
    parallel_upload_threshold: int | None
    part_size: int
    ranged_download_threshold: int
    range_size: int
    slices_per_file: int
    hash_workers: int
    busy_retries: int
    busy_pause_s: float


class Notices:
    """Lines worth the user's attention that do not fail a transfer, each said once per store.

    ``warn``: called with the line (default: the storage logger); a broken callback
    never breaks a sync.
    """

    def __init__(self, warn: Callable[[str], None] | None = None) -> None:
        self.warn = warn
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def say_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._said:
                return
            self._said.add(key)
        if self.warn is not None:
            try:
                self.warn(message)
                return
            except Exception:  # a broken callback never breaks a sync
                log.debug("warn callback failed", exc_info=True)
        log.warning("%s", message)

    def skipped(self, rel: str, why: str) -> None:
        self.say_once(f"skip:{rel}:{why}", f"not syncing {rel}: {why}")


# -------------------------------------------------------------------------- errors


def status_of(exc: BaseException) -> int | None:
    code = getattr(exc, "code", None)
    if isinstance(code, int) and not isinstance(code, bool) and 100 <= code < 600:
        return code
    resp = getattr(exc, "response", None)
    sc = getattr(resp, "status_code", None)
    if isinstance(sc, int):
        return sc
    return None


class TransferCorrupt(Exception):
    """The server's CRC32C of what we sent (or the bytes we received) does not match: resend."""


class SizeMismatch(Exception):
    """A download ended cleanly with another size than the manifest's: the object is not that file."""


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: connection refused/reset, timeouts, 408/429/5xx, transport corruption."""
    if isinstance(exc, (ConnectionError, TimeoutError, TransferCorrupt)):
        return True
    import requests

    if isinstance(
        exc,
        (
            requests.exceptions.ConnectionError,
            requests.exceptions.Timeout,
            requests.exceptions.ChunkedEncodingError,
        ),
    ):
        return True
    try:
        from google.auth.exceptions import TransportError

        if isinstance(exc, TransportError):
            return True
    except ImportError:  # pragma: no cover
        pass
    if type(exc).__name__ == "DataCorruption":  # checksum mismatch in transit
        return True
    return status_of(exc) in TRANSIENT_HTTP_STATUS


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    msg = text[0] if text else ""
    if len(msg) > 300:
        msg = msg[:297] + "..."
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def is_not_found(exc: BaseException) -> bool:
    return status_of(exc) == 404


def is_precondition_failed(exc: BaseException) -> bool:
    return status_of(exc) == 412


def human_size(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def some_names(rels: list[str], most: int = 5) -> str:
    shown = ", ".join(rels[:most])
    return shown + (f" and {len(rels) - most} more" if len(rels) > most else "")


class Aborted(Exception):
    """The transfer was abandoned (deadline, or another worker failed); never surfaces to callers."""


class Deadline:
    def __init__(self, seconds: float) -> None:
        if seconds is None or seconds <= 0:
            raise ValueError("deadline_s must be > 0")
        self.total = float(seconds)
        self.start = time.monotonic()
        self.end = self.start + self.total
        self.abort = threading.Event()

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def check(self) -> None:
        """Raise :class:`Aborted` once the transfer is abandoned or out of time."""
        if self.abort.is_set() or time.monotonic() >= self.end:
            raise Aborted()


class WorkerPool:
    """Daemon worker threads running tasks until all are done, one fails, or the caller stops waiting.

    Tasks run in lanes, each with its own threads (``io`` has ``workers``; others
    as given), so that a few lanes hold the large buffers and no lane waits on
    work queued behind itself.  Tasks may submit more tasks.  A task's exception
    (other than :class:`Aborted`) is kept as :attr:`error` and aborts the rest.
    """

    def __init__(self, workers: int, dl: Deadline, name: str, lanes: dict[str, int] | None = None) -> None:
        self.dl = dl
        self.error: BaseException | None = None
        self._name = name
        self._caps = {"io": max(1, workers), **(lanes or {})}
        self._queues: dict[str, queue.SimpleQueue] = {lane: queue.SimpleQueue() for lane in self._caps}
        self._submitted = dict.fromkeys(self._caps, 0)
        self._cond = threading.Condition()
        self._pending = 0
        self._threads: dict[str, list[threading.Thread]] = {lane: [] for lane in self._caps}

    def submit(self, fn: Callable[..., Any], *args: Any, lane: str = "io") -> None:
        with self._cond:
            self._pending += 1
            self._submitted[lane] += 1
            threads = self._threads[lane]
            if len(threads) < min(self._caps[lane], self._submitted[lane]):
                t = threading.Thread(
                    target=self._run, args=(lane,), name=f"{self._name}-{lane}-{len(threads)}", daemon=True
                )
                threads.append(t)
                t.start()
        self._queues[lane].put((fn, args))

    def _run(self, lane: str) -> None:
        q = self._queues[lane]
        while True:
            item = q.get()
            if item is None:
                return
            fn, args = item
            try:
                if not self.dl.abort.is_set():
                    fn(*args)
            except Aborted:
                pass
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                with self._cond:
                    if self.error is None:
                        self.error = exc
                self.dl.abort.set()
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def wait(self, until: float) -> bool:
        """True once every task finished or one failed; False when monotonic time ``until`` came first."""
        with self._cond:
            while self._pending and self.error is None:
                left = until - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        for lane, threads in self._threads.items():
            for _ in threads:
                self._queues[lane].put(None)

    def run_each(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> None:
        """`fn(item)` for every item, then wait for them all by the deadline; a task's error is
        raised here (the others abort), running out of time raises Aborted; the pool is closed."""
        try:
            for item in items:
                self.submit(fn, item)
            self.wait(self.dl.end)
            if self.error is not None:
                raise self.error
            self.dl.check()
        finally:
            self.close()


class FileRange:
    """A request body: bytes [offset, offset+length) of an open file, read in blocks.

    Computes the CRC32C of what was sent; stops (raises :class:`Aborted`) once
    the transfer is abandoned or its deadline passed.
    """

    def __init__(self, fd: int, offset: int, length: int, dl: Deadline) -> None:
        import google_crc32c

        self.fd, self.pos, self.left, self.length, self.dl = fd, offset, length, length, dl
        self.crc = google_crc32c.Checksum()

    def __len__(self) -> int:
        return self.length

    def read(self, n: int = -1) -> bytes:
        self.dl.check()
        want = self.left if n is None or n < 0 else min(n, self.left)
        want = min(want, BLOCK)
        if want <= 0:
            return b""
        data = os.pread(self.fd, want, self.pos)
        if not data:
            raise LocalChangedError("a checkpoint file shrank while it was being uploaded")
        self.pos += len(data)
        self.left -= len(data)
        self.crc.update(data)
        return data

    def crc32c(self) -> str:
        return base64.b64encode(self.crc.digest()).decode("ascii")

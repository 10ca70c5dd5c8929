"""Read NVML under a hard deadline, in a child process that is abandoned when the driver hangs.

A hung NVML call sits in the driver and cannot be interrupted in-process, so the read runs
in a child that is SIGKILLed at the deadline (`NvmlTimeout`); a child that dies without
answering gives ``nvml_error="NVML_READ_CRASHED"``; an exception raised by the read is
raised again in the caller (SlurmagentError as such, others as RuntimeError) so a slurmagent
bug is never mistaken for an unhealthy GPU. Two ways to get the child:

* :func:`read_snapshot_with_deadline`: ``os.fork()``. It costs no interpreter start, which
  the prolog's speed depends on, and it is safe there: a hook is single-threaded.
* :class:`ThreadSafeReader`: for a process that runs threads (the `watch` daemon), where a
  forked child may deadlock on a lock another thread held at the fork. Its children come
  from a `forkserver`: a fresh, single-threaded interpreter (started with fork+exec, safe
  from threads), best started before the daemon starts its own threads, which forks one
  child per read with pynvml already imported. The deadline is kept the same way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import time
from typing import Any, Callable

from ..errors import NvmlTimeout, SlurmagentError
from .nvml import load, read_snapshot
from ..core.snapshot import NodeSnapshot

log = logging.getLogger(__name__)

#: ``nvml_error`` when the reader child died (signal, or exit without an answer).
NVML_READ_CRASHED = "NVML_READ_CRASHED"
_KILL_REAP_S = 2.0  # after SIGKILL; a child stuck in the driver (D state) may never die
FORKSERVER_PRELOAD = ["slurmagent.gpu.nvml", "slurmagent.gpu.nvml_deadline"]


def read_snapshot_with_deadline(timeout_s: float, nvml: Any = None, hostname: str | None = None) -> NodeSnapshot:
    """:func:`~slurmagent.gpu.nvml.read_snapshot` in a forked child that is SIGKILLed at the deadline.

    For single-threaded processes only (the hooks): see the module doc.

    Why a fork: a hung NVML call sits in the driver and cannot be interrupted in-process;
    a forked child costs no interpreter start and can be abandoned. Raises NvmlTimeout at the
    deadline; a child that dies without answering gives ``nvml_error="NVML_READ_CRASHED"``.
    An exception raised by the read is raised again here (SlurmagentError as such, others as
    RuntimeError) so a slurmagent bug is never mistaken for an unhealthy GPU.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, not {timeout_s!r}")
    nv = load(nvml)  # import errors surface here, not in the child
    hostname = hostname or socket.gethostname()
    data = answer_in_child(lambda: _nvml_answer(nv, hostname), time.monotonic() + timeout_s)
    if data is None:
        raise NvmlTimeout(f"NVML read did not finish within {float(timeout_s)} s (hung driver?)")
    return _decode(data, hostname)


def answer_in_child(answer: Callable[[], bytes], deadline: float) -> bytes | None:
    """What `answer()` returns, computed in a forked child that is SIGKILLed at `deadline` (None
    then): a call hung in a driver cannot be interrupted in-process. For single-threaded callers
    (the hooks, healthcheck, resume-if-healthy); the NVML read and the CUDA probe use it."""
    read_fd, write_fd = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        raise
    if pid == 0:  # child: never returns
        os.close(read_fd)
        _child(write_fd, answer)
    os.close(write_fd)
    reaped = False
    try:
        data = _read_until_eof(read_fd, deadline)
        if data is not None:
            reaped = _reap(pid, deadline)
    finally:
        os.close(read_fd)
        if not reaped:
            _kill(pid)
    return data


def _nvml_answer(nv: Any, hostname: str) -> bytes:
    try:
        answer: dict[str, Any] = {"snapshot": read_snapshot(nv, hostname).to_dict()}
    except BaseException as exc:  # carried to the parent, raised there
        answer = {"error": type(exc).__name__, "domain": isinstance(exc, SlurmagentError), "message": str(exc)}
    return json.dumps(answer).encode()


def _child(write_fd: int, answer: Callable[[], bytes]) -> None:
    """Answer, send the bytes down the pipe, and leave with os._exit (no atexit, no flush)."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        data = answer()
        while data:
            data = data[os.write(write_fd, data) :]
    except BaseException:  # even a failed write must end in os._exit
        code = 70
    finally:
        os._exit(code)


def _read_until_eof(fd: int, deadline: float) -> bytes | None:
    """All the child wrote, or None when the deadline passed first."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    chunks: list[bytes] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        if not poller.poll(max(1, int(remaining * 1000 + 0.999))):
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _reap(pid: int, deadline: float) -> bool:
    """Wait for the child to exit until the deadline; True once reaped."""
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if not _reap(pid, time.monotonic() + _KILL_REAP_S):
        log.warning("reader pid %d did not die after SIGKILL (stuck in the driver?)", pid)


def _decode(data: bytes, hostname: str) -> NodeSnapshot:
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):  # died before answering (signal, os._exit, OOM)
        return NodeSnapshot(hostname=hostname, nvml_error=NVML_READ_CRASHED)
    if "snapshot" in answer:
        return NodeSnapshot.from_dict(answer["snapshot"], source="NVML reader")
    message = str(answer.get("message", ""))
    if answer.get("domain"):
        raise SlurmagentError(message)
    raise RuntimeError(f"NVML reader raised {answer.get('error')}: {message}")


# --- thread-safe reader (forkserver children) ------------------------------------------------


def read_nvml_dict(hostname: str) -> dict[str, Any]:
    """The default read of a ThreadSafeReader child: this node's GPUs through pynvml."""
    return read_snapshot(None, hostname).to_dict()


def _answer(conn: Any, read: Callable[[str], dict[str, Any]], hostname: str) -> None:
    """In the forkserver's child: read, send one JSON answer, close."""
    try:
        answer: dict[str, Any] = {"snapshot": read(hostname)}
    except BaseException as exc:  # carried to the parent, raised there
        answer = {"error": type(exc).__name__, "domain": isinstance(exc, SlurmagentError), "message": str(exc)}
    conn.send_bytes(json.dumps(answer).encode())
    conn.close()


class ThreadSafeReader:
    """NVML reads with a hard deadline for a process that runs threads (see the module doc).

    `read` is what a child runs (a module-level function: it is sent to the forkserver by
    name): hostname -> the snapshot as a dict."""

    def __init__(self, read: Callable[[str], dict[str, Any]] = read_nvml_dict):
        self.read_fn = read
        self._ctx: Any = None

    def start(self) -> ThreadSafeReader:
        """Start the forkserver now (call it before the process starts threads)."""
        if self._ctx is None:
            import multiprocessing  # only the watch daemon needs it: kept off the hooks' start-up
            from multiprocessing import forkserver

            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
            forkserver.ensure_running()
            self._ctx = ctx
        return self

    def read(self, timeout_s: float, hostname: str | None = None) -> NodeSnapshot:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s!r}")
        ctx = self.start()._ctx
        hostname = hostname or socket.gethostname()
        deadline = time.monotonic() + timeout_s
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_answer, args=(send, self.read_fn, hostname), name="nvml-reader", daemon=True)
        try:
            proc.start()
        finally:
            send.close()
        data: bytes | None = None
        try:
            if recv.poll(max(0.0, deadline - time.monotonic())):
                try:
                    data = recv.recv_bytes()
                except (EOFError, OSError):
                    data = b""  # died without answering
            if data is None:
                raise NvmlTimeout(f"NVML read did not finish within {float(timeout_s)} s (hung driver?)")
        finally:
            recv.close()
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(_KILL_REAP_S)
                if proc.is_alive():
                    log.warning("NVML reader pid %s did not die after SIGKILL (stuck in the driver?)", proc.pid)
        return _decode(data, hostname)

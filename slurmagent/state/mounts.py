"""The local mounts: /proc/self/mountinfo (under an injectable root) and a write probe.

The probe creates a file of an unguessable name in the mount point (O_EXCL|O_NOFOLLOW, relative
to the directory opened without following a link: a user who can write there cannot point it
elsewhere), fsyncs it and unlinks it, with statvfs for how full the filesystem is, in a
thread the caller abandons past its deadline: a hung filesystem gives a verdict, not a hung hook.
"""

from __future__ import annotations

import errno
import os
import secrets
import threading
from pathlib import Path

from ..core.node_checks import Mount, Probe, parse_mountinfo


def read_mounts(proc: Path = Path("/proc")) -> dict[str, Mount] | None:
    """mount point -> mount, from `<proc>/self/mountinfo`; None when it cannot be read."""
    try:
        return parse_mountinfo((proc / "self" / "mountinfo").read_text())
    except OSError:
        return None


def _used(point: str, statvfs=os.statvfs) -> float | None:
    try:
        st = statvfs(point)
    except OSError:
        return None
    total = st.f_blocks - st.f_bfree + st.f_bavail  # root's reserve is not the user's
    return 100.0 * (st.f_blocks - st.f_bfree) / total if total else None


def _probe_now(point: str, statvfs) -> tuple[Probe, float | None]:
    used = _used(point, statvfs)
    name = f".slurmagent-probe-{secrets.token_hex(8)}"
    try:
        dirfd = os.open(point, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        return Probe(f"cannot open: {exc.strerror}", errno.errorcode.get(exc.errno or 0, "")), used
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dirfd)
        try:
            os.write(fd, b"slurmagent write probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name, dir_fd=dirfd)
    except OSError as exc:
        return Probe(f"{exc.strerror}", errno.errorcode.get(exc.errno or 0, "")), used
    finally:
        os.close(dirfd)
    return Probe(), used


def _within(fn, deadline_s: float, name: str):
    """fn() in a thread abandoned past `deadline_s`: [result] or [] when it did not answer."""
    box: list = []
    worker = threading.Thread(target=lambda: box.append(fn()), daemon=True, name=name)
    worker.start()
    worker.join(deadline_s)
    return box


def probe(point: str, deadline_s: float, statvfs=os.statvfs) -> tuple[Probe, float | None]:
    """(the write probe's result, percent of the filesystem used or None), within `deadline_s`."""
    box = _within(lambda: _probe_now(point, statvfs), deadline_s, f"mount-probe {point}")
    if not box:
        return Probe(f"no answer within {deadline_s:g} s", "ETIMEDOUT", timed_out=True), None
    return box[0]


def used_percent(point: str, deadline_s: float, statvfs=os.statvfs) -> float | None:
    """How full the filesystem under `point` is (None: cannot tell within `deadline_s`)."""
    box = _within(lambda: _used(point, statvfs), deadline_s, f"statvfs {point}")
    return box[0] if box else None

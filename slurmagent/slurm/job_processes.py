"""The processes of one job on this node, with their states and the files they hold open.

One adapter for whoever needs to know what the job is doing here: the wrapper (which files
are being written when it must kill the trainer: those are torn), the hang watch (process
states), node checks (leftover processes). A job's processes are not "the wrapper's
children": ranks started by `srun` are slurmstepd's children, and the other nodes have no
wrapper. So a process belongs to the job when any of these holds, read from `/proc` (the
job's user can read its own processes' `environ`, `fd` and `fdinfo`; nothing is run):

* its cgroup path names the job (`.../job_<id>/...`: `proctrack/cgroup` and `task/cgroup`,
  cgroup v1 or v2, which real nodes use);
* its environment has `SLURM_JOB_ID=<id>` (`proctrack/linuxproc`, the test clusters: every
  process of a step inherits it);
* it is in one of the given sessions (outside Slurm: the wrapper's child starts a session).

Only processes of the given uid count (another user's process is never the job's), and
never the caller itself.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

_WRITE_MODES = (os.O_WRONLY, os.O_RDWR)


@dataclass(frozen=True)
class JobProcess:
    pid: int
    state: str  # /proc/<pid>/stat's letter: R running, S sleeping, D in the kernel, T stopped, Z zombie
    sid: int
    cmdline: str


@dataclass(frozen=True)
class OpenFile:
    path: str  # the absolute path the descriptor names
    pid: int
    appending: bool  # opened with O_APPEND (a log): it only grows, its earlier bytes stay


def proc_stat(pid: int, proc: str = "/proc") -> tuple[str, int] | None:
    """(state letter, session id) of a process; None when it is gone."""
    try:
        raw = Path(proc, str(pid), "stat").read_text()
    except (OSError, ValueError):
        return None
    try:
        fields = raw.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        return fields[0], int(fields[3])
    except (IndexError, ValueError):
        return None


def _read_at(dirfd: int, name: str, limit: int = 1 << 20) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def _process_facts(pid: int, proc: str) -> tuple[int, str, int, bytes, bytes] | None:
    """(owner uid, state, parent pid, cgroup, environ) of one process, all read through one open
    `/proc/<pid>` (a pid reused meanwhile reads as gone, never as a mix of two); None when gone."""
    try:
        dirfd = os.open(Path(proc, str(pid)), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        owner = os.fstat(dirfd).st_uid
        stat = _read_at(dirfd, "stat", 4096)
        if not stat:
            return None
        fields = stat.rsplit(b")", 1)[1].split()
        return owner, fields[0].decode("ascii", "replace"), int(fields[1]), \
            _read_at(dirfd, "cgroup") or b"", _read_at(dirfd, "environ") or b""
    except (OSError, ValueError, IndexError):
        return None
    finally:
        os.close(dirfd)


def _names_job(cgroup: bytes, environ: bytes, job_id: str) -> bool:
    """The job's, by its cgroup path (`.../job_<id>/...`) or its environment (`SLURM_JOB_ID=<id>`)."""
    mark = f"/job_{job_id}".encode()
    if any(line.endswith(mark) or mark + b"/" in line for line in cgroup.splitlines()):
        return True
    return f"SLURM_JOB_ID={job_id}".encode() in environ.split(b"\0")


def job_process_state(pid: int, job_id: str, uid: int, proc: str = "/proc") -> str | None:
    """The state letter of ``pid`` when it is a process of ``uid`` in job ``job_id`` on this node,
    else None (gone, another user's, another job's). A zombie has no environment left: it is the
    job's when its parent is. Root's own look at a rank a job's wrapper names (actions/root_evidence.py).
    Root in the watch unit has no CAP_SYS_PTRACE: another user's `environ` is closed to it, so there
    the cgroup (`proctrack/cgroup`, `task/cgroup`: real nodes) is what names the job."""
    if pid <= 1 or not job_id:
        return None
    facts = _process_facts(pid, proc)
    if facts is None or facts[0] != uid:
        return None
    _, state, parent, cgroup, environ = facts
    if _names_job(cgroup, environ, job_id):
        return state
    if state == "Z" and parent > 1:
        up = _process_facts(parent, proc)
        if up is not None and up[0] == uid and _names_job(up[3], up[4], job_id):
            return state
    return None


class JobProcesses:
    """This node's processes of a job (see module doc). `proc`: the /proc to read (tests)."""

    def __init__(self, job_id: str = "", sessions: Iterable[int] = (), uid: int | None = None,
                 proc: str = "/proc", me: int | None = None):
        self.job_id = job_id
        self.sessions = set(sessions)
        self.uid = os.geteuid() if uid is None else uid
        self.proc = proc
        self.me = os.getpid() if me is None else me

    def _belongs(self, pid: int, sid: int) -> bool:
        if sid in self.sessions:
            return True
        if not self.job_id:
            return False
        base = Path(self.proc, str(pid))
        try:
            cgroup = (base / "cgroup").read_text()
        except OSError:
            cgroup = ""
        if f"/job_{self.job_id}/" in cgroup or cgroup.rstrip().endswith(f"/job_{self.job_id}"):
            return True
        try:
            environ = (base / "environ").read_bytes()
        except OSError:
            return False
        return f"SLURM_JOB_ID={self.job_id}".encode() in environ.split(b"\0")

    def processes(self) -> list[JobProcess]:
        """The job's processes here, by pid."""
        out = []
        try:
            names = os.listdir(self.proc)
        except OSError:
            return out
        for name in names:
            if not name.isdigit() or int(name) == self.me:
                continue
            pid = int(name)
            try:
                if os.stat(Path(self.proc, name)).st_uid != self.uid:
                    continue
            except OSError:
                continue
            st = proc_stat(pid, self.proc)
            if st is None or not self._belongs(pid, st[1]):
                continue
            try:
                cmd = Path(self.proc, name, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = ""
            out.append(JobProcess(pid, st[0], st[1], cmd.strip()[:300]))
        return sorted(out, key=lambda p: p.pid)

    def open_for_writing(self, under: str | os.PathLike) -> list[OpenFile]:
        """Files below `under` that the job's processes hold open for writing now."""
        root = os.path.realpath(os.fspath(under)).rstrip("/") + "/"
        out = []
        for p in self.processes():
            fd_dir = Path(self.proc, str(p.pid), "fd")
            try:
                fds = os.listdir(fd_dir)
            except OSError:
                continue
            for fd in fds:
                try:
                    target = os.readlink(fd_dir / fd)
                except OSError:
                    continue
                if not target.startswith(root):
                    continue
                flags = _fd_flags(Path(self.proc, str(p.pid), "fdinfo", fd))
                if flags is None or flags & os.O_ACCMODE not in _WRITE_MODES:
                    continue
                out.append(OpenFile(target.removesuffix(" (deleted)"), p.pid, bool(flags & os.O_APPEND)))
        return out


def _fd_flags(fdinfo: Path) -> int | None:
    """The open flags of a descriptor (`flags:` in /proc/<pid>/fdinfo/<fd>, octal)."""
    try:
        for line in fdinfo.read_text().splitlines():
            if line.startswith("flags:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        return None
    return None


def appending_files(open_files: Iterable[OpenFile], ckpt_dir: str | os.PathLike) -> set[str]:
    """The checkpoint's relpaths held open for appending (logs): they only grow and never hold
    back the files beside them (`checkpoint/cut.py`)."""
    root = os.path.realpath(os.fspath(ckpt_dir)).rstrip("/") + "/"
    return {f.path[len(root):] for f in open_files if f.appending and f.path.startswith(root)}


def torn_files(open_files: Iterable[OpenFile], ckpt_dir: str | os.PathLike) -> set[str]:
    """The checkpoint's relpaths being rewritten (open for writing, not appending) now: a kill
    now leaves them torn, whatever they look like afterwards. An appending writer (a log) only
    grows and tears nothing before its end."""
    root = os.path.realpath(os.fspath(ckpt_dir)).rstrip("/") + "/"
    return {f.path[len(root):] for f in open_files if not f.appending and f.path.startswith(root)}


def checkpoint_writers(ckpt_dir: str | os.PathLike, job_id: str = "", sessions: Iterable[int] = ()
                       ) -> tuple[set[str], set[str]]:
    """(rewritten, appended): the relpaths of `ckpt_dir` the job's processes on this node hold
    open for writing now -- not appending (a save in progress: torn if killed now) and
    appending (a log: it only grows)."""
    held = JobProcesses(job_id, sessions).open_for_writing(ckpt_dir)
    return torn_files(held, ckpt_dir), appending_files(held, ckpt_dir)


_CGROUP_JOB = re.compile(rb"/job_([0-9]+)(?:/|$)", re.MULTILINE)


def job_of_pid(pid: int, proc: str = "/proc") -> str | None:
    """The Slurm job a process belongs to, by its cgroup path (`.../job_<id>/...`) or its environment
    (`SLURM_JOB_ID`); None when it names none or is gone (node checks: leftover GPU processes)."""
    facts = _process_facts(pid, proc)
    if facts is None:
        return None
    _, _, _, cgroup, environ = facts
    found = _CGROUP_JOB.search(cgroup)
    if found:
        return found.group(1).decode()
    for item in environ.split(b"\0"):
        if item.startswith(b"SLURM_JOB_ID=") and item[13:].isdigit():
            return item[13:].decode()
    return None

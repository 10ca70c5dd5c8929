"""The directories and files a job keeps on a node's disk, private to the job's user.

Every directory the wrapper or a node agent uses (the checkpoint directory, default or
`--ckpt-dir`, the `<dir>.uncommitted/` beside it, the per-user parent of the default directory
and of the requeue hold) must be owned by the job's user and writable by nobody else; it is
created mode 0700 without following a symlink. Another user who pre-creates one (e.g.
`/mnt/localssd/ckpt` 0777 with a planted `model.pt`) would get the trainer to load their file,
have it uploaded as the job's checkpoint, and read the job's new files: such a directory is
refused, never used. The files slurmagent keeps beside the checkpoint directory (the record of
what it held, the hash cache) follow the same rules. The parents of an explicit directory
(`/mnt/localssd`) are the administrator's and are not judged.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ..errors import NODE_LOCAL_ERRNOS, NodeDiskError, SlurmagentError

UNCOMMITTED_SUFFIX = ".uncommitted"
RECORD_SUFFIX = ".slurmagent-run.json"  # run/job.DirRecord
STATE_SUFFIX = ".sync-state.json"  # checkpoint/hash_cache.state_file_for


class UnsafeDirError(SlurmagentError):
    """A directory or file of the job that another user owns, can write, or points elsewhere."""

    exit_code = 2


class UnusableDirError(NodeDiskError, UnsafeDirError):
    """This node's path cannot hold the directory (a file where it should be, a full or
    read-only disk): not a refusal of someone else's directory, so under Slurm the job is
    requeued without this node (`restore_failure`)."""


def _cannot(what: str, exc: OSError, hint: str = "") -> UnsafeDirError:
    """The error for an OSError on our own path: unusable (node-local) or plain."""
    message = f"{what}: {exc.strerror or exc}{hint}"
    # not ours to use (permissions, a link) is a refusal, never "this node's disk"
    node_disk = exc.errno in NODE_LOCAL_ERRNOS and exc.errno not in (errno.ELOOP, errno.EACCES, errno.EPERM)
    return UnusableDirError(message) if node_disk else (
        UnsafeDirError(message))


def beside(ckpt_dir: Path, suffix: str) -> Path:
    return Path(str(ckpt_dir).rstrip("/") + suffix)


def _refuse_stat(st: os.stat_result, uid: int) -> str:
    if st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not by you (uid {uid})"
    if stat.S_IMODE(st.st_mode) & 0o022:
        return f"writable by other users (mode {stat.filemode(st.st_mode)})"
    return ""


def ensure_private_dir(d: Path, uid: int | None = None, *, what: str = "checkpoint dir", hint: str = "") -> Path:
    """Create `d` mode 0700, or accept it when it is a real directory (not a symlink) owned by
    `uid` that no other user can write; one only readable by others is made 0700 again."""
    uid = os.geteuid() if uid is None else uid
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise _cannot(f"cannot create {what} {d}", exc, hint) from None
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if os.path.islink(d):
            raise UnsafeDirError(f"refusing {what} {d}: it is a symlink (not created by you){hint}") from None
        raise _cannot(f"refusing {what} {d}", exc, f" (not created by you){hint}") from None
    try:
        st = os.fstat(fd)
        why = _refuse_stat(st, uid)
        if why:
            raise UnsafeDirError(f"refusing {what} {d}: {why}{hint}")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)  # ours: private again
    finally:
        os.close(fd)
    return d


def check_private_file(path: Path, uid: int | None = None, *, what: str = "checkpoint file") -> None:
    """`path`, when it exists, must be a regular file (not a symlink) of `uid` no other user can write."""
    uid = os.geteuid() if uid is None else uid
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UnsafeDirError(f"refusing {what} {path}: {exc.strerror or exc}") from None
    why = ("it is a symlink" if stat.S_ISLNK(st.st_mode) else
           "not a regular file" if not stat.S_ISREG(st.st_mode) else _refuse_stat(st, uid))
    if why:
        raise UnsafeDirError(f"refusing {what} {path}: {why}; remove it")


def create_private_file(path: Path) -> None:
    """Create `path` empty, mode 0600, when it does not exist (so that nobody else can put one
    there later: in a sticky shared parent only its owner may replace it)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    except FileExistsError:
        pass


def private_ckpt_dir(ckpt_dir: Path, uid: int | None = None) -> Path:
    """Make `ckpt_dir` usable by this job on this node, or refuse it in one line.

    Missing parents are created (0700); the directory itself follows `ensure_private_dir`;
    `<dir>.uncommitted/` when it exists, the record and the hash cache beside it must be the
    user's too, and the two files are created empty now, so nobody plants them later."""
    uid = os.geteuid() if uid is None else uid
    hint = "; remove it (check what is in it) or pass another --ckpt-dir"
    try:
        os.makedirs(ckpt_dir.parent, 0o700, exist_ok=True)
    except OSError as exc:
        raise _cannot(f"cannot create checkpoint dir {ckpt_dir}", exc) from None
    ensure_private_dir(ckpt_dir, uid, hint=hint)
    aside = beside(ckpt_dir, UNCOMMITTED_SUFFIX)
    if os.path.lexists(aside):
        ensure_private_dir(aside, uid, hint="; remove it")
    for suffix in (RECORD_SUFFIX, STATE_SUFFIX):
        path = beside(ckpt_dir, suffix)
        check_private_file(path, uid)
        try:
            create_private_file(path)
        except OSError as exc:
            raise _cannot(f"cannot create checkpoint file {path}", exc) from None
    return ckpt_dir


def user_tmp_parent(env: dict | None = None, uid: int | None = None) -> Path:
    """`${TMPDIR:-/tmp}/slurmagent-<uid>`: the user's private parent of default checkpoint
    directories and requeue holds (created 0700, a foreign or linked one refused)."""
    uid = os.geteuid() if uid is None else uid
    env = os.environ if env is None else env
    return ensure_private_dir(Path(env.get("TMPDIR") or "/tmp") / f"slurmagent-{uid}", uid,
                              hint="; remove it or set TMPDIR")

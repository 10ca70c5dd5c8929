"""What a wrapped run (`slurmagent run`) starts from: who the job is, its options, the
outcome it reports, and its private checkpoint directory with a record of what it last held.

Kept apart from the supervisor's loop (`run/supervisor.py`) so that the wiring (`run/main.py`) and
the tests build a run without going through the loop.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..checkpoint.manifest import Manifest, entry_content_id
from ..checkpoint.scan import scan_checkpoint_dir
from ..errors import SlurmagentError
from ..policy import job_requests
from ..slurm import env as slurm_env
from ..slurm.model import FAULT_FLUSH_SIGNAL
from ..state.host import node_name
from ..state.fsutil import replace_private
from ..state.private_dirs import RECORD_SUFFIX, UnsafeDirError, UnusableDirError, ensure_private_dir, private_ckpt_dir
from .identity import submission_of

UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)
JOB_ID_RE = re.compile(r"[0-9]+(_[0-9]+)?")  # a Slurm job id, or ARRAYJOBID_TASKID


class WrapperError(SlurmagentError):
    """The wrapper cannot start the job safely (bad option, unsafe directory, restore failed)."""


@dataclass(frozen=True)
class JobIdentity:
    """Who we are: a Slurm job (array task), a Cloud Run task, or a plain process."""

    platform: str  # "slurm" | "cloud-run" | "local"
    job_id: str  # what `scontrol requeue` takes (ARRAYJOBID_TASKID for array tasks)
    name: str  # the remote prefix's last part
    restart_count: int
    aliases: tuple[str, ...] = ()  # every id the job's own code may name it by (SLURM_JOB_ID too)
    # The same for every attempt of one submission, new for every submission (slurmagent.run.identity):
    # SLURMAGENT_SUBMISSION (slurmagent sbatch) or CLOUD_RUN_EXECUTION; "" for a plain sbatch job.
    submission: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> JobIdentity:
        slurm_job = slurm_env.job_id(env)
        if slurm_job is not None:
            job_id = slurm_env.array_task_id(env) or slurm_job
            aliases = tuple(dict.fromkeys(i for i in (job_id, slurm_job) if JOB_ID_RE.fullmatch(i)))
            return cls("slurm", job_id, job_id, slurm_env.restart_count(env), aliases, _submission(env, "slurm"))
        if env.get("CLOUD_RUN_JOB"):
            job, index = env["CLOUD_RUN_JOB"], env.get("CLOUD_RUN_TASK_INDEX", "0")
            return cls("cloud-run", job, f"{job}-task-{index}", slurm_env.count(env.get("CLOUD_RUN_TASK_ATTEMPT")),
                       submission=_submission(env, "cloud-run"))
        return cls("local", str(os.getpid()), f"local-{os.getpid()}", 0)


def _submission(env: Mapping[str, str], platform: str) -> str:
    try:
        return submission_of(env, platform)
    except ValueError as exc:
        raise WrapperError(f"{exc}: not a submission id; not starting") from None


@dataclass
class RunOptions:
    cmd: list[str]
    ckpt_dir: Path
    remote: str = ""
    ckpt_signal: int = signal.SIGUSR1
    grace_s: float = 90.0
    max_requeues: int = 3
    sync_interval_s: float = 60.0
    flush_lead_s: float = 120.0
    expiry_files: tuple[Path, ...] = ()
    restore_deadline_s: float = 600.0
    final_sync_floor_s: float = 15.0
    multi_node: bool = False  # restore always takes the committed manifest
    per_job_remote: bool = False  # the default prefix: another submission's checkpoint there is foreign
    stop_wait_s: float = 10.0  # after a held requeue: SIGTERM, this long, then SIGKILL
    progress_report_s: float = 15.0  # a restore that takes longer says what it is doing this often
    error_report_s: float = 300.0  # a background sync that keeps failing is said at most this often
    sync_deadline_s: float = 30.0  # a background sync may take the longer of this and the interval
    keep_uncommitted: int = 3  # sets kept in <dir>.uncommitted/ (run/uncommitted.py)


@dataclass
class Outcome:
    """What happened, for the exit code, the last log line and the tests."""

    exit_code: int
    flushed: bool = False
    flush_cause: str = ""
    requeued: bool = False
    requeue_refused: str = ""  # why the job was not requeued after a flush
    held_requeue: bool = False  # the job asked for its own requeue (held by our scontrol)
    child_killed: bool = False
    child_code: int | None = None
    synced: bool = False
    resumed: bool = False
    no_progress: int = 0  # this attempt's no-progress streak (0: it made progress)
    flush_seconds: float = 0.0
    bytes_synced: int = 0
    summary: str = ""  # the last stderr line: which exit code and why


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def parse_signal(name: str) -> int:
    """A catchable signal by name (USR1, SIGUSR1) or number; anything else is a usage error."""
    raw = name.strip().upper()
    if raw.isdigit():
        num = int(raw)
        if num not in signal.valid_signals():
            raise WrapperError(f"--ckpt-signal {name}: no such signal on this system (1..{signal.NSIG - 1})")
    else:
        try:
            num = int(getattr(signal, raw if raw.startswith("SIG") else "SIG" + raw))
        except (AttributeError, TypeError):
            raise WrapperError(f"--ckpt-signal {name}: unknown signal name") from None
    if num in UNCATCHABLE:
        raise WrapperError(f"--ckpt-signal {name}: {signal_name(num)} cannot be caught, so the job could never checkpoint")
    return num


# --- the default checkpoint directory: private to the user ------------------------------


def default_ckpt_dir(env: Mapping[str, str], ident: JobIdentity, uid: int | None = None) -> Path:
    """`${TMPDIR:-/tmp}/slurmagent-<uid>/<job>`: a per-user parent, so no other user can
    create, replace or read a job's directory (see `make_private_dir`)."""
    uid = os.geteuid() if uid is None else uid
    return Path(env.get("TMPDIR") or "/tmp") / f"slurmagent-{uid}" / ident.name


def make_private_dir(path: Path, uid: int | None = None) -> Path:
    """Create `path` and its per-user parent with mode 0700, or accept them when they exist as
    real directories owned by `uid` that no other user can write. A symlink or a directory of
    another user (planted in a shared /tmp to read or replace the checkpoint) is refused, never
    followed or used (`private_dirs`)."""
    try:
        for d in (path.parent, path):
            ensure_private_dir(d, uid, hint="; remove it or pass --ckpt-dir")
    except UnsafeDirError as exc:
        raise WrapperError(str(exc)) from None
    return path


def explicit_ckpt_dir(path: Path, uid: int | None = None, *, defer_unusable: bool = False) -> Path:
    """An explicit `--ckpt-dir` under the same rules as the default one (its parents, e.g.
    `/mnt/localssd`, are the administrator's): see `private_dirs.private_ckpt_dir`.
    `defer_unusable` (a Slurm job): a path this node cannot hold is left to the restore step,
    which requeues the job without this node (`restore_failure`); a refusal stays a refusal."""
    try:
        return private_ckpt_dir(path, uid)
    except UnsafeDirError as exc:
        if defer_unusable and isinstance(exc, UnusableDirError):
            return path
        raise WrapperError(str(exc)) from None


def expand_node(path: str, env: Mapping[str, str]) -> str:
    """`%n` -> this node's name, so per-node paths work when several slurmd share a host."""
    return path.replace("%n", node_name(None, env))


# --- what this directory last matched: a committed manifest, or (no remote) a scan -------


def manifest_id(m: Manifest) -> str:
    """Identifies one committed manifest (attempt, time, names and content hashes)."""
    files = {rel: entry_content_id(e) for rel, e in m.files.items()}
    return hashlib.sha256(json.dumps([m.attempt, m.created, files], sort_keys=True).encode()).hexdigest()


def stat_scan(ckpt_dir: Path) -> dict[str, list[int]]:
    """{relpath: [size, mtime_ns]} of the checkpoint files (cheap: no file is read)."""
    return {f.relpath: [f.size, f.mtime_ns] for f in scan_checkpoint_dir(ckpt_dir)}


def dir_owner(ident: JobIdentity) -> str:
    """Which job the files of a checkpoint directory belong to, as the record beside it says:
    another job's record (another id, another prefix) never makes its files this job's. Built
    from the job's identity only, so a per-submission identity makes it per submission too.
    Outside Slurm and Cloud Run a rerun with the same directory is the same job ("rerun to
    resume")."""
    if ident.platform == "local":
        return "local"
    owner = f"{ident.platform}:{ident.job_id}:{ident.name}"
    return f"{owner}:{ident.submission}" if ident.submission else owner


def fresh_attempt(ident: JobIdentity) -> bool:
    """A plain `sbatch` job's first attempt: its job id may be an earlier job's (a controller
    with fresh state, ids wrapping) and it has no submission id, so no file it finds can be its
    own (`slurmagent.run.identity` applies the same rule to the bucket)."""
    return ident.platform == "slurm" and not ident.submission and ident.restart_count == 0


class DirRecord:
    """A small JSON file beside the checkpoint directory (never inside it): which job wrote
    the directory's files (`owner`, `remote`), which committed manifest it last held (restored,
    or synced from it), and, without a remote, the file list and no-progress streak of the
    last attempt. Read only when it is the user's own (`private_dirs`)."""

    def __init__(self, ckpt_dir: Path, owner: str = "", remote: str = "", fresh: bool = False):
        self.path = Path(str(ckpt_dir).rstrip("/") + RECORD_SUFFIX)
        self.owner = owner
        self.remote = remote
        self.fresh = fresh  # `fresh_attempt`: no record is this attempt's own

    def read(self) -> dict:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return {}
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022 or not stat.S_ISREG(st.st_mode):
                return {}  # not ours: never trusted
            with os.fdopen(os.dup(fd), "rb") as fh:
                data = json.loads(fh.read(16 << 20) or b"null")
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}
        finally:
            os.close(fd)

    def is_mine(self, data: dict) -> bool:
        """Did this job (same owner, same remote) write the record `data`?"""
        return (bool(self.owner) and not self.fresh and data.get("owner") == self.owner
                and data.get("remote", "") == self.remote)

    def write(self, **data) -> None:
        body = json.dumps({"version": 1, "owner": self.owner, "remote": self.remote, **data}, sort_keys=True)
        try:
            replace_private(self.path, body)
        except OSError:
            pass  # only costs a full restore next time


JOB_GAUGES = ("slurmagent_checkpoint_lag_seconds", "slurmagent_checkpoint_age_seconds")  # labelled {job_id}


def job_gauges(job: str, lag_s: float, store, now: float) -> dict[tuple, float]:
    """This job's gauges after a background round: the bucket's lag behind the disk, and the age
    of the newest committed checkpoint (absent until the first commit)."""
    from ..checkpoint.report import age_s  # start-up speed: the first round, not the import

    out = {(JOB_GAUGES[0], (("job_id", job),)): lag_s}
    committed = getattr(store, "last_committed", None)
    age = age_s(getattr(committed, "created", None), now)
    if age is not None:
        out[(JOB_GAUGES[1], (("job_id", job),))] = age
    return out


def job_series(job: str) -> tuple[str, ...]:
    """The prefixes of this job's gauge series, removed when the attempt ends."""
    return job_requests.job_series(JOB_GAUGES, job)


FAULT_GRACE_S = 5.0  # a fault flush waits at most this long for the trainer (instead of --grace)


def is_fault(cause: str) -> bool:
    """Was the flush started by the fault flush signal (a GPU died under the job)?"""
    return cause == signal.Signals(FAULT_FLUSH_SIGNAL).name


def flush_grace(grace_s: float, cause: str) -> float:
    """How long the trainer may take to checkpoint: `--grace`, at most FAULT_GRACE_S on a fault."""
    return min(grace_s, FAULT_GRACE_S) if is_fault(cause) or cause.startswith("hang: ") else grace_s

"""What a wrapped run (`slurmagent run`) starts from: who the job is, its options, the
outcome it reports, and its private checkpoint directory with a record of what it last held.

Kept apart from the supervisor's loop (`wrapper.py`) so that the wiring (`runner.py`) and
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

from .checkpoint import Manifest, entry_content_id, scan_checkpoint_dir
from .errors import SlurmagentError
from .fsutil import atomic_write_text
from .host import node_name
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
    # The same for every attempt of one submission, new for every submission (slurmagent.identity):
    # SLURMAGENT_SUBMISSION (slurmagent sbatch) or CLOUD_RUN_EXECUTION; "" for a plain sbatch job.
    submission: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> JobIdentity:
        if env.get("SLURM_JOB_ID"):
            array_job, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
            job_id = f"{array_job}_{task}" if array_job and task else env["SLURM_JOB_ID"]
            aliases = tuple(dict.fromkeys(i for i in (job_id, env["SLURM_JOB_ID"]) if JOB_ID_RE.fullmatch(i)))
            return cls("slurm", job_id, job_id, _int(env.get("SLURM_RESTART_COUNT")), aliases,
                       _submission(env, "slurm"))
        if env.get("CLOUD_RUN_JOB"):
            job, index = env["CLOUD_RUN_JOB"], env.get("CLOUD_RUN_TASK_INDEX", "0")
            return cls("cloud-run", job, f"{job}-task-{index}", _int(env.get("CLOUD_RUN_TASK_ATTEMPT")),
                       submission=_submission(env, "cloud-run"))
        return cls("local", str(os.getpid()), f"local-{os.getpid()}", 0)


def _submission(env: Mapping[str, str], platform: str) -> str:
    try:
        return submission_of(env, platform)
    except ValueError as exc:
        raise WrapperError(f"{exc}: not a submission id; not starting") from None


def _int(value: str | None) -> int:
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0


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
    real directories owned by `uid`. A symlink or a directory of another user (planted in a
    shared /tmp to read or replace the checkpoint) is refused, never followed or used."""
    uid = os.geteuid() if uid is None else uid
    for d in (path.parent, path):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise WrapperError(f"cannot create checkpoint dir {d}: {exc.strerror}; pass --ckpt-dir") from None
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            why = "it is a symlink" if os.path.islink(d) else (exc.strerror or str(exc))
            raise WrapperError(f"refusing checkpoint dir {d}: {why} (not created by you); "
                               "remove it or pass --ckpt-dir") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != uid:
                raise WrapperError(f"refusing checkpoint dir {d}: owned by uid {st.st_uid}, not by you (uid {uid}); "
                                   "remove it or pass --ckpt-dir")
            if stat.S_IMODE(st.st_mode) & 0o077:
                os.fchmod(fd, 0o700)  # ours: make it private again
        finally:
            os.close(fd)
    return path


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


class DirRecord:
    """A small JSON file beside the checkpoint directory (never inside it): which committed
    manifest the directory last held (restored, or synced from it), and, without a remote,
    the file list and no-progress streak of the last attempt."""

    def __init__(self, ckpt_dir: Path):
        self.path = Path(str(ckpt_dir).rstrip("/") + ".slurmagent-run.json")

    def read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def write(self, **data) -> None:
        try:
            atomic_write_text(self.path, json.dumps({"version": 1, **data}, sort_keys=True), 0o600)
        except OSError:
            pass  # only costs a full restore next time

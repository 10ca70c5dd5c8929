"""`slurmagent run -- CMD`: supervise a training process so an interruption costs one flush.

SIGTERM / SIGUSR1 to the wrapper (Slurm's end-of-time signal, preemption, maintenance) or
the VM's expiry lead starts ONE flush: the checkpoint signal to the child's process group,
up to `--grace` for it to write and exit, a final sync to Cloud Storage, `scontrol requeue`
(capped by our own `--max-requeues` against SLURM_RESTART_COUNT), exit 143. The signal
handler only records; the main loop acts (submitit style).

A fault flush (`nodes.FAULT_FLUSH_SIGNAL`, SIGPWR, sent by `watch`/`healthcheck` when a GPU
died under the job) is the same flush with at most FAULT_GRACE_S for the trainer, which may
hang on the dead GPU: the last committed checkpoint is what counts. A child that does not
die after SIGKILL (stuck in the kernel on that GPU) is left behind after REAP_WAIT_S, so the
sync and the requeue still happen.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Mapping, Protocol, TextIO

from .errors import SlurmagentError
from .expiry_state import termination_time
from .host import node_name
from .nodes import FAULT_FLUSH_SIGNAL

EXIT_FLUSHED = 143
FLUSH_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, FAULT_FLUSH_SIGNAL)
FAULT_GRACE_S = 5.0  # a fault flush waits at most this long for the trainer (instead of --grace)
REAP_WAIT_S = 10.0  # after SIGKILL: a child stuck in uninterruptible sleep is left behind after this
FORWARD_SIGNALS = (signal.SIGUSR2, signal.SIGHUP, signal.SIGINT)


class CheckpointStore(Protocol):
    def sync(self, ckpt_dir, attempt: int, state_file, deadline_s: float = ...): ...
    def restore(self, ckpt_dir, *, deadline_s: float = ...): ...


class WrapperError(SlurmagentError):
    """The wrapper cannot start the job safely (bad option, restore failed)."""


@dataclass(frozen=True)
class JobIdentity:
    """Who we are: a Slurm job (array task), a Cloud Run task, or a plain process."""

    platform: str  # "slurm" | "cloud-run" | "local"
    job_id: str  # what `scontrol requeue` takes (ARRAYJOBID_TASKID for array tasks)
    name: str  # the remote prefix's last part
    restart_count: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> JobIdentity:
        if env.get("SLURM_JOB_ID"):
            array_job, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
            job_id = f"{array_job}_{task}" if array_job and task else env["SLURM_JOB_ID"]
            return cls("slurm", job_id, job_id, _int(env.get("SLURM_RESTART_COUNT")))
        if env.get("CLOUD_RUN_JOB"):
            job, index = env["CLOUD_RUN_JOB"], env.get("CLOUD_RUN_TASK_INDEX", "0")
            return cls("cloud-run", job, f"{job}-task-{index}", _int(env.get("CLOUD_RUN_TASK_ATTEMPT")))
        return cls("local", str(os.getpid()), f"local-{os.getpid()}", 0)


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


@dataclass
class Outcome:
    """What happened, for the exit code, the log line and the tests."""

    exit_code: int
    flushed: bool = False
    flush_cause: str = ""
    requeued: bool = False
    child_killed: bool = False
    synced: bool = False
    resumed: bool = False
    flush_seconds: float = 0.0
    bytes_synced: int = 0
    messages: list[str] = field(default_factory=list)


def parse_signal(name: str) -> int:
    name = name.upper()
    if name.isdigit():
        return int(name)
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return int(getattr(signal, name))
    except AttributeError:
        raise WrapperError(f"unknown signal {name!r}") from None


def default_ckpt_dir(env: Mapping[str, str], ident: JobIdentity) -> Path:
    return Path(env.get("TMPDIR") or "/tmp") / "slurmagent" / ident.name


def expand_node(path: str, env: Mapping[str, str]) -> str:
    """`%n` -> this node's name, so per-node paths work when several slurmd share a host."""
    return path.replace("%n", node_name(None, env))


class Supervisor:
    def __init__(
        self,
        opts: RunOptions,
        ident: JobIdentity,
        store: CheckpointStore | None,
        requeue: Callable[[str], None] | None,
        env: Mapping[str, str],
        err: TextIO = sys.stderr,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.opts = opts
        self.ident = ident
        self.store = store
        self.requeue = requeue
        self.env = env
        self.err = err
        self.clock = clock
        self.pending: list[int] = []  # signals recorded by the handler, acted on by the loop
        self.sync_lock = threading.Lock()
        self.stop_sync = threading.Event()
        self.state_file = Path(str(opts.ckpt_dir).rstrip("/") + ".sync-state.json")
        self.last_sync_error = ""
        self.bytes_synced = 0
        self.child: subprocess.Popen | None = None

    def child_running(self) -> bool:
        """True while the command runs (a multi-node store then commits consistent cuts only)."""
        return self.child is not None and self.child.poll() is None

    def say(self, message: str) -> None:
        print(f"slurmagent run: {message}", file=self.err, flush=True)

    # --- phases ---------------------------------------------------------------------------

    def restore(self) -> bool:
        self.opts.ckpt_dir.mkdir(parents=True, exist_ok=True)
        if self.store is None:
            return False
        manifest = self.store.restore(self.opts.ckpt_dir, deadline_s=self.opts.restore_deadline_s)
        if manifest is None:
            self.say(f"no checkpoint at {self.opts.remote}: starting fresh")
            return False
        self.say(f"restored checkpoint of attempt {manifest.attempt} ({len(manifest.files)} files) from {self.opts.remote}")
        return True

    def sync(self, deadline_s: float, final: bool = False) -> bool:
        if self.store is None:
            return False
        with self.sync_lock:
            try:
                result = self.store.sync(self.opts.ckpt_dir, self.ident.restart_count, self.state_file, deadline_s=deadline_s)
            except SlurmagentError as exc:
                self.last_sync_error = str(exc)
                if final:
                    self.say(f"final sync failed: {exc}; the local checkpoint in {self.opts.ckpt_dir} is kept")
                return False
        self.bytes_synced += result.bytes_sent
        if final:
            self.say(f"final sync: {result.files_sent} file(s), {result.bytes_sent} bytes sent to {self.opts.remote}")
        return True

    def _background_sync(self) -> None:
        while not self.stop_sync.wait(self.opts.sync_interval_s):
            self.sync(deadline_s=max(self.opts.sync_interval_s, 30.0))

    # --- main loop ------------------------------------------------------------------------

    def _record(self, signum: int, _frame) -> None:
        self.pending.append(signum)

    def run(self) -> Outcome:
        outcome = Outcome(exit_code=0)
        try:
            outcome.resumed = self.restore()
        except SlurmagentError as exc:
            raise WrapperError(f"cannot restore the checkpoint ({exc}); not starting, so it cannot be overwritten") from None
        child_env = dict(self.env)
        child_env.update(
            SLURMAGENT_CKPT_DIR=str(self.opts.ckpt_dir),
            SLURMAGENT_RESTART_COUNT=str(self.ident.restart_count),
        )
        child_env.pop("SLURMAGENT_RESUMED", None)
        if outcome.resumed:
            child_env["SLURMAGENT_RESUMED"] = "1"
        previous = {s: signal.signal(s, self._record) for s in (*FLUSH_SIGNALS, *FORWARD_SIGNALS, signal.SIGCONT)}
        try:
            try:
                child = subprocess.Popen(self.opts.cmd, env=child_env, start_new_session=True)
            except OSError as exc:
                raise WrapperError(f"cannot start {self.opts.cmd[0]}: {exc.strerror or exc}") from None
            self.child = child
            syncer = threading.Thread(target=self._background_sync, name="ckpt-sync", daemon=True)
            if self.store is not None:
                syncer.start()
            cause = self._supervise(child)
            self.stop_sync.set()
            if cause is None:
                code = child.returncode
                outcome.exit_code = code if code >= 0 else 128 - code
                outcome.synced = self.sync(deadline_s=300.0, final=True)
                outcome.bytes_synced = self.bytes_synced
                return outcome
            return self._flush(child, cause, outcome)
        finally:
            self.stop_sync.set()
            for s, h in previous.items():
                signal.signal(s, h)

    def _supervise(self, child: subprocess.Popen) -> str | None:
        """Wait for the child; return the flush cause, or None when the child exited by itself."""
        next_expiry_check = 0.0
        while True:
            try:
                child.wait(timeout=0.1)
                return None
            except subprocess.TimeoutExpired:
                pass
            while self.pending:
                signum = self.pending.pop(0)
                if signum in FLUSH_SIGNALS:
                    return signal.Signals(signum).name
                if signum in FORWARD_SIGNALS:
                    _killpg(child, signum)
            now = self.clock()
            if self.opts.expiry_files and now >= next_expiry_check:
                next_expiry_check = now + 5.0
                end = termination_time(self.opts.expiry_files)
                if end is not None:
                    left = (end - datetime.now(timezone.utc)).total_seconds()
                    if left <= self.opts.flush_lead_s:
                        return f"VM expiry in {max(left, 0):.0f} s"

    def _flush(self, child: subprocess.Popen, cause: str, outcome: Outcome) -> Outcome:
        started = self.clock()
        outcome.flushed, outcome.flush_cause = True, cause
        grace = flush_grace(self.opts.grace_s, cause)
        self.say(f"{cause}: asking the job to checkpoint ({signal.Signals(self.opts.ckpt_signal).name}, grace {grace:g} s"
                 + (": a GPU failed under the job, the last committed checkpoint counts)" if is_fault(cause) else ")"))
        _killpg(child, self.opts.ckpt_signal)
        deadline = started + grace
        while child.poll() is None and self.clock() < deadline:
            time.sleep(0.05)  # further signals are recorded but start no second flush
        if child.poll() is None:
            outcome.child_killed = True
            self.say(f"the job did not exit within {grace:g} s: stopping it; the last complete checkpoint stays")
            _killpg(child, signal.SIGTERM)
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _killpg(child, signal.SIGKILL)
                if not reap(child, REAP_WAIT_S):
                    self.say(f"the job did not die {REAP_WAIT_S:g} s after SIGKILL (stuck in the kernel?): "
                             "leaving it behind to sync and requeue")
        left = max(deadline - self.clock(), self.opts.final_sync_floor_s)
        outcome.synced = self.sync(deadline_s=left, final=True)
        self._maybe_requeue(outcome)
        outcome.exit_code = EXIT_FLUSHED
        outcome.flush_seconds = self.clock() - started
        outcome.bytes_synced = self.bytes_synced
        return outcome

    def _maybe_requeue(self, outcome: Outcome) -> None:
        if self.ident.platform != "slurm" or self.requeue is None:
            if self.ident.platform == "cloud-run":
                self.say("exiting 143 so Cloud Run retries the task")
            return
        count, cap = self.ident.restart_count, self.opts.max_requeues
        if count >= cap:
            self.say(f"not requeueing job {self.ident.job_id}: it was restarted {count} times (--max-requeues {cap})")
            return
        try:
            self.requeue(self.ident.job_id)
            outcome.requeued = True
            self.say(f"requeued job {self.ident.job_id} (restart {count + 1} of at most {cap})")
        except SlurmagentError as exc:
            self.say(f"requeue of job {self.ident.job_id} failed: {exc}")


def is_fault(cause: str) -> bool:
    """Was the flush started by the fault flush signal (a GPU died under the job)?"""
    return cause == signal.Signals(FAULT_FLUSH_SIGNAL).name


def flush_grace(grace_s: float, cause: str) -> float:
    """How long the trainer may take to checkpoint: `--grace`, at most FAULT_GRACE_S on a fault."""
    return min(grace_s, FAULT_GRACE_S) if is_fault(cause) else grace_s


def reap(child: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for a killed child at most `timeout_s`; False when it is still there (a process in
    uninterruptible sleep, e.g. a driver call on a dead GPU, dies only when that call returns)."""
    try:
        child.wait(timeout=timeout_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def _killpg(child: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(child.pid, signum)
    except ProcessLookupError:
        pass
    except PermissionError:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

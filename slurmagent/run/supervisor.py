"""`slurmagent run -- CMD`: supervise a training process so an interruption costs one flush.

SIGTERM / SIGUSR1 to the wrapper (Slurm's end-of-time signal, preemption, maintenance) or
the VM's expiry lead starts ONE flush: the checkpoint signal to the child's process group,
up to `--grace` for it to write and exit, a final sync to Cloud Storage, `scontrol requeue`
(unless the job keeps restarting without progress: `--max-requeues` consecutive attempts
whose committed checkpoint is the one they restored), exit 143. The signal handler only
records; the main loop acts (submitit style).

A child that requeues its own job (PyTorch Lightning's auto-requeue, submitit) finds our
`scontrol` first on its PATH: the request is recorded and held until the final sync is
done, then issued once, so Slurm's kill timer never starts while the upload runs.

A fault flush (`slurm/model.FAULT_FLUSH_SIGNAL`, SIGPWR, sent by `watch`/`healthcheck` when a GPU
died under the job) is the same flush with at most FAULT_GRACE_S for the trainer, which may
hang on the dead GPU: the last committed checkpoint is what counts. A child that does not
die after SIGKILL (stuck in the kernel on that GPU) is left behind (`run/child.py`), so
the sync and the requeue still happen. Who the job is, its options and its directory are
`run/job.py`'s.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Callable, Mapping, Protocol, TextIO

from ..checkpoint.manifest import Manifest, no_progress_after
from ..checkpoint.hash_cache import state_file_for
from ..checkpoint.cut import committed_part
from ..slurm.job_processes import checkpoint_writers
from .child import KillWatch, RequeueHold, exit_by_itself, kill_group, killpg, signal_at_exit, terminate_group
from ..checkpoint.report import CheckpointReport
from ..errors import SlurmagentError
from ..state.expiry_state import termination_time
from .identity import SUBMISSION_ENV
from ..slurm.model import FAULT_FLUSH_SIGNAL, JobInfo
from .requeue import REQUEUE_MIN_S, RequeueResult, RequeueVerb, requeue_own_job
from .restore_failure import NodeExcluder, failed_nodes, requeue_without
from .job import FAULT_GRACE_S, DirRecord, JobIdentity, Outcome, RunOptions, WrapperError  # noqa: F401 - re-export
from .job import dir_owner, flush_grace, fresh_attempt, is_fault, job_gauges, job_series, manifest_id, signal_name, stat_scan
from .start_dir import prepare_dir, run_watched

EXIT_FLUSHED = 143  # flushed and requeued (or, outside Slurm, handed back for a retry)
EXIT_REQUEUE_REFUSED = 75  # EX_TEMPFAIL: flushed, but the job was NOT requeued
FLUSH_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, FAULT_FLUSH_SIGNAL)
FORWARD_SIGNALS = (signal.SIGUSR2, signal.SIGHUP, signal.SIGINT)
SELF_REQUEUE_CAUSE = "the job requeued itself"


class SyncResultLike(Protocol):
    files_sent: int
    bytes_sent: int
    manifest: Manifest | None


class CheckpointStore(Protocol):
    url: str

    def sync(self, ckpt_dir, attempt: int, state_file, deadline_s: float = ..., restored: Manifest | None = ...
             ) -> SyncResultLike: ...

    def restore(self, ckpt_dir, *, deadline_s: float = ..., state_file=...) -> Manifest | None: ...

    def latest_manifest(self, *, deadline_s: float = ...) -> Manifest | None: ...


class MetricsSink(Protocol):
    def update(self, set_: dict | None = None, add: dict | None = None,
               replace_prefix: str | tuple[str, ...] | None = None) -> None: ...


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
        hold: RequeueHold | None = None,
        metrics: MetricsSink | None = None,
        report: CheckpointReport | None = None,
        read_job: Callable[[str], JobInfo | None] | None = None,
    ):
        self.opts = opts
        self.ident = ident
        self.store = store
        self.requeue = requeue
        self.env = env
        self.err = err
        self.clock = clock
        self.hold = hold
        self.metrics = metrics
        self.slurm_nodes: NodeExcluder | None = None  # Slurm: a node's disk failed the restore -> ExcNodeList
        self.report = report  # what the job's owner sees: stderr at a low rate, `status --job`
        self.last_sync: tuple = ()  # (manifest, seconds, files sent, bytes sent, held-back units)
        self.read_job = read_job  # the job's state before a requeue: a job being cancelled is never requeued
        self.flush_deadline: float | None = None
        self.pending: list[int] = []  # signals recorded by the handler, acted on by the loop
        if store is not None and getattr(store, "warn", False) is None:
            store.warn = self.say  # files a sync leaves out are said on the job's stderr, like ours
        self.sync_lock = threading.Lock()
        self.stop_sync = threading.Event()
        self.state_file = state_file_for(opts.ckpt_dir)
        self.record = DirRecord(opts.ckpt_dir, dir_owner(ident), self.remote,  # which job wrote the files
                                fresh_attempt(ident))
        self.last_sync_error = ""
        self.bytes_synced = 0
        self.baseline: Manifest | None = None  # the committed checkpoint this attempt started from
        self.committed: Manifest | None = None  # the checkpoint committed now (baseline until a sync)
        self.start_scan: dict[str, list[int]] = {}
        self.committed_scan: dict[str, list[int]] = {}  # files as they were when last committed
        self.dirty_since: dict[str, float] = {}  # file -> mtime of its first change not committed
        self.store_pending_since: float | None = None  # the store's oldest uncommitted change (other nodes')
        self.sync_failures = 0
        self.failing_since = 0.0
        self.last_error_said = float("-inf")
        self.child: subprocess.Popen | None = None
        self.hang = None  # hang/monitor.HangMonitor: a stall is a flush cause; evidence, then kill, no ckpt signal

    def child_running(self) -> bool:
        """True while the command runs (a multi-node store then commits consistent cuts only)."""
        return self.child is not None and self.child.poll() is None

    def open_files(self) -> tuple[set[str], set[str]]:
        """`checkpoint_writers` of the child's session and, under Slurm, every process of the job."""
        return checkpoint_writers(self.opts.ckpt_dir, self.ident.job_id if self.ident.platform == "slurm" else "",
                                  [self.child.pid] if self.child is not None else [])

    def _record_torn(self) -> None:
        """Just before the trainer is killed: files being written now are torn, whatever they
        look like afterwards, and stay out of the final commit (`checkpoint/cut.py`). A multi-node
        job's store asks every node's agent (`node-agent writers`)."""
        record = getattr(self.store, "record_torn", None)
        if record is not None:  # at most 10 s, less when the flush has less left (3 s at least: one srun round)
            left = (self.flush_deadline or 0.0) - self.clock()
            record(self.opts.ckpt_dir, deadline_s=min(10.0, max(3.0, left)))
        elif hasattr(self.store, "torn"):
            self.store.torn = self.open_files()[0]

    def say(self, message: str) -> None:
        print(f"slurmagent run: {message}", file=self.err, flush=True)

    @property
    def remote(self) -> str:
        return self.opts.remote or getattr(self.store, "url", "")

    # --- start: the directory ---------------------------------------------------------------

    def prepare_dir(self) -> bool:
        """The directory at start (`start_dir.prepare_dir`); True when it holds a checkpoint."""
        start = prepare_dir(self.opts, self.ident, self.store, self.record, self.state_file, self.remote, self.say)
        if start.baseline is not None:
            self.baseline = self.committed = start.baseline
        return start.resumed

    def _prepare_dir_watched(self) -> bool | None:
        """`prepare_dir` in a thread: flush signals stay handled (None: one came, do not start)."""
        return run_watched(self.prepare_dir, lambda: any(s in FLUSH_SIGNALS for s in self.pending), self.clock,
                           self.opts.progress_report_s, self.opts.restore_deadline_s, self.remote, self.say)

    # --- sync ---------------------------------------------------------------------------------

    def sync(self, deadline_s: float, final: bool = False) -> bool:
        if self.store is None:
            return False
        started = self.clock()
        # A sync still in flight (the periodic one) is waited for only within this deadline:
        # the flush's deadline holds, and the blobs it sent are not sent again.
        if not self.sync_lock.acquire(timeout=max(deadline_s, 0.0)):
            self._sync_failed(WrapperError(f"the previous sync was still running at the deadline of {deadline_s:g} s"),
                              final)
            return False
        try:
            left = deadline_s - (self.clock() - started)
            before = stat_scan(self.opts.ckpt_dir)
            try:
                if left <= 0:
                    raise WrapperError(f"no time left of the deadline of {deadline_s:g} s")
                result = self.store.sync(self.opts.ckpt_dir, self.ident.restart_count, self.state_file,
                                         deadline_s=left, restored=self.baseline)
            except Exception as exc:  # noqa: BLE001 - any failure is one line; the job goes on
                if not final and self.stop_sync.is_set():
                    return False  # a periodic round the flush (or the job's end) stopped: no failure
                self._sync_failed(exc, final)
                return False
            if result.manifest is not None:
                self.committed = result.manifest
                self.committed_scan = committed_part(before, self.committed_scan, getattr(result, "held_back", ()))
                self.record.write(manifest=manifest_id(result.manifest), files=self.committed_scan)
            self.store_pending_since = getattr(result, "pending_since", None)
            self.last_sync = (result.manifest, self.clock() - started, result.files_sent, result.bytes_sent,
                              getattr(result, "held_back", None))
        finally:
            self.sync_lock.release()
        self.bytes_synced += result.bytes_sent
        if self.sync_failures and not final:
            self.say(f"background sync to {self.remote} works again after {self.sync_failures} failed tries")
        self.sync_failures = 0
        if final:
            self.say(f"final sync: {result.files_sent} file(s), {result.bytes_sent} bytes sent to {self.remote} "
                     f"in {self.clock() - started:.1f} s")
        return True

    def _sync_failed(self, exc: BaseException, final: bool) -> None:
        text = str(exc) if isinstance(exc, SlurmagentError) else f"{type(exc).__name__}: {exc}"
        self.last_sync_error = text.splitlines()[0] if text else type(exc).__name__
        self._metric(add={("slurmagent_checkpoint_sync_errors_total", ()): 1})
        if final:
            self.say(f"final sync failed: {self.last_sync_error}; the local checkpoint in {self.opts.ckpt_dir} is kept")
            return
        now = self.clock()
        self.sync_failures += 1
        if self.sync_failures == 1:
            self.failing_since = now
        if now - self.last_error_said >= self.opts.error_report_s:
            self.last_error_said = now
            again = (f" (failing for {now - self.failing_since:.0f} s, {self.sync_failures} tries)"
                     if self.sync_failures > 1 else "")
            self.say(f"background sync to {self.remote} failed{again}: {self.last_sync_error}; retrying every "
                     f"{self.opts.sync_interval_s:g} s, the bucket lags behind {self.opts.ckpt_dir}")

    def lag_seconds(self, now: float | None = None) -> float:
        """How long the bucket has been behind the disk: the age of the oldest change to a
        checkpoint file that no commit holds yet (0 when everything is committed), on this
        node's disk or, as the store says (a multi-node job), on any node's. A file
        rewritten again and again keeps the time of its first uncommitted change."""
        now = time.time() if now is None else now
        scan = stat_scan(self.opts.ckpt_dir)
        for rel in [r for r in self.dirty_since if self.committed_scan.get(r) == scan.get(r) or r not in scan]:
            del self.dirty_since[rel]
        for rel, st in scan.items():
            if self.committed_scan.get(rel) != st:
                self.dirty_since.setdefault(rel, st[1] / 1e9)
        oldest = min([*self.dirty_since.values(), *([self.store_pending_since] if self.store_pending_since else [])],
                     default=None)
        return max(0.0, now - oldest) if oldest is not None else 0.0

    def _metric(self, set_: dict | None = None, add: dict | None = None, replace_prefix: str | None = None) -> None:
        if self.metrics is not None:
            try:
                self.metrics.update(set_=set_, add=add, replace_prefix=replace_prefix)
            except Exception:  # noqa: BLE001 - metrics never fail the job
                pass

    def stop_background_sync(self) -> None:
        """No more periodic syncs; a multi-node round in flight (a hung agent) is cancelled, not waited for."""
        self.stop_sync.set()
        getattr(self.store, "cancel_rounds", lambda: None)()

    def _background_sync(self) -> None:
        while not self.stop_sync.wait(self.opts.sync_interval_s):
            ok = self.sync(deadline_s=max(self.opts.sync_interval_s, self.opts.sync_deadline_s))
            if (self.metrics is not None or self.report is not None) and not self.stop_sync.is_set():
                try:
                    lag = self.lag_seconds()
                except OSError:
                    lag = None
                if lag is not None:
                    self._metric(set_=job_gauges(self.ident.name, lag, self.store, time.time()))
                self._report_sync(ok, lag)

    def _report_sync(self, ok: bool, lag: float | None, say: bool = True) -> None:
        if self.report is not None:
            if ok and self.last_sync:
                self.report.synced(*self.last_sync[:4], lag_s=lag, held_back=self.last_sync[4], say=say)
            elif not ok:
                self.report.failed(self.last_sync_error)

    # --- main loop ----------------------------------------------------------------------------

    def _record(self, signum: int, _frame) -> None:
        self.pending.append(signum)

    def run(self) -> Outcome:
        outcome = Outcome(exit_code=0)
        handled = (*FLUSH_SIGNALS, *FORWARD_SIGNALS, signal.SIGCONT)
        previous = {s: signal.signal(s, self._record) for s in handled}  # a signal during the restore too
        try:
            try:
                resumed = self._prepare_dir_watched()
            except (SlurmagentError, OSError) as exc:
                nodes = failed_nodes(exc, self.env)  # this node's disk or path: another node would do
                if nodes and self.slurm_nodes is not None and self.requeue is not None:
                    return requeue_without(self, outcome, exc, nodes, self.slurm_nodes)
                if not isinstance(exc, SlurmagentError):
                    raise
                raise WrapperError(f"cannot restore the checkpoint ({exc}); not starting, so it cannot be overwritten") from None
            if resumed is None:
                cause = signal_name(next(s for s in self.pending if s in FLUSH_SIGNALS))
                self.say(f"{cause} during the restore: not starting the job")
                outcome.flushed, outcome.flush_cause, outcome.exit_code = True, cause, EXIT_FLUSHED
                self._hand_back(outcome, streak=None, what=f"stopped during the restore by {cause} (the job never started)")
                return outcome
            outcome.resumed = resumed
            if self.report is not None:
                self.report.restored(self.baseline)
            self.start_scan = self.committed_scan = stat_scan(self.opts.ckpt_dir)
            return self._run_child(outcome)
        finally:
            self.stop_sync.set()
            if self.hold is not None:
                self.hold.cleanup()
            for s, h in previous.items():
                signal.signal(s, h)

    def _child_env(self, resumed: bool) -> dict[str, str]:
        env = dict(self.env)
        env.update(SLURMAGENT_CKPT_DIR=str(self.opts.ckpt_dir), SLURMAGENT_RESTART_COUNT=str(self.ident.restart_count))
        env.pop("SLURMAGENT_RESUMED", None)
        env.pop(SUBMISSION_ENV, None)  # ours: a job the trainer submits is another submission
        if resumed:
            env["SLURMAGENT_RESUMED"] = "1"
        if self.hold is not None:
            env["PATH"] = self.hold.child_path(env.get("PATH"))
        return env

    def _run_child(self, outcome: Outcome) -> Outcome:
        try:
            child = subprocess.Popen(self.opts.cmd, env=self._child_env(outcome.resumed), start_new_session=True)
        except OSError as exc:
            raise WrapperError(f"cannot start {self.opts.cmd[0]}: {exc.strerror or exc}") from None
        self.child = child
        if self.store is not None:
            threading.Thread(target=self._background_sync, name="ckpt-sync", daemon=True).start()
        cause = self._supervise(child)
        if cause is None and self.hold is not None and self.hold.requested():
            cause = SELF_REQUEUE_CAUSE  # it asked for its requeue, then exited: it has checkpointed
        if cause is None:
            self.stop_sync.set()
            code = child.returncode
            outcome.child_code = code
            with self._kill_watch() as watch:
                watch.phase = "final sync"
                outcome.synced = self.sync(deadline_s=300.0, final=True)
            self._report_sync(outcome.synced, None, say=False)
            outcome.bytes_synced = self.bytes_synced
            outcome.exit_code, outcome.summary = exit_by_itself(code)
            if not outcome.synced and self.store is not None:
                outcome.summary += "; its last checkpoint is NOT in the bucket"
            self._metric(replace_prefix=job_series(self.ident.name))
            return outcome
        return self._flush(child, cause, outcome)

    def _supervise(self, child: subprocess.Popen) -> str | None:
        """Wait for the child; return the flush cause, or None when the child exited by itself."""
        next_expiry_check = 0.0
        while True:
            try:
                child.wait(timeout=0.1)
                # a flush signal that came before or with the exit counts (a node shutdown SIGTERMs
                # trainer and wrapper at once; the trainer saves and exits 0), one on its way too
                signum = signal_at_exit(self.pending, FLUSH_SIGNALS, self.clock)
                return None if signum is None else signal_name(signum)
            except subprocess.TimeoutExpired:
                pass
            while self.pending:
                signum = self.pending.pop(0)
                if signum in FLUSH_SIGNALS:
                    return signal_name(signum)
                if signum in FORWARD_SIGNALS:
                    killpg(child, signum)
            if self.hold is not None and self.hold.requested():
                return SELF_REQUEUE_CAUSE
            if self.hang is not None and self.hang.poll(child):
                return self.hang.cause
            now = self.clock()
            if self.opts.expiry_files and now >= next_expiry_check:
                next_expiry_check = now + 5.0
                end = termination_time(self.opts.expiry_files)
                if end is not None:
                    left = (end - datetime.now(timezone.utc)).total_seconds()
                    if left <= self.opts.flush_lead_s:
                        return f"VM expiry in {max(left, 0):.0f} s"

    def _kill_watch(self) -> KillWatch:
        job = self.ident.job_id if self.ident.platform == "slurm" else ""
        return KillWatch(self.pending if job else [], self.say, job)

    def _flush(self, child: subprocess.Popen, cause: str, outcome: Outcome) -> Outcome:
        with self._kill_watch() as watch:
            return self._flush_watched(child, cause, outcome, watch)

    def _flush_watched(self, child: subprocess.Popen, cause: str, outcome: Outcome, watch: KillWatch) -> Outcome:
        started = self.clock()
        self.stop_background_sync()
        outcome.flushed, outcome.flush_cause = True, cause
        grace = flush_grace(self.opts.grace_s, cause)
        deadline = self.flush_deadline = started + grace
        if self.hang is not None and self.hang.owns(cause):
            self.hang.stop(child)  # evidence and the suspect's drain, then SIGKILL (no checkpoint signal)
            self._record_torn()
            outcome.child_killed = kill_group(child, lambda line: self.say(f"hang: {line}"))
            started = self.clock()  # the evidence and the kill were the hang's wait (the report's hang_detection)
        elif child.poll() is not None and cause != SELF_REQUEUE_CAUSE:
            self.say(f"{cause} came as the job exited (exit {child.returncode}): syncing the checkpoint it left")
            outcome.held_requeue = self.hold is not None and self.hold.requested()  # its verb is asked
        elif cause == SELF_REQUEUE_CAUSE:
            outcome.held_requeue = True
            self._stop_child(child, outcome, "it asked for its own requeue (held until the checkpoint is synced)")
        else:
            self.say(f"{cause}: asking the job to checkpoint ({signal_name(self.opts.ckpt_signal)}, grace {grace:g} s"
                     + (": a GPU failed under the job, the last committed checkpoint counts)" if is_fault(cause) else ")"))
            killpg(child, self.opts.ckpt_signal)
            while child.poll() is None and self.clock() < deadline:
                if self.hold is not None and self.hold.requested():
                    outcome.held_requeue = True
                    self._stop_child(child, outcome, "it checkpointed and asked for its requeue (held until the "
                                     "checkpoint is synced)")
                    break
                time.sleep(0.05)  # further signals are recorded but start no second flush
            if child.poll() is None:
                outcome.child_killed = True
                self.say(f"the job did not exit within {grace:g} s: stopping it; the last complete "
                         "checkpoint stays")
                self._record_torn()
                terminate_group(child, 5.0, self.say)
        outcome.child_code = child.returncode
        self.stop_sync.set()
        if self.hold is not None:
            self.hold.cleanup()  # the job is gone; nothing is left behind if we are killed later
        left = max(deadline - self.clock(), self.opts.final_sync_floor_s)
        watch.phase = "final sync"
        outcome.synced = self.sync(deadline_s=left, final=True)
        watch.phase = ""
        self._report_sync(outcome.synced, None, say=False)
        self._hand_back(outcome, streak=self.no_progress_streak())
        outcome.flush_seconds = self.clock() - started
        outcome.bytes_synced = self.bytes_synced
        self._metric(replace_prefix=job_series(self.ident.name))
        return outcome

    def _stop_child(self, child: subprocess.Popen, outcome: Outcome, why: str) -> None:
        if child.poll() is not None:
            return
        self.say(f"{why}: stopping the job")
        self._record_torn()
        if not terminate_group(child, self.opts.stop_wait_s, self.say):
            outcome.child_killed = True

    # --- requeue ------------------------------------------------------------------------------

    def no_progress_streak(self) -> int:
        """Consecutive attempts, this one included, whose committed checkpoint equals the one
        they started from; 0 when this attempt made progress."""
        if self.store is not None:
            if self.committed is None:  # nothing was ever committed: no attempt made progress
                return self.ident.restart_count + 1
            return no_progress_after(self.baseline, self.committed.files)
        now = stat_scan(self.opts.ckpt_dir)
        if not now:
            return self.ident.restart_count + 1
        rec = self.record.read()
        streak = 0 if now != self.start_scan else (
            (rec.get("no_progress", 0) if rec.get("files") == self.start_scan else self.ident.restart_count) + 1)
        self.record.write(files=now, no_progress=streak)
        return streak

    def _hand_back(self, outcome: Outcome, streak: int | None, what: str = "") -> None:
        """Requeue (Slurm) or hand back for a retry (Cloud Run), and set the exit code and summary."""
        outcome.no_progress = streak or 0
        flushed = what or ("checkpoint flushed" if outcome.synced or self.store is None
                           else "flushed, but the final sync failed")
        if self.ident.platform != "slurm" or self.requeue is None:
            outcome.exit_code = EXIT_FLUSHED
            retry = "so Cloud Run retries the task" if self.ident.platform == "cloud-run" else "(rerun to resume)"
            outcome.summary = f"exit {EXIT_FLUSHED}: {flushed}; exiting {EXIT_FLUSHED} {retry}"
            if self.ident.platform == "cloud-run":
                self.say(f"exiting {EXIT_FLUSHED} so Cloud Run retries the task")
            return
        job, cap = self.ident.job_id, self.opts.max_requeues
        if streak is not None and streak > cap:
            outcome.requeue_refused = (f"{streak} attempts in a row committed no new checkpoint "
                                       f"(--max-requeues {cap})")
            self.say(f"not requeueing job {job}: {outcome.requeue_refused}")
        else:
            result = self._requeue_own(job, outcome)
            outcome.requeued, outcome.requeue_refused = result.requeued, "" if result.requeued else result.why
            if result.requeued and not result.why:
                if streak:
                    budget = f" without progress {streak} of at most {cap}"
                elif streak is None:
                    budget = ""
                else:
                    budget = ", it made progress"
                self.say(f"requeued job {job} (restart {self.ident.restart_count + 1}{budget})")
            else:
                self.say(f"not requeueing job {job}{' again' if result.requeued else ''}: {result.why}")
        if outcome.requeued:
            outcome.exit_code = EXIT_FLUSHED
            outcome.summary = f"exit {EXIT_FLUSHED}: {flushed}, job {job} requeued"
        else:
            outcome.exit_code = EXIT_REQUEUE_REFUSED
            outcome.summary = f"exit {EXIT_REQUEUE_REFUSED}: {flushed}, job {job} NOT requeued: {outcome.requeue_refused}"

    def _requeue_own(self, job: str, outcome: Outcome) -> RequeueResult:
        """`scontrol requeue` (or the held `requeuehold`) by `requeue.py`'s rules: never for a
        job Slurm is ending, never twice, retried until the flush deadline."""
        verb = self.hold.verb() if self.hold is not None and outcome.held_requeue else RequeueVerb()
        call = (lambda: self.requeue(job)) if verb == RequeueVerb() else (lambda: self.requeue(job, verb))
        read = (lambda: self.read_job(job)) if self.read_job is not None else None
        deadline = max(self.flush_deadline or 0.0, self.clock() + REQUEUE_MIN_S)
        return requeue_own_job(job, self.ident.restart_count, call, read, deadline, self.say, clock=self.clock)

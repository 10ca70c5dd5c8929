"""Flex-start expiry watch: learn when this VM dies, drain it ahead, flush its jobs in time.

`slurmagent expiry-watch --once` (systemd/slurmagent-expiry.timer, every 30 s) or
`slurmagent expiry-watch` (a loop that long-polls the metadata server) does, per check:

1. **Termination time**: `[expiry] termination_time` when set, else the Compute API
   (`instances.get` on the instance named like the node: `resourceStatus.scheduling.terminationTimestamp`,
   else `scheduling.terminationTime`, else `lastStartTimestamp + scheduling.maxRunDuration`),
   with `scheduling.provisioningModel` and `instanceTerminationAction` kept for `status`.
   (`gcp/compute.read_scheduling`). The answer (also "no termination time") is cached in
   `<state_dir>/expiry.json` with the boot id and asked again after `[expiry] refresh_s`, or
   when the time passed and the VM is still alive; a state file of an earlier boot is discarded. No termination time and no
   notice: nothing to do (a standard VM costs one API call per boot and per `refresh_s`).
2. **Host maintenance and preemption**: the API's `resourceStatus.upcomingMaintenance.windowStartTime`
   of a VM that terminates on maintenance is a T like any other; the metadata server's
   `instance/maintenance-event` `TERMINATE_ON_HOST_MAINTENANCE` (about an hour ahead on a GPU
   VM) means T = that window start when known (the API is read again whenever the key
   changes), else now + 60 min on a GPU VM, else now + 60 s; `instance/preempted` `TRUE`
   means T = now + 30 s (`gcp/events.py`). A long notice withdrawn well before its T (the
   window was rescheduled or cancelled) is dropped and our drain follows the new T (resumed
   when no longer due); re-issued, it keeps the earliest T it announced unless withdrawn for
   longer than `drain_lead_s` or 5 min past that T (`policy._remembered_notice`). `--once` reads both keys once; the loop long-polls them, so it reacts
   within a second. `MIGRATE_ON_HOST_MAINTENANCE` is only logged (the VM survives: no drain, no flush).
3. **Drain** when the remaining lifetime is below `drain_lead_s` (with
   `drain_at_max_time`, also below the longest time limit a job may ask for on this node:
   the largest MaxTime of its partitions, only when all are finite) with
   `slurmagent: expiry: flex expiry at <UTC>` (`maintenance:` / `preempt:` for notices).
   An admin's (or Slurm's) drain is never overridden, nor a slurmagent hardware drain (the
   repair loop owns that one). The drain is planned (`JournalExecutor.drain_planned`): journaled, but
   the circuit breaker neither holds it back nor counts it (a flex cohort ends together). The rule `expiry` is one `repair` never recreates; a static
   node comes back through `resume-if-healthy` on the recreated VM, a dynamic node leaves
   nothing behind (its state lives on the VM's disk and in /run).
   Why not drain at MaxTime by default: on a 7-day VM with a 24-72 h MaxTime that would idle
   the node for a day or more while short jobs could still use it; the prolog guard below
   keeps each job that cannot finish off the node instead.
4. **Flush** at `flush_lead_s` before the end (at once when the notice is shorter): the jobs running on
   the node (`squeue -h -w NODE -t RUNNING -o %A`) whose batch script execs the wrapper
   (`slurmagent sbatch`, or `exec slurmagent run -- ...`, read with `scontrol write
   batch_script`) get `scancel --batch --signal=USR1` (one call for all): the wrapper checkpoints, syncs, requeues, exits 143.
   Other jobs are handled per `[expiry] unwrapped_jobs`: `requeue` (default: `scontrol
   requeue`, what Slurm would do after the node dies, but before and without the
   SlurmdTimeout wait), `signal` (USR1 too: a batch script that does not trap USR1 is
   killed by it and ends FAILED, NOT requeued), `leave`.
   Every job is flushed once; a later check only handles jobs not seen before.
5. **State** (`expiry_state.py`): `<state_dir>/expiry.json` (and, with `publish_run_file`, a
   world-readable copy at `[expiry] run_file` for wrappers that run as the job's user) holds
   `termination_time` (absent when unknown), `source`, `boot_id`, the drain and flush
   flags; `slurmagent run` flushes on its own at `flush_lead_s` from it, `status` shows it.
   `--once` keeps there what it said of its errors (`said_errors`): a lasting error is said
   once, again when it changes or after an hour, and its end in one line.

When the time cannot be learned for a reason that will not pass by itself (HTTP 401/403, no
such instance, another 4xx, a malformed answer 3 times in a row: `expiry_policy.read_failure_streak`)
protection is off: `--once` exits 1, logs a WARNING line and counts `READ_FAILURES_METRIC`.

The decision of each check is pure (`expiry_policy.decide_expiry`); this module reads what it
needs, asks it, and carries out its steps. The prolog guard that keeps a job which would
outlive the VM off the node lives with the hooks (`hooks.prolog_guard`) and reads the same
state file.

Cadence: the timer fires every 30 s (AccuracySec 5 s), so a flush starts up to ~35 s after
`flush_lead_s` is reached: keep `flush_lead_s` >= 35 s + the jobs' flush time (the wrapper
also checks the state file every 5 s on its own). A check costs one local file read and
two metadata reads; the API is asked once per boot and `refresh_s`.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, TextIO

from ..actions.executor import JournalExecutor
from ..state import expiry_state, metrics
from ..policy import expiry as expiry_policy
from ..state.config import Config
from ..state.decisionlog import DecisionLog, path_for as decision_log_path
from ..errors import EXIT_OK, EXIT_PROBLEMS, ExpiryError, SlurmagentError
from ..gcp.events import EventWatcher, Events, probe_events
from ..state.host import boot_id as current_boot_id
from ..slurm.commands import Slurm
from ..core.timefmt import fmt_time, from_epoch, human, parse_time

SchedulingReader = Callable[[Config, str], Any]  # (cfg, node) -> gcp.compute.SchedulingInfo
FLUSH_SIGNAL = "USR1"
LOOP_WAIT_MIN_S, LOOP_WAIT_MAX_S = 5.0, 60.0  # the loop's metadata long poll, from its interval
READ_FAILURES_METRIC = "slurmagent_expiry_read_failures_total"  # the alert that protection is off counts it
FIX_PERMISSION = (" (grant this VM's service account compute.instances.get, or set [expiry] compute_api = false "
                  "to learn the time from the metadata server's notices alone)")


def read_scheduling(cfg: Config, node: str) -> Any:
    """The Compute API's scheduling facts for this node's VM (google imported on this path only)."""
    from ..gcp.compute import read_scheduling as read  # google only when the API is asked, for start-up speed

    return read(cfg, node)


@dataclass
class CheckResult:
    node: str
    termination: datetime | None = None
    source: str = ""
    remaining_s: float | None = None
    actions: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    next_check_s: float | None = None  # when the next threshold is crossed (loop mode)
    to_say: list[str] | None = None  # --once: the error lines this run says (None: say every error)
    jobs: list[str] = field(default_factory=list)  # the jobs this run flushed, requeued or left: `report` joins by id
    read_failure: str | None = None  # the Compute API was asked: "" it answered, else why not (policy.read_failure_reason)
    protection_off: str | None = None  # the termination time cannot be learned for this lasting reason

    def summary(self) -> str:
        if self.termination is None:
            head = f"{self.node}: no termination time"
        else:
            head = (f"{self.node}: terminates {fmt_time(self.termination)} (in {human(self.remaining_s or 0)}, "
                    f"{self.source})")
        return head + (": " + "; ".join(self.actions) if self.actions else "")


@dataclass
class FlushOutcome:
    signaled: list[str] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class ExpiryWatch:
    """One check at a time: read (state, API, notices), decide (expiry_policy.decide_expiry), act."""

    def __init__(self, cfg: Config, node: str, slurm: Slurm | None = None, *,
                 clock: Callable[[], float] = time.time, boot_id: str | None = None,
                 scheduling_reader: SchedulingReader = read_scheduling):
        self.cfg = cfg
        self.node = node
        self.slurm = slurm or Slurm.from_config(cfg)
        self.clock = clock
        self.boot_id = current_boot_id() if boot_id is None else boot_id
        self.read_scheduling = scheduling_reader
        self.path = expiry_state.state_file(cfg, node)

    def check(self, events: Events | None = None, *, remember_said: bool = False) -> CheckResult:
        """`remember_said` (--once): what to say of the errors comes from the state file, where
        this run's record of them is written with the rest (expiry_state.errors_to_say)."""
        ex = self.cfg.expiry
        now = self.clock()
        res = CheckResult(self.node)
        old = expiry_state.read(self.path) or {}
        metadata_down = events.error if events else ""
        if metadata_down:
            res.errors.append(f"{metadata_down}: no maintenance/preemption notices")
        override, api = None, None
        if ex.termination_time:
            try:
                override = parse_time(ex.termination_time)
            except ValueError:
                raise ExpiryError(f"[expiry] termination_time {ex.termination_time!r} is not an RFC 3339 time") from None
        else:
            same_boot = old if old.get("boot_id") == self.boot_id else {}
            changed = events is not None and not events.error and \
                events.maintenance != same_boot.get("last_maintenance_event", "NONE")
            if ex.compute_api:  # false: the metadata server's notices alone, no Compute permission needed
                api = self._api(now, _usable_cache(same_boot.get("api")), res, metadata_down, changed)
        d = expiry_policy.decide_expiry(
            now=now, node=self.node, boot_id=self.boot_id, old=old, override=override, api=api, events=events,
            lookup_failed=bool(res.errors), drain_lead_s=float(ex.drain_lead_s), flush_lead_s=float(ex.flush_lead_s),
            max_time_s=self._max_time_s if ex.drain_at_max_time else None)
        res.actions.extend(d.notes)
        if ex.compute_api:  # kept across runs that did not ask the API (a fresh answer, the metadata server down)
            streak = old.get(expiry_policy.READ_FAILURES_KEY) if old.get("boot_id") == self.boot_id else None
            if res.read_failure is not None:
                streak, res.protection_off = expiry_policy.read_failure_streak(streak, res.read_failure or None, now)
            if streak:
                d.state[expiry_policy.READ_FAILURES_KEY] = streak
        res.termination, res.source, res.remaining_s, res.next_check_s = d.termination, d.source, d.remaining_s, d.next_check_s
        state = d.state
        if d.release and self._release(old, res, d.release):
            for key in expiry_policy.EXPIRY_DRAIN_KEYS:
                state.pop(key, None)
        if d.drain_reason:
            self._drain(d.drain_reason, state, res, now)
        if d.flush_cause:
            self._flush(d.flush_cause, state, res, now)
        if remember_said:
            res.to_say, said = expiry_state.errors_to_say(old, res.errors, now)
            if said:
                state[expiry_state.SAID_KEY] = said
        try:
            expiry_state.write(self.cfg, self.node, state)
        except (OSError, SlurmagentError) as exc:
            res.errors.append(f"cannot write {self.path}: {getattr(exc, 'strerror', None) or exc}")
            if res.to_say is not None:  # nothing is remembered: this one is said every run
                res.to_say.append(res.errors[-1])
        res.state = state
        self._gauge(res)
        return res

    def _gauge(self, res: CheckResult) -> None:
        """`slurmagent_termination_timestamp_seconds` while a termination time is known (gone
        when it is not: an alert then counts down only real deadlines)."""
        name = "slurmagent_termination_timestamp_seconds"
        when = {(name, (("source", res.source or "unknown"),)): res.termination.timestamp()} if res.termination else {}
        off = {(READ_FAILURES_METRIC, (("reason", res.protection_off),)): 1} if res.protection_off else None
        metrics.for_node(self.cfg, self.node).update(set_=when, add=off, replace_prefix=name, component="expiry")

    def _api(self, now: float, cached: dict[str, Any] | None, res: CheckResult, metadata_down: str,
             event_changed: bool = False) -> dict[str, Any] | None:
        """The cached Compute API answer, refreshed when old, when the VM outlived it, when the
        metadata `maintenance-event` changed (the maintenance window is read again) and every
        few minutes while a maintenance window is near (it may be rescheduled)."""
        if expiry_policy.api_answer_fresh(cached, now, float(self.cfg.expiry.refresh_s), self.node,
                                   event_changed=event_changed, window_soon_s=2 * float(self.cfg.expiry.drain_lead_s)):
            return cached
        if metadata_down and not (self.cfg.gcp.project and self.cfg.gcp.zone):
            # the same outage: one line says both
            res.errors[0] += ("; termination time unknown without it (set [gcp] project and zone, or "
                              "[expiry] termination_time)" + ("; using the cached answer" if cached else ""))
            return cached
        try:
            info = self.read_scheduling(self.cfg, self.node)
        except SlurmagentError as exc:
            res.read_failure = expiry_policy.read_failure_reason(
                getattr(exc, "status", None), bool(getattr(exc, "answered", False)), str(exc))
            hint = FIX_PERMISSION if res.read_failure == "permission" else ""
            res.errors.append(f"cannot read the termination time from the Compute API: {exc}{hint}"
                              + ("; using the cached answer" if cached else ""))
            return cached
        res.read_failure = ""
        return {"checked_at": fmt_time(from_epoch(now)), "checked_at_epoch": now, "scheduling": info.to_dict()}

    def _max_time_s(self) -> float:
        """Largest MaxTime of the node's partitions; 0 when any is INFINITE or unknown."""
        try:
            limits = self.slurm.partition_max_times(self.slurm.node(self.node).partition_names)
        except SlurmagentError:
            return 0.0
        if not limits or any(x is None for x in limits):
            return 0.0
        return max(x for x in limits if x is not None)

    def _drain(self, reason: str, state: dict[str, Any], res: CheckResult, now: float) -> None:
        try:
            outcome = JournalExecutor(self.cfg, self.slurm, self.node).drain_planned(reason, source="expiry-watch")
        except SlurmagentError as exc:
            res.errors.append(f"drain failed: {exc}")
            return
        if outcome.startswith("pending"):
            res.errors.append(f"drain failed ({outcome.replace('pending: ', 'pending in the journal: ', 1)})")
        if outcome == "drained":
            res.actions.append(f"drained ({reason})")
            state["drained_at"] = fmt_time(from_epoch(now))
        elif outcome != state.get("drain") and not outcome.startswith("pending"):
            res.actions.append(outcome)
        state.update(drained=True, drain=outcome, drain_reason=reason)

    def _release(self, old: dict[str, Any], res: CheckResult, why: str) -> bool:
        """Resume the node if it still carries exactly the drain we set; True when our drain is gone."""
        reason = str(old.get("drain_reason"))
        outcome = JournalExecutor(self.cfg, self.slurm, self.node).resume(reason, only_if_reason=True)
        if outcome.startswith("pending"):
            res.errors.append(f"resume failed: {outcome}")
            return False
        if outcome == "resumed":
            res.actions.append(f"resumed: {why} ({reason!r} no longer holds)")
        return True

    def _flush(self, cause: str, state: dict[str, Any], res: CheckResult, now: float) -> None:
        done = set(state.get("flushed_jobs", [])) | set(state.get("requeued_jobs", [])) | set(state.get("left_jobs", []))
        try:
            out = flush_jobs(self.cfg, self.slurm, self.node, done, self.cfg.expiry.unwrapped_jobs,
                             classify_budget_s=max(5.0, float(self.cfg.expiry.flush_lead_s) / 4))
        except SlurmagentError as exc:
            res.errors.append(f"flush failed: {exc}")
            return
        if not state.get("flushed"):
            state.update(flushed=True, flushed_at=fmt_time(from_epoch(now)), flush_cause=cause)
        for key, jobs in (("flushed_jobs", out.signaled), ("requeued_jobs", out.requeued), ("left_jobs", out.left)):
            if jobs:
                state[key] = sorted(set(state.get(key, [])) | set(jobs), key=_job_key)
        if out.signaled:
            res.actions.append(f"flush ({cause}): {FLUSH_SIGNAL} to job(s) {','.join(out.signaled)}")
        if out.requeued:
            res.actions.append(f"requeued unwrapped job(s) {','.join(out.requeued)}")
        if out.left:
            res.actions.append(f"left job(s) {','.join(out.left)} alone")
        res.errors.extend(out.errors)
        res.jobs = sorted({*out.signaled, *out.requeued, *out.left}, key=_job_key)


def _usable_cache(cached: Any) -> dict[str, Any] | None:
    """The cached API answer, unless a time in it does not parse (written by an older version
    from an API value it could not use): then it is asked again."""
    if not isinstance(cached, dict) or not isinstance(cached.get("scheduling"), dict):
        return None
    try:
        for key in ("termination_time", "maintenance_window_start"):
            if cached["scheduling"].get(key):
                parse_time(cached["scheduling"][key])
        float(cached.get("checked_at_epoch", 0))
    except (TypeError, ValueError):
        return None
    return cached


def _job_key(job: str) -> tuple[int, str]:
    head = job.split("_")[0]
    return (int(head) if head.isdigit() else 0, job)


def flush_jobs(cfg: Config, slurm: Slurm, node: str, done: set[str], unwrapped: str = "requeue",
               classify_budget_s: float = 30.0) -> FlushOutcome:
    """USR1 to the wrapped batch steps running on the node (one scancel), the others per policy.

    Telling wrapped from unwrapped costs one `scontrol write batch_script` per job; past
    `classify_budget_s` (a slow slurmctld) the rest count as unwrapped, so the flush is not late."""
    try:
        running = slurm.jobs_on_node(node)
    except SlurmagentError as exc:
        raise ExpiryError(f"squeue -w {node}: {exc}") from None
    jobs = [j for j in running if j not in done]
    out = FlushOutcome()
    executor = JournalExecutor(cfg, slurm, node)
    signal_ids, requeue_ids = [], []
    budget_end = time.monotonic() + classify_budget_s
    for job in jobs:
        try:
            wrapped = unwrapped == "signal" or (time.monotonic() < budget_end and slurm.job_is_wrapped(job))
        except SlurmagentError:
            wrapped = False
        if wrapped:
            signal_ids.append(job)
        elif unwrapped == "requeue":
            requeue_ids.append(job)
        else:
            out.left.append(job)
    if signal_ids:
        try:
            executor.signal_jobs(signal_ids, FLUSH_SIGNAL)
            out.signaled = signal_ids
        except SlurmagentError as exc:
            out.errors.append(f"scancel --signal={FLUSH_SIGNAL} {' '.join(signal_ids)}: {exc}")
    if requeue_ids:
        out.requeued, failed = executor.requeue_each(requeue_ids)
        for job, why in failed.items():
            out.left.append(job)
            out.errors.append(f"requeue {job}: {why}")
    return out


# --- the machine type, cached per boot for the expected GPU count -------------------------------


def read_machine_type(timeout_s: float) -> str:
    from ..gcp.metadata import machine_type  # where it is used, for start-up speed

    return machine_type(timeout_s)


def cache_machine_type(cfg: Config, node: str, boot_id: str, timeout_s: float,
                       reader: Callable[[float], str] = read_machine_type) -> tuple[bool, str] | None:
    """Once per boot: the VM's machine type into `<state_dir>/machine-type.json`, where the
    prolog, `check`, `doctor` and `watch` read it (they make no network call) when Slurm does
    not say how many GPUs the node has. Here because this command already asks the metadata
    server, as root, and runs once at boot before slurmd: the first prolog finds it. Returns
    (said on stdout?, the line to say); None when there is nothing new to say."""
    # once per boot only, for start-up speed
    from ..core.machine_gpus import gpus_for_machine_type
    from ..state import machine_type

    path = machine_type.cache_file(cfg.state_path(node))
    entry = machine_type.read_entry(path, boot_id)
    if not boot_id or (entry and (entry.get("machine_type") or entry.get("final"))):
        return None
    try:
        try:
            value = reader(timeout_s)
        except SlurmagentError as exc:
            # HTTP 404: this metadata server has no machine type (not GCE): said once, not asked
            # again this boot; another failure is asked again next run, said when it changes
            final = "HTTP 404" in str(exc)
            msg = f"machine type unknown ({exc}); the expected GPU count cannot come from it"
            machine_type.write(path, boot_id, "", error=msg, final=final)
            return None if entry and entry.get("error") == msg else (final, msg)
        machine_type.write(path, boot_id, value)
    except OSError as exc:
        return False, f"cannot write {path}: {exc.strerror or exc}"
    gpus = gpus_for_machine_type(value)
    return True, f"machine type {value} ({gpus if gpus is not None else 'no fixed number of'} GPUs) cached for this boot"


# --- the command ------------------------------------------------------------------------------


def _log(cfg: Config, node: str, res: CheckResult, mode: str) -> None:
    DecisionLog(decision_log_path(cfg, node), use_syslog=cfg.hooks.syslog).write(
        "expiry-watch", node=node, mode=mode,
        termination_time=fmt_time(res.termination) if res.termination else None, source=res.source or None,
        remaining_s=round(res.remaining_s) if res.remaining_s is not None else None,
        action="; ".join(res.actions) or "none", errors=res.errors or None, said=res.to_say or None,
        jobs=res.jobs or None, protection_off=res.protection_off,
        severity="WARNING" if res.protection_off else None)


def _internal(exc: Exception) -> str:
    return f"internal error (check skipped, the watch goes on): {type(exc).__name__}: {exc}"


def run_expiry_watch(cfg: Config, node: str, *, once: bool = False, interval_s: float = 30.0,
                     out: TextIO | None = None, err: TextIO | None = None, slurm: Slurm | None = None,
                     stop: threading.Event | None = None,
                     machine_type_reader: Callable[[float], str] = read_machine_type,
                     scheduling_reader: SchedulingReader = read_scheduling) -> int:
    """`slurmagent expiry-watch [--once]`: exit 0 (errors are logged, the timer runs again);
    `--once` exits 1 when the termination time cannot be learned for a lasting reason
    (`CheckResult.protection_off`): the timer's unit fails and the counter goes up."""
    out, err = out or sys.stdout, err or sys.stderr
    watch = ExpiryWatch(cfg, node, slurm, scheduling_reader=scheduling_reader)
    timeout = float(cfg.expiry.metadata_timeout_s)
    said: set[str] = set()
    said_machine_type = [""]

    def machine_type_note(metadata_down: str) -> None:
        """The machine type once per boot (not while the metadata server is known to be down);
        a failure is said once per change, on stderr."""
        if metadata_down:
            return
        try:
            note = cache_machine_type(cfg, node, watch.boot_id, timeout, machine_type_reader)
        except Exception as exc:  # noqa: BLE001 - never the end of the expiry check
            note = (False, f"machine type: {_internal(exc)}")
        if note and note[1] != said_machine_type[0]:
            print(f"slurmagent expiry-watch: {node}: {note[1]}", file=out if note[0] else err, flush=True)
            said_machine_type[0] = note[1]

    def report(res: CheckResult) -> None:
        if res.actions:
            print(f"slurmagent expiry-watch: {res.summary()}", file=out, flush=True)
        if res.to_say is not None:  # --once: the state file remembers what was said
            for line in res.to_say:
                print(f"slurmagent expiry-watch: {node}: {line}", file=err, flush=True)
            if res.actions or res.to_say:  # protection off: WARNING, when said (at first, on a change, hourly)
                _log(cfg, node, res, "once")
            return
        for e in res.errors:
            if e not in said:  # the loop says a lasting error once
                print(f"slurmagent expiry-watch: {node}: {e}", file=err, flush=True)
        if res.actions or (set(res.errors) - said):
            _log(cfg, node, res, "loop")
        said.clear()
        said.update(res.errors)

    if once:
        code = EXIT_OK
        try:
            events = probe_events(timeout)
            try:
                res = watch.check(events, remember_said=True)
                report(res)
                code = EXIT_PROBLEMS if res.protection_off else EXIT_OK
            finally:  # after the check: its drain and flush never wait on this
                machine_type_note(events.error)
        except SlurmagentError as exc:
            print(f"slurmagent expiry-watch: {node}: {exc}", file=err, flush=True)
        except Exception as exc:  # noqa: BLE001 - a bad value from outside must not end the timer's unit in a traceback
            print(f"slurmagent expiry-watch: {node}: {_internal(exc)}", file=err, flush=True)
        return code

    stop = stop or threading.Event()
    wake = threading.Event()

    def on_signal(_s, _f) -> None:
        stop.set()
        wake.set()

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, on_signal)
    events = EventWatcher(timeout, max(LOOP_WAIT_MIN_S, min(LOOP_WAIT_MAX_S, interval_s * 2)), wake, stop,
                          lambda msg: print(f"slurmagent expiry-watch: {node}: {msg}", file=err, flush=True))
    events.start()
    threading.Thread(target=lambda: (stop.wait(), wake.set()), name="expiry-stop", daemon=True).start()
    wake.wait(timeout + 0.5)  # let the first plain reads land
    last_failure = ""
    while not stop.is_set():
        wake.clear()
        snap = events.snapshot()
        metadata_down = snap.error
        snap.error = ""  # outages are reported by the watcher itself, once
        failure = ""
        try:
            res = watch.check(snap)
        except SlurmagentError as exc:
            failure, res = str(exc), None
        except Exception as exc:  # noqa: BLE001 - the loop outlives a value it cannot handle
            failure, res = _internal(exc), None
        if failure and failure != last_failure:  # a lasting failure is said once
            print(f"slurmagent expiry-watch: {node}: {failure}", file=err, flush=True)
        last_failure = failure
        if res is not None:
            report(res)
        machine_type_note(metadata_down)  # after the check; a file read once cached: one metadata read per boot
        delay = interval_s
        if res is not None and res.next_check_s is not None:
            delay = min(delay, max(res.next_check_s + 0.05, 0.05))
        wake.wait(delay)
    return 0

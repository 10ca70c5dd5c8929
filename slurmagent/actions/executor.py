"""The only way slurmagent changes Slurm or Compute state: the methods of `JournalExecutor`.

Every action (drain, requeue, release, resume, repair request, power-down) is a method here.
With the node's journal (`state/journal.py`, root: hooks, timers, commands) an action is written
before it is tried, marked done after, and replayed by the next hook/timer/command when
slurmctld or the API was down; a failure comes back as a `pending: ...` outcome. Without a
journal (`journal=None`: the wrapper, which runs as the job's user and owns no root journal)
an action is tried once and Slurm's error is raised: the caller retries (the wrapper's backoff).
`handlers.py` carries the entries out; the journal replays them by their stored kind.

* Fault drains (`drain_fault`: hooks, watch, healthcheck, resume-if-healthy, and the
  fail-closed drain after slurmagent's own internal error) go through the circuit breaker.
* Planned drains (`drain_planned`: expiry, maintenance, preemption) are journaled too, but
  the breaker neither suppresses nor counts them: a flex cohort shares one termination time.
* A signal to a job (`signal_jobs`) is not journaled: a late one would hit a job that moved on.
* Jobs on a GPU that failed under them leave it through `eviction.py` (`fault_requeue`), and
  the one fault response of prolog, healthcheck and watch is `fault.py`.
* Opt-out: a node with the Slurm feature `slurmagent_off`, or named in `[repair]
  exclude_nodes`, is never drained, requeued on, resumed, repaired or powered down here,
  whoever asks (`policy.drain.opted_out`); a hook on it lets the job run.
* A dynamic node (CLOUD / power saving) is powered down (`power_down`: `State=POWER_DOWN_ASAP`
  with our reason; running jobs finish first), never recreated: Slurm gives the next job a fresh VM.

No google module is imported here: `gcp/compute.py` is imported on the repair path only.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..core import reasons
from ..errors import SlurmagentError, SlurmError
from ..policy import drain as drain_policy
from ..slurm.commands import Slurm, conf_value, read_conf_lines, slurm_conf_path
from ..slurm.model import NodeInfo
from ..state import metrics
from ..state.config import Config
from ..state.decisionlog import warn
from ..state.host import node_name, slurmagent_argv
from ..state.journal import Entry, Journal, Retry
from ..state.repair_state import has_marker
from .handlers import EntryHandlers, send_repair

HOOK_LOCK_WAIT_S = 10.0  # a hook waits at most this long for another replayer of its journal
REPLAY_DEADLINE_S = 30.0  # one replay (and the action that started it) stops trying after this
RELEASE_POLL_S, RELEASE_WATCH_DEADLINE_S = 0.5, 60.0  # the release watch: poll period, deadline
_NODE_JOURNAL: Any = object()  # the default: the journal of the executor's node


@dataclass
class DrainOutcome:
    """What a fault drain came to, and whether the job that asked may still run here."""

    action: str
    blocks_job: bool = True  # the prolog exits non-zero: the job must not run here

    @property
    def drained(self) -> bool:
        return self.action.startswith("drained") or self.action == "already-drained"

    @property
    def suppressed(self) -> bool:
        return self.action.startswith("suppressed")


def in_journal(pending: str) -> str:
    """A pending outcome, worded for a caller that leaves it to the journal's replay."""
    return pending.replace("pending: ", "pending in the journal: ", 1)


class JournalExecutor(EntryHandlers):
    """Carries out slurmagent's actions on Slurm (and Compute), journaled on `local_node`'s
    journal; `journal=None` acts once, unjournaled, and raises Slurm's error (the job's user)."""

    def __init__(self, cfg: Config, slurm: Slurm, local_node: str | None = None, *,
                 journal: Journal | None = _NODE_JOURNAL, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] | None = None,
                 compute_factory: Callable[[str], Any] | None = None):
        self.cfg = cfg
        self.slurm = slurm
        self.local_node = node_name(local_node)
        self.state_dir = cfg.state_path(self.local_node)
        self.journal = Journal.for_config(cfg, self.local_node) if journal is _NODE_JOURNAL else journal
        self.clock = clock
        self.sleep = sleep or time.sleep  # looked up now, so a test can patch time.sleep
        self.compute_factory = compute_factory
        self.fraction = float(cfg.repair.max_drained_fraction)
        self.detach = None  # see EntryHandlers.detach: the prolog's `drain_fault(verify_in_background=True)`

    # --- journal and replay ---

    def replay(self, deadline_s: float = REPLAY_DEADLINE_S, lock_wait_s: float = 0.0) -> list[tuple[Entry, str]]:
        if self.journal is None:
            return []
        results = self.journal.replay(self.handlers(), deadline_s, lock_wait_s)
        # the backlog for monitoring: actions Slurm or Compute did not take yet (retried later)
        metrics.for_node(self.cfg, self.local_node).update(
            set_={("slurmagent_journal_pending", ()): self.journal.pending_count()})
        return results

    def _act(self, kind: str, *, lock_wait_s: float | None = None, **payload: Any) -> str:
        """Journal one action, then replay (older pending entries first, then this one).
        When the journal cannot be written (state dir full or read-only) the action is still
        tried once, unjournaled: a broken state dir must not let a job onto a bad GPU."""
        if self.journal is None:  # the job's user: once, and Slurm's error goes to the caller
            try:
                return self.handlers()[kind](Entry(id="unjournaled", kind=kind, created=self.clock(), payload=payload))
            except Retry as why:
                raise SlurmError(str(why)) from None
        try:
            untrusted = self.journal.untrusted()  # a user could plant entries there: never replayed by root
            if untrusted:
                raise OSError(errno.EPERM, untrusted)
            entry = self.journal.add(kind, **payload)
        except OSError as exc:
            warn(f"cannot journal {kind} in {self.journal.dir}: {exc.strerror or exc}; trying it unjournaled")
            entry = Entry(id="unjournaled", kind=kind, created=self.clock(), payload=payload)
            try:
                return self.handlers()[kind](entry)
            except Retry as why:
                return f"pending: {why} (NOT journaled)"
        try:
            results = self.replay(REPLAY_DEADLINE_S,
                                  lock_wait_s=REPLAY_DEADLINE_S if lock_wait_s is None else lock_wait_s)
        except OSError as exc:  # the journal broke half-way (disk full?): the action may or may not be done
            warn(f"journal {self.journal.dir}: {exc.strerror or exc} while replaying")
            return f"pending: journal I/O error: {exc.strerror or exc}"
        for done, outcome in results:
            if done.id == entry.id:
                return outcome
        return "pending: not tried yet (journal busy or replay deadline)"

    # --- drains ---

    def drain_fault(self, reason: str, findings: Iterable[Any] = (), *, node: str | None = None, source: str = "",
                    job: str | None = None, takeover_prolog_error: bool = False, force: bool = False,
                    lock_wait_s: float = HOOK_LOCK_WAIT_S, verify_in_background: bool = False,
                    takeover_reason: str = "") -> DrainOutcome:
        """An unplanned drain (a fault, or slurmagent's own internal error), through the breaker.

        `blocks_job`: may a job still run here when the breaker held the drain back? Not when
        the findings make the GPUs unusable (lost, missing, NVML dead). Then, with
        `verify_in_background` (the prolog), the breaker's second read after a new drain (up to
        1.25 s later) runs in a detached process: the job is kept off either way, and Slurm
        requeues it as soon as the prolog exits."""
        findings = list(findings)  # read here and again for `blocks_job` below
        if verify_in_background and drain_policy.blocks_job(findings) and self.detach is None:
            self.detach = run_detached
        flags = {"job": job, "takeover_prolog_error": takeover_prolog_error, "force": force,
                 "takeover_reason": takeover_reason}  # that exact foreign reason may be replaced (adoption)
        outcome = self._act("drain", lock_wait_s=lock_wait_s, node=node or self.local_node, reason=reason,
                            source=source, **{k: v for k, v in flags.items() if v})
        if outcome.startswith("pending"):  # e.g. slurmctld unreachable: the journal retries it
            return DrainOutcome("drain-failed: " + in_journal(outcome), True)
        if outcome.startswith("suppressed"):  # breaker open: no drain; a dead GPU still keeps the job off
            return DrainOutcome(outcome, drain_policy.blocks_job(findings))
        if outcome.startswith("excluded"):  # opted out: slurmagent keeps its hands off, the job may run
            return DrainOutcome(outcome, False)
        return DrainOutcome(outcome, True)

    def drain_planned(self, reason: str, *, source: str = "", lock_wait_s: float = HOOK_LOCK_WAIT_S) -> str:
        """A drain of this node ahead of a scheduled end of the VM: journaled, never held back nor
        counted by the breaker; an admin's drain and a slurmagent fault drain stay. Returns `drained`,
        `already-drained`, `kept-admin-drain`, `kept-slurmagent-drain`, `no-such-node` or `pending: ...`."""
        return self._act("drain", lock_wait_s=lock_wait_s, node=self.local_node, reason=reason, source=source,
                         planned=True)

    # --- jobs ---

    def requeue_jobs(self, job_ids: list[str], *, hold: bool = False, special_exit: bool = False) -> str:
        """Requeue jobs (one call); `requeued`, or `requeue-failed: ...` (then the journal retries).
        Journaled, the node's opt-out is checked; unjournaled (the job's own requeue, asked by its
        user: `hold` for `requeuehold [State=SpecialExit]`) Slurm's refusal is raised."""
        where = {"node": self.local_node} if self.journal is not None else {}
        verb = {k: True for k, v in (("hold", hold), ("special_exit", special_exit)) if v}
        outcome = self._act("requeue", job_ids=job_ids, fresh=True, **where, **verb, lock_wait_s=HOOK_LOCK_WAIT_S)
        if outcome.startswith("pending"):
            return "requeue-failed: " + in_journal(outcome)
        return outcome

    def requeue_each(self, job_ids: list[str]) -> tuple[list[str], dict[str, str]]:
        """Requeue jobs in one call; if that fails, one by one, so one job that cannot be requeued
        (Requeue=0) does not hide the others. Returns (requeued, {job: why not})."""
        if not job_ids:
            return [], {}
        node = self.local_node
        outcome = self._act("requeue", job_ids=job_ids, fresh=True, node=node, lock_wait_s=HOOK_LOCK_WAIT_S)
        if outcome.startswith("excluded"):
            return [], {job: outcome for job in job_ids}
        if not outcome.startswith("pending"):
            return list(job_ids), {}
        done, failed = [], {}
        for job in job_ids:
            outcome = self._act("requeue", job_ids=[job], fresh=True, node=node, lock_wait_s=HOOK_LOCK_WAIT_S)
            if outcome.startswith("pending"):
                failed[job] = outcome.removeprefix("pending: ")
            else:
                done.append(job)
        return done, failed

    def fault_requeue(self, job_id: str, restarts: int, *, fresh: bool, reason: str = "") -> str:
        """Requeue (cancel when not requeueable) one job running on this node's failed GPU, once
        per job and restart count: every node of a multi-node job may ask."""
        return self._act("fault-requeue", lock_wait_s=HOOK_LOCK_WAIT_S, node=self.local_node, job_id=job_id,
                         restarts=restarts, cancel=True, fresh=fresh, reason=reason)

    def signal_jobs(self, job_ids: list[str], signal: str = "USR1") -> None:
        """Signal the batch steps of jobs (one call). Not journaled: a late signal would hit a job
        that has moved on. Raises SlurmError."""
        self.slurm.signal_jobs(job_ids, signal, batch=True)

    def excluded_nodes(self, job_id: str) -> list[str]:
        """The nodes a job excludes already (its ExcNodeList): read before `exclude_nodes` adds to it."""
        return self.slurm.excluded_nodes(job_id)

    def exclude_nodes(self, job_id: str, nodes: list[str], keep: list[str] = ()) -> list[str]:
        """Keep a PENDING job off `nodes` (a restore failed on their disks), `keep` what it excluded
        already; returns the list set. Not journaled: only the job's own wrapper asks, right after
        its requeue, and a late replay would change a job that has moved on. Raises SlurmError."""
        return self.slurm.exclude_nodes(job_id, nodes, list(keep))

    def release_held(self, job_id: str) -> list[str]:
        """The prolog keeps a job off this node: make sure it ends PENDING, not held. Returns the actions taken."""
        if nohold_configured(self.cfg):
            return []
        spawn_release_watch(job_id, self.cfg)
        try:  # journaled too: a later replay confirms the release
            if self.journal is not None:
                self.journal.add("release", job_id=job_id, node=self.local_node)
        except OSError as exc:
            warn(f"cannot journal the release of job {job_id}: {exc}")
        return ["release-watch"]

    def release_when_held(self, job_id: str, deadline_s: float = RELEASE_WATCH_DEADLINE_S,
                          interval_s: float = RELEASE_POLL_S) -> bool:
        """Poll until the job shows up requeued-held, then release it; give up at the deadline."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            job = self.slurm.job(job_id)
            if job is None or job.ambiguous:  # never act on fields the job's own text may have written
                return False
            if job.held:
                self.slurm.release([job_id])
                return True
            if job.state in ("RUNNING", "COMPLETED", "CANCELLED", "FAILED"):
                if job.state != "RUNNING" or job.restarts > 0:
                    return False
            time.sleep(interval_s)
        return False

    # --- nodes: resume, power down, repair ---

    def resume(self, reason: str = "", *, node: str | None = None, only_if_reason: bool = False,
               powered_down: bool = False) -> str:
        """Resume a node slurmagent drained. With `only_if_reason`, only while it still carries
        exactly `reason` (the expiry watch undoing its own drain). With `powered_down`, also a
        dynamic node we powered down that Slurm still holds DOWN (so Slurm may power it up again)."""
        only = {"only_reason": reasons.clean_reason(reason)} if only_if_reason else {}
        flag = {"powered_down": True} if powered_down else {}
        return self._act("resume", node=node or self.local_node, reason=reason, **only, **flag)

    def power_down(self, nodes: dict[str, str]) -> str:
        """Power dynamic nodes down with our reason (see `EntryHandlers._do_power_down`)."""
        return self._act("power_down", nodes=nodes, lock_wait_s=REPLAY_DEADLINE_S)

    def note_cancelled_repair(self, node: str, detail: str) -> str:
        """Journal that an admin's resume cancelled our pending repair of `node`."""
        return self._act("repair_cancelled", node=node, note=f"repair cancelled: {detail}",
                         lock_wait_s=REPLAY_DEADLINE_S)

    def begin_repairs(self, payloads: list[dict[str, Any]], nodes: list[NodeInfo] | None = None) -> list[Entry]:
        """Journal repair requests, then say `repairing` in Slurm for all their nodes at once
        (one call per distinct reason): a second run, or another machine, does not ask twice.
        Opted-out nodes (`nodes`: their Slurm view, read when not given) are left out.
        Raises SlurmError (the entries are then closed as not sent)."""
        assert self.journal is not None, "repairs are journaled"
        names = sorted({n for p in payloads for n in p["nodes"]})
        views = {n.name: n for n in (nodes if nodes is not None else self.slurm.nodes(names)) if n.name in names}
        kept = []
        for p in payloads:
            live = {n: i for n, i in p["nodes"].items() if not self.opted_out(views.get(n), n)}
            if live:
                kept.append({**p, "nodes": live})
        entries = [self.journal.add("repair", **p) for p in kept]
        try:
            self.slurm.set_reasons({n: reasons.repairing_reason(i["reason"]) for p in kept for n, i in p["nodes"].items()})
        except SlurmError as exc:
            for entry in entries:
                self.journal.mark_done(entry, f"not sent: {exc}")
            raise
        return entries

    def finish_repair(self, entry: Entry, compute: Any, fallback: Callable[[Any], str] | None = None) -> list:
        """Send a begun repair request and wait for it. On a ComputeError the reasons go back to
        the fault and the error is raised; the entry is closed either way. When the API refused
        the request and `fallback(error)` names another way (a MIG recreate after a refused
        reportHostAsFaulty), the nodes stay `repairing` and the entry says what comes next."""
        from ..gcp.compute import ComputeError  # google only on the repair path, for start-up speed

        assert self.journal is not None, "repairs are journaled"
        live = entry.payload["nodes"]
        try:
            ops = send_repair(compute, entry.payload, live)
        except ComputeError as exc:
            instead = fallback(exc) if fallback is not None and exc.refused else ""
            self.count_repairs(entry.payload["strategy"], "refused" if exc.refused else "failed", len(live))
            if instead:
                self.journal.mark_done(entry, f"refused: {exc}; {instead}")
                raise
            self.revert_repairing(live)
            self.journal.mark_done(entry, f"failed: {exc}")
            raise
        self.journal.mark_done(entry, "requested: " + ", ".join(str(o) for o in ops))
        self.repaired(list(live), entry.payload["strategy"])
        return ops


def after_healthy_hook(cfg: Config, node: str, slurm_factory: Callable[[Config], Slurm]) -> None:
    """The healthy path: replay a non-empty journal; clear our breaker mark if we set one.
    Costs one directory listing and one stat when there is nothing to do."""
    journal = Journal.for_config(cfg, node)
    marked = has_marker(cfg.state_path(node))
    if not journal.has_pending() and not marked:
        return
    try:
        executor = JournalExecutor(cfg, slurm_factory(cfg), node, journal=journal)
        executor.replay()
        if marked:
            executor.clear_suppressed_mark(node)
    except (SlurmagentError, OSError) as exc:
        print(f"slurmagent: journal replay deferred: {exc}", file=sys.stderr)


# --- held jobs: Slurm without nohold_on_prolog_fail requeues a job held ---------------------


def nohold_configured(cfg: Config) -> bool:
    """Does slurm.conf say `SchedulerParameters=nohold_on_prolog_fail` (requeued jobs stay PENDING)?"""
    params = conf_value(read_conf_lines(slurm_conf_path(cfg.slurm.conf)), "SchedulerParameters") or ""
    return "nohold_on_prolog_fail" in params.split(",")


def spawn_release_watch(job_id: str, cfg: Config) -> None:
    """Without nohold_on_prolog_fail Slurm requeues the job held: a detached process releases
    it once it is (`slurmagent release-held JOB`), so the prolog need not wait."""
    argv = [*slurmagent_argv("slurmagent.cli"), "release-held", job_id]
    subprocess.Popen(argv, env=dict(os.environ), start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


def run_detached(fn: Callable[[], object]) -> bool:
    """Run `fn` in a grandchild in its own session (stdio on /dev/null, no inherited file:
    the journal's lock stays with this process, and Slurm's wait for the prolog does not
    include it). False when it could not be started: the caller runs `fn` itself."""
    try:
        pid = os.fork()
    except OSError:
        return False
    if pid:
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return False
        return os.waitstatus_to_exitcode(status) == 0
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024)
        if os.fork():
            code = 0  # the middle child: the grandchild is on its way
        else:
            try:
                fn()
            finally:
                os._exit(0)
    except BaseException:  # noqa: BLE001 - a forked child must never return into the caller
        pass
    os._exit(code)

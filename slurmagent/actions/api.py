"""The only way slurmagent changes Slurm or Compute state: journaled actions.

Every action (drain, requeue, release, resume, repair request) goes through the node's
journal (`journal.py`): written before it is tried, marked done after, replayed by the next
hook/timer/command when slurmctld or the API was down. The functions here journal one
action each and say what came of it; `action_handlers.py` carries the entries out.

* Fault drains (`drain_fault`: hooks, watch, healthcheck, resume-if-healthy, and the
  fail-closed drain after slurmagent's own internal error) go through the circuit breaker.
* Planned drains (`drain_planned`: expiry, maintenance, preemption) are journaled too, but
  the breaker neither suppresses nor counts them: a flex cohort shares one termination time.
* A signal to a job (`signal_jobs`) is not journaled: a late one would hit a job that moved on.
* Jobs on a GPU that failed under them leave it through `eviction.py`.
* Opt-out: a node with the Slurm feature `slurmagent_off`, or named in `[repair]
  exclude_nodes`, is never drained, requeued on, resumed, repaired or powered down here,
  whoever asks (`policy.opted_out`); a hook on it lets the job run.
* A dynamic node (CLOUD / power saving) is powered down (`power_down`: `State=POWER_DOWN_ASAP`
  with our reason; running jobs finish first), never recreated: Slurm gives the next job a fresh VM.

No google module is imported here: `gcp/compute.py` is imported on the repair path only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..policy import drain as drain_policy
from ..core import reasons
from .executor import HOOK_LOCK_WAIT_S, REPLAY_DEADLINE_S, Actions, send_repair
from ..state.config import Config
from ..state.decisionlog import warn
from ..errors import SlurmagentError, SlurmError
from ..state.host import slurmagent_argv
from ..state.journal import Entry, Journal
from ..slurm.model import NodeInfo
from ..state.repair_state import has_marker
from ..slurm.commands import Slurm, conf_value, read_conf_lines, slurm_conf_path

RELEASE_POLL_S, RELEASE_WATCH_DEADLINE_S = 0.5, 60.0  # the release watch: poll period, deadline


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


# --- the public actions -------------------------------------------------------------------


def in_journal(pending: str) -> str:
    """A pending outcome, worded for a caller that leaves it to the journal's replay."""
    return pending.replace("pending: ", "pending in the journal: ", 1)


def drain_fault(cfg: Config, slurm: Slurm, node: str, reason: str, findings: Iterable[Any] = (), *,
                source: str = "", job: str | None = None, takeover_prolog_error: bool = False,
                force: bool = False, lock_wait_s: float = HOOK_LOCK_WAIT_S,
                runner: Actions | None = None) -> DrainOutcome:
    """An unplanned drain (a fault, or slurmagent's own internal error), through the breaker.

    `blocks_job`: may a job still run here when the breaker held the drain back? Not when
    the findings make the GPUs unusable (lost, missing, NVML dead)."""
    rt = runner or Actions(cfg, slurm, node)
    flags = {"job": job, "takeover_prolog_error": takeover_prolog_error, "force": force}
    _, outcome = rt.run("drain", lock_wait_s=lock_wait_s, node=node, reason=reason, source=source,
                        **{k: v for k, v in flags.items() if v})
    if outcome.startswith("pending"):  # e.g. slurmctld unreachable: the journal retries it
        return DrainOutcome("drain-failed: " + in_journal(outcome), True)
    if outcome.startswith("suppressed"):  # breaker open: no drain; a dead GPU still keeps the job off
        return DrainOutcome(outcome, drain_policy.blocks_job(findings))
    if outcome.startswith("excluded"):  # opted out: slurmagent keeps its hands off, the job may run
        return DrainOutcome(outcome, False)
    return DrainOutcome(outcome, True)


def fail_closed(cfg: Config, slurm_factory: Callable[[Config], Slurm], node: str, what: str, *, source: str,
                job: str | None = None) -> tuple[bool, str]:
    """`[hooks] on_internal_error = "closed"`: drain after slurmagent's own failure, through the
    breaker like any unplanned drain. Returns (the node is kept from running jobs, action):
    when the breaker holds the drain back the job may run (a bad rollout must not drain the
    cluster, and a failing prolog would make Slurm drain the node anyway)."""
    try:
        drain = drain_fault(cfg, slurm_factory(cfg), node, reasons.internal_error_reason(what), source=source, job=job)
    except Exception as exc:  # noqa: BLE001 - already on the failure path: say it, keep the job off
        return True, f"drain (fail closed), drain failed: {exc}"
    if drain.suppressed:
        return False, f"drain (fail closed) {drain.action}: the job may run"
    if drain.action.startswith("drain-failed"):
        return True, f"drain (fail closed), {drain.action}"
    return True, "drain (fail closed)"


def drain_planned(cfg: Config, slurm: Slurm, node: str, reason: str, *, source: str = "",
                  lock_wait_s: float = HOOK_LOCK_WAIT_S) -> str:
    """A drain ahead of a scheduled end of the VM: journaled, never held back nor counted by
    the breaker; an admin's drain and a slurmagent fault drain stay. Returns `drained`,
    `already-drained`, `kept-admin-drain`, `kept-slurmagent-drain`, `no-such-node` or `pending: ...`."""
    _, outcome = Actions(cfg, slurm, node).run("drain", lock_wait_s=lock_wait_s, node=node, reason=reason,
                                               source=source, planned=True)
    return outcome


def requeue_jobs(cfg: Config, slurm: Slurm, node: str, job_ids: list[str]) -> str:
    """Requeue jobs (one call); `requeued`, or `requeue-failed: ...` (then the journal retries)."""
    _, outcome = Actions(cfg, slurm, node).run("requeue", job_ids=job_ids, fresh=True, node=node,
                                               lock_wait_s=HOOK_LOCK_WAIT_S)
    if outcome.startswith("pending"):
        return "requeue-failed: " + in_journal(outcome)
    return outcome


def requeue_each(cfg: Config, slurm: Slurm, node: str, job_ids: list[str]) -> tuple[list[str], dict[str, str]]:
    """Requeue jobs in one call; if that fails, one by one, so one job that cannot be requeued
    (Requeue=0) does not hide the others. Returns (requeued, {job: why not})."""
    if not job_ids:
        return [], {}
    rt = Actions(cfg, slurm, node)
    _, outcome = rt.run("requeue", job_ids=job_ids, fresh=True, node=node, lock_wait_s=HOOK_LOCK_WAIT_S)
    if outcome.startswith("excluded"):
        return [], {job: outcome for job in job_ids}
    if not outcome.startswith("pending"):
        return list(job_ids), {}
    done, failed = [], {}
    for job in job_ids:
        _, outcome = rt.run("requeue", job_ids=[job], fresh=True, node=node, lock_wait_s=HOOK_LOCK_WAIT_S)
        if outcome.startswith("pending"):
            failed[job] = outcome.removeprefix("pending: ")
        else:
            done.append(job)
    return done, failed


def signal_jobs(slurm: Slurm, job_ids: list[str], signal: str = "USR1") -> None:
    """Signal the batch steps of jobs (one call). Not journaled: a late signal would hit a job
    that has moved on. Raises SlurmError."""
    slurm.signal_jobs(job_ids, signal, batch=True)


def resume(cfg: Config, slurm: Slurm, node: str, reason: str = "", *, only_if_reason: bool = False,
           powered_down: bool = False, runner: Actions | None = None) -> str:
    """Resume a node slurmagent drained (journaled). With `only_if_reason`, only while it still
    carries exactly `reason` (the expiry watch undoing its own drain). With `powered_down`, also
    a dynamic node we powered down that Slurm still holds DOWN (so Slurm may power it up again)."""
    only = {"only_reason": reasons.clean_reason(reason)} if only_if_reason else {}
    flag = {"powered_down": True} if powered_down else {}
    return (runner or Actions(cfg, slurm, node)).run("resume", node=node, reason=reason, **only, **flag)[1]


def power_down(rt: Actions, nodes: dict[str, str]) -> str:
    """Power dynamic nodes down with our reason (journaled; see `Actions._do_power_down`)."""
    return rt.run("power_down", nodes=nodes, lock_wait_s=REPLAY_DEADLINE_S)[1]


def note_cancelled_repair(rt: Actions, node: str, detail: str) -> str:
    """Journal that an admin's resume cancelled our pending repair of `node`."""
    return rt.run("repair_cancelled", node=node, note=f"repair cancelled: {detail}", lock_wait_s=REPLAY_DEADLINE_S)[1]


def begin_repairs(rt: Actions, payloads: list[dict[str, Any]], nodes: list[NodeInfo] | None = None) -> list[Entry]:
    """Journal repair requests, then say `repairing` in Slurm for all their nodes at once
    (one call per distinct reason): a second run, or another machine, does not ask twice.
    Opted-out nodes (`nodes`: their Slurm view, read when not given) are left out.
    Raises SlurmError (the entries are then closed as not sent)."""
    names = sorted({n for p in payloads for n in p["nodes"]})
    views = {n.name: n for n in (nodes if nodes is not None else rt.slurm.nodes(names)) if n.name in names}
    kept = []
    for p in payloads:
        live = {n: i for n, i in p["nodes"].items() if not rt.opted_out(views.get(n), n)}
        if live:
            kept.append({**p, "nodes": live})
    payloads = kept
    entries = [rt.journal.add("repair", **p) for p in payloads]
    try:
        rt.slurm.set_reasons({n: reasons.repairing_reason(i["reason"]) for p in payloads for n, i in p["nodes"].items()})
    except SlurmError as exc:
        for entry in entries:
            rt.journal.mark_done(entry, f"not sent: {exc}")
        raise
    return entries


def finish_repair(rt: Actions, entry: Entry, compute: Any,
                  fallback: Callable[[Any], str] | None = None) -> list:
    """Send a begun repair request and wait for it. On a ComputeError the reasons go back to
    the fault and the error is raised; the entry is closed either way. When the API refused
    the request and `fallback(error)` names another way (a MIG recreate after a refused
    reportHostAsFaulty), the nodes stay `repairing` and the entry says what comes next."""
    from ..gcp.compute import ComputeError  # google only on the repair path, for start-up speed

    live = entry.payload["nodes"]
    try:
        ops = send_repair(compute, entry.payload, live)
    except ComputeError as exc:
        instead = fallback(exc) if fallback is not None and exc.refused else ""
        if instead:
            rt.journal.mark_done(entry, f"refused: {exc}; {instead}")
            raise
        rt.revert_repairing(live)
        rt.journal.mark_done(entry, f"failed: {exc}")
        raise
    rt.journal.mark_done(entry, "requested: " + ", ".join(str(o) for o in ops))
    rt.repaired(list(live))
    return ops


def after_healthy_hook(cfg: Config, node: str, slurm_factory: Callable[[Config], Slurm]) -> None:
    """The healthy path: replay a non-empty journal; clear our breaker mark if we set one.
    Costs one directory listing and one stat when there is nothing to do."""
    journal = Journal.for_config(cfg, node)
    marked = has_marker(cfg.state_path(node))
    if not journal.has_pending() and not marked:
        return
    try:
        rt = Actions(cfg, slurm_factory(cfg), node)
        rt.replay()
        if marked:
            rt.clear_suppressed_mark(node)
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


def release_held(cfg: Config, node: str, job_id: str) -> list[str]:
    """The prolog keeps a job off this node: make sure it ends PENDING, not held. Returns the actions taken."""
    if nohold_configured(cfg):
        return []
    spawn_release_watch(job_id, cfg)
    try:  # journaled too: a later replay confirms the release
        Journal.for_config(cfg, node).add("release", job_id=job_id, node=node)
    except OSError as exc:
        warn(f"cannot journal the release of job {job_id}: {exc}")
    return ["release-watch"]


def release_when_held(slurm: Slurm, job_id: str, deadline_s: float = RELEASE_WATCH_DEADLINE_S,
                      interval_s: float = RELEASE_POLL_S) -> bool:
    """Poll until the job shows up requeued-held, then release it; give up at the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        job = slurm.job(job_id)
        if job is None or job.ambiguous:  # never act on fields the job's own text may have written
            return False
        if job.held:
            slurm.release([job_id])
            return True
        if job.state in ("RUNNING", "COMPLETED", "CANCELLED", "FAILED"):
            if job.state != "RUNNING" or job.restarts > 0:
                return False
        time.sleep(interval_s)
    return False

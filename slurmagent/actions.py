"""The only way slurmagent changes Slurm or Compute state: journaled actions.

Every action (drain, requeue, release, resume, repair request) goes through the node's
journal (`journal.py`): written before it is tried, marked done after, replayed by the next
hook/timer/command when slurmctld or the API was down. A handler looks at the current
state before it acts, so a replay is harmless.

* Fault drains (`drain_fault`: hooks, watch, healthcheck, resume-if-healthy, and the
  fail-closed drain after slurmagent's own internal error) go through the circuit breaker
  (`policy.py`): one `scontrol -o show node` to count, the drain, and, when the breaker is
  on, a second read to verify against concurrent drains on other machines.
* Planned drains (`drain_planned`: expiry, maintenance, preemption) are journaled too, but
  the breaker neither suppresses nor counts them: a flex cohort shares one termination time.
* Adding an action kind: one handler `_do_<kind>` in `Actions.handlers()` and one public
  function that journals it with `Actions.run(kind, ...)`.
* A signal to a job (`signal_jobs`) is not journaled: a late one would hit a job that moved on.
* Jobs on a GPU that failed under them (`FaultEviction`, for `watch` and `healthcheck`):
  wrapped jobs get the fault flush signal, the others a journaled `fault-requeue` that acts
  once per job and restart count, so every node of a multi-node job may ask.
* Opt-out: a node with the Slurm feature `slurmagent_off`, or named in `[repair]
  exclude_nodes`, is never drained, requeued on, resumed, repaired or powered down here,
  whoever asks (`policy.opted_out`); a hook on it lets the job run.
* A dynamic node (CLOUD / power saving) is powered down (`power_down`: `State=POWER_DOWN_ASAP`
  with our reason; running jobs finish first), never recreated: Slurm gives the next job a fresh VM.

No google module is imported here: `gcp/compute.py` is imported on the repair path only.
"""

from __future__ import annotations

import errno
import math
import os
import subprocess
import sys
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from . import hostlist, metrics, policy, reasons
from .config import Config
from .decisionlog import DecisionLog, warn
from .errors import SlurmagentError, SlurmError
from .host import node_name, slurmagent_argv
from .journal import Entry, Journal, Retry, StopReplay
from .nodes import FAULT_FLUSH_SIGNAL, NodeInfo, RunningJob
from .repair_state import drop_marker, has_marker, record_history, write_marker
from .slurm import Slurm, conf_value, read_conf_lines, slurm_conf_path, unreachable

# Slurm's own reason after our prolog exited non-zero: a pending drain from that prolog may
# replace it with the precise reason (it is the echo of our own failure, not an admin's).
PROLOG_FAILURE_REASONS = ("Prolog error", "Prolog failed")
HOOK_LOCK_WAIT_S = 10.0  # a hook waits at most this long for another replayer of its journal
REPLAY_DEADLINE_S = 30.0  # one replay (and the action that started it) stops trying after this
RELEASE_WAIT_S = 300.0  # a journaled release waits this long for Slurm to requeue the job (held)
REQUEUE_STATES = frozenset({"FAILED", "NODE_FAIL", "COMPLETING", "BOOT_FAIL", "TIMEOUT", "OUT_OF_MEMORY"})
RELEASE_POLL_S, RELEASE_WATCH_DEADLINE_S = 0.5, 60.0  # the release watch: poll period, deadline
VIEW_REUSE_S = 5.0  # a node read this recently by this process answers the opt-out check of a requeue
_recent_views: weakref.WeakKeyDictionary[Slurm, tuple[float, dict[str, NodeInfo]]] = weakref.WeakKeyDictionary()


@dataclass
class DrainOutcome:
    action: str
    blocks_job: bool = True  # the prolog exits non-zero: the job must not run here

    @property
    def drained(self) -> bool:
        return self.action.startswith("drained") or self.action == "already-drained"

    @property
    def suppressed(self) -> bool:
        return self.action.startswith("suppressed")


class Actions:
    """Executes journal entries against Slurm (and Compute for repair requests)."""

    def __init__(self, cfg: Config, slurm: Slurm, local_node: str | None = None, *,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] | None = None,
                 compute_factory: Callable[[str], Any] | None = None):
        self.cfg = cfg
        self.slurm = slurm
        self.local_node = node_name(local_node)
        self.state_dir = cfg.state_path(self.local_node)
        self.journal = Journal.for_config(cfg, self.local_node)
        self.clock = clock
        self.sleep = sleep or time.sleep  # looked up now, so a test can patch time.sleep
        self.compute_factory = compute_factory
        self.fraction = float(cfg.repair.max_drained_fraction)

    def handlers(self) -> dict[str, Callable[[Entry], str]]:
        return {"drain": self._do_drain, "requeue": self._do_requeue, "release": self._do_release,
                "resume": self._do_resume, "repair": self._do_repair, "power_down": self._do_power_down,
                "repair_cancelled": self._do_note, "fault-requeue": self._do_fault_requeue}

    def replay(self, deadline_s: float = REPLAY_DEADLINE_S, lock_wait_s: float = 0.0) -> list[tuple[Entry, str]]:
        return self.journal.replay(self.handlers(), deadline_s, lock_wait_s)

    def run(self, kind: str, *, lock_wait_s: float | None = None, **payload: Any) -> tuple[Entry, str]:
        """Journal one action, then replay (older pending entries first, then this one).
        When the journal cannot be written (state dir full or read-only) the action is still
        tried once, unjournaled: a broken state dir must not let a job onto a bad GPU."""
        try:
            untrusted = self.journal.untrusted()  # a user could plant entries there: never replayed by root
            if untrusted:
                raise OSError(errno.EPERM, untrusted)
            entry = self.journal.add(kind, **payload)
        except OSError as exc:
            warn(f"cannot journal {kind} in {self.journal.dir}: {exc.strerror or exc}; trying it unjournaled")
            entry = Entry(id="unjournaled", kind=kind, created=self.clock(), payload=payload)
            try:
                return entry, self.handlers()[kind](entry)
            except (Retry, StopReplay) as why:
                return entry, f"pending: {why} (NOT journaled)"
        try:
            results = self.replay(REPLAY_DEADLINE_S,
                                  lock_wait_s=REPLAY_DEADLINE_S if lock_wait_s is None else lock_wait_s)
        except OSError as exc:  # the journal broke half-way (disk full?): the action may or may not be done
            warn(f"journal {self.journal.dir}: {exc.strerror or exc} while replaying")
            return entry, f"pending: journal I/O error: {exc.strerror or exc}"
        for done, outcome in results:
            if done.id == entry.id:
                return entry, outcome
        return entry, "pending: not tried yet (journal busy or replay deadline)"

    # --- slurm calls mapped to replay semantics ---

    def _slurm(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except SlurmError as exc:
            if unreachable(exc):
                raise StopReplay(f"slurmctld unreachable: {exc}") from None
            raise Retry(str(exc)) from None

    def _nodes(self, names: list[str] | None = None) -> list[NodeInfo]:
        found = self._slurm(lambda: self.slurm.nodes(names))
        _recent_views[self.slurm] = (time.monotonic(), {n.name: n for n in found})
        return found

    def _view(self, name: str) -> NodeInfo | None:
        """The node as this process read it a moment ago (the drain before a requeue), else read now."""
        at, views = _recent_views.get(self.slurm, (0.0, {}))
        if name in views and time.monotonic() - at < VIEW_REUSE_S:
            return views[name]
        return next((n for n in self._nodes([name]) if n.name == name), None)

    def _update(self, nodes: list[str], **fields: str) -> None:
        self._slurm(lambda: self.slurm.update_nodes(nodes, **fields))

    def opted_out(self, node: NodeInfo | None, name: str) -> str:
        """Why this node is off limits to slurmagent ("" when it is not)."""
        return policy.opted_out(node, name, tuple(self.cfg.repair.exclude_nodes))

    def _breaker_gauge(self, is_open: bool) -> None:
        metrics.for_node(self.cfg, self.local_node).update(set_={("slurmagent_breaker_open", ()): int(is_open)})

    # --- drain ---

    def _do_drain(self, entry: Entry) -> str:
        p = entry.payload
        if p.get("planned"):
            return self._drain_planned(p["node"], reasons.clean_reason(p["reason"]))
        return self._drain_fault(p)

    def _drain_planned(self, node: str, reason: str) -> str:
        found = [n for n in self._nodes([node]) if n.name == node]
        why = self.opted_out(found[0] if found else None, node)
        if why:
            return f"excluded ({why}): not drained"
        decision = policy.decide_planned_drain(found[0] if found else None, reason)
        if decision == "drain":
            self._update([node], State="DRAIN", Reason=reason)
            return "drained"
        return decision

    def _drain_fault(self, p: dict[str, Any]) -> str:
        node, reason = p["node"], reasons.clean_reason(p["reason"])
        nodes = self._nodes()
        takeover = PROLOG_FAILURE_REASONS if p.get("takeover_prolog_error") else ()
        decision = policy.decide_drain(nodes, node, reason, self.fraction, takeover_reasons=takeover)
        me = next((n for n in nodes if n.name == node), None)
        why = self.opted_out(me, node)
        if why:
            return f"excluded ({why}): not drained"
        if decision in ("no-such-node", "kept-admin-drain", "already-drained"):
            return decision
        if decision == "update-reason":
            self._update([node], State="DRAIN", Reason=reason)
            return "drained (reason updated)"
        b = policy.breaker(nodes, self.fraction, self.clock(), float(self.cfg.repair.suppressed_ttl_s))
        if decision == "suppress" and not p.get("force"):
            self._suppress(me, p, b)
            self._breaker_gauge(True)
            return "suppressed-by-breaker"
        fields = {"State": "DRAIN", "Reason": reason}
        if me is not None and me.marks.suppressed_at is not None:
            fields["Comment"] = ""  # no longer held back by the breaker: drained now
        self._update([node], **fields)
        drop_marker(self.cfg.state_path(node))
        self._breaker_gauge(False)
        if p.get("force") or policy.allowed_drained(len(nodes), self.fraction) >= len(nodes):
            return "drained" + (" (breaker overridden)" if decision == "suppress" else "")
        # Optimistic drain: verify against drains other machines made in the same burst.
        now = time.time()
        self.sleep(max(0.0, math.floor(now) + 1.25 - now))
        after = self._nodes()
        if policy.keeps_drain(after, node, self.fraction):
            return "drained"
        me_after = next((n for n in after if n.name == node), None)
        if me_after is not None and me_after.ours and me_after.reason == reason:
            undo = {"State": "RESUME"}
            if me_after.comment_free:
                undo["Comment"] = reasons.suppressed_comment(self.clock(), reasons.fault_text(reason))
            self._update([node], **undo)
        self._write_marker(node)
        warn(f"CIRCUIT BREAKER: {node} not drained (lost the race for the last of "
             f"{policy.allowed_drained(len(after), self.fraction)} drain slots): {reason}")
        return "suppressed-by-breaker (lost the race)"

    def _suppress(self, me: NodeInfo | None, p: dict[str, Any], b: policy.Breaker) -> None:
        node = p["node"]
        fault = reasons.fault_text(p["reason"])
        if me is not None and me.comment_free and not me.ours:
            self._update([node], Comment=reasons.suppressed_comment(self.clock(), fault))
        self._write_marker(node)
        warn(f"CIRCUIT BREAKER: {node} is unhealthy ({fault}) but NOT drained: "
             f"{b.describe()}. Check for a cluster-wide cause; `slurmagent repair --force {node}` overrides")

    def _write_marker(self, node: str) -> None:
        if node == self.local_node or "%n" in self.cfg.state_dir:  # a state dir this machine holds
            write_marker(self.cfg.state_path(node), self.clock())

    # --- requeue / release / resume ---

    def _do_requeue(self, entry: Entry) -> str:
        job_ids = [str(j) for j in entry.payload["job_ids"]]
        node = entry.payload.get("node")
        if node:
            why = self.opted_out(None, node) or self.opted_out(self._view(node), node)
            if why:
                return f"excluded ({why}): job(s) {','.join(job_ids)} not requeued"
        if entry.attempts == 0 and entry.payload.get("fresh"):
            try:
                self._slurm(lambda: self.slurm.requeue(job_ids))
            except Retry as why:
                if len(job_ids) == 1 and already_requeued(why):  # e.g. by the watch, before this epilog
                    return "nothing to do (already requeued)"
                raise
            return "requeued"
        todo = []
        for jid in job_ids:
            job = self._slurm(lambda jid=jid: self.slurm.job(jid))
            if job is not None and (job.state in REQUEUE_STATES or job.ambiguous):  # Slurm refuses what does not apply
                todo.append(jid)
        if not todo:
            return "nothing to do (jobs already requeued, running or gone)"
        self._slurm(lambda: self.slurm.requeue(todo))
        return f"requeued {','.join(todo)}"

    def _do_release(self, entry: Entry) -> str:
        jid = str(entry.payload["job_id"])
        job = self._slurm(lambda: self.slurm.job(jid))
        if job is None:
            return "nothing to do (job gone)"
        if job.ambiguous:
            return "nothing to do (the job's record is ambiguous: its own text imitates Slurm's fields)"
        if job.held:
            self._slurm(lambda: self.slurm.release([jid]))
            return "released"
        if job.restarts == 0 and job.state in ("RUNNING", "CONFIGURING", "PENDING") and \
                self.clock() - entry.created < RELEASE_WAIT_S:
            raise Retry("job not requeued yet")
        return f"nothing to do (job {job.state}, not held)"

    def _do_resume(self, entry: Entry) -> str:
        p = entry.payload
        node = p["node"]
        found = [n for n in self._nodes([node]) if n.name == node]
        why = self.opted_out(found[0] if found else None, node)
        if why:
            return f"excluded ({why}): not resumed"
        powered_down = bool(found) and p.get("powered_down") and policy.dynamic_cleanup(found)[1] == [node]
        if not found or not (found[0].ours or powered_down):
            return "nothing to do (not drained by slurmagent)"
        if p.get("only_reason") and found[0].reason != p["only_reason"]:
            return "nothing to do (drained for another reason now)"
        fields = {"State": "RESUME"}
        if found[0].comment.startswith(reasons.COMMENT_TAG + " "):
            fields["Comment"] = ""
        self._update([node], **fields)
        drop_marker(self.cfg.state_path(node))
        return "resumed"

    # --- a job off a failed GPU ---

    def _do_fault_requeue(self, entry: Entry) -> str:
        """Requeue (or cancel) one job running on a node whose GPU failed, once: the restart
        count it was seen with tells a repeated request (another node of the job, a replay, the
        deadline after the wrapper's own requeue) from a first one."""
        p = entry.payload
        jid, seen = str(p["job_id"]), int(p.get("restarts", 0))
        if entry.attempts == 0 and p.get("fresh"):  # squeue saw it running moments ago: no second read
            try:
                self.slurm.requeue([jid])
                return "requeued"
            except SlurmError as exc:
                if unreachable(exc):
                    raise StopReplay(f"slurmctld unreachable: {exc}") from None
                # e.g. `Job is pending execution`: requeued since it was seen; the read below says so
        job = self._slurm(lambda: self.slurm.job(jid))
        decision = policy.decide_fault_requeue(job, seen, cancel=bool(p.get("cancel")))
        if decision == "requeue":
            self._slurm(lambda: self.slurm.requeue([jid]))
            return "requeued"
        if decision == "cancel":
            self._slurm(lambda: self.slurm.cancel([jid]))
            return "cancelled (not requeueable)"
        return f"nothing to do ({decision})"

    # --- repair request (replayed with the same requestId) ---

    def _do_repair(self, entry: Entry) -> str:
        p = entry.payload
        nodes = {n.name: n for n in self._nodes()}
        live = {name: info for name, info in p["nodes"].items()
                if name in nodes and nodes[name].ours and not self.opted_out(nodes[name], name)}
        if not live:
            return "moot: nodes no longer drained by slurmagent (resumed by an admin?) or opted out"
        marking = {n: reasons.repairing_reason(i["reason"]) for n, i in live.items() if not nodes[n].repairing}
        if marking:
            self._slurm(lambda: self.slurm.set_reasons(marking))
        compute = self.compute(p["project"])
        from .gcp.compute import ComputeError  # google only on the repair path, for start-up speed

        try:
            ops = send_repair(compute, p, live)
        except ComputeError as exc:
            if exc.retriable:
                raise Retry(str(exc)) from None
            self.revert_repairing(live)
            return f"failed: {exc}"
        self.repaired(list(live))
        return "requested: " + ", ".join(str(o) for o in ops)

    def _do_power_down(self, entry: Entry) -> str:
        """A dynamic node: `State=POWER_DOWN_ASAP` with our reason (jobs on it finish first; Slurm's
        SuspendProgram deletes the VM and the next job gets a fresh one). Only nodes still
        drained by us (or down with our reason: the VM is gone), not powered down already."""
        wanted: dict[str, str] = entry.payload["nodes"]
        found = {n.name: n for n in self._nodes(list(wanted))}
        groups: dict[str, list[str]] = {}
        for name, reason in sorted(wanted.items()):
            n = found.get(name)
            if n is None or self.opted_out(n, name):
                continue
            if not (n.ours or (n.down and reasons.is_ours(n.reason))):
                continue
            if n.flags & {"POWERED_DOWN", "POWERING_DOWN", "POWER_DOWN"}:
                continue
            reason = reasons.clean_reason(reason)
            new = reason if reasons.is_planned(reason) else reasons.repairing_reason(reason)
            groups.setdefault(new, []).append(name)
        if not groups:
            return "nothing to do (not drained by slurmagent, opted out, or powered down already)"
        for reason, names in groups.items():
            self._update(names, State="POWER_DOWN_ASAP", Reason=reason)
        return "powered down (POWER_DOWN_ASAP): " + hostlist.compress([n for g in groups.values() for n in g])

    def _do_note(self, entry: Entry) -> str:
        """A journaled fact, nothing to do (e.g. an admin's resume cancelled our repair)."""
        return str(entry.payload.get("note", "noted"))

    def repaired(self, nodes: list[str]) -> None:
        record_history(self.state_dir, nodes, self.clock())
        metrics.for_node(self.cfg, self.local_node).update(add={("slurmagent_repairs_total", ()): len(nodes)})

    def compute(self, project: str) -> Any:
        if self.compute_factory is not None:
            return self.compute_factory(project)
        from .gcp.compute import Compute  # google only on the repair path, for start-up speed

        return Compute.from_config(self.cfg, project)

    def revert_repairing(self, live: dict[str, dict[str, Any]]) -> None:
        """After a failed repair request: the nodes' reasons back from `repairing` to the fault."""
        try:
            self.slurm.set_reasons({n: reasons.fault_reason(i["reason"]) for n, i in live.items()})
        except SlurmError as exc:
            warn(f"could not put back the reasons of {hostlist.compress(list(live))} after a failed repair: {exc}")

    def clear_suppressed_mark(self, node: str) -> None:
        """The node is healthy again: its breaker mark (Comment and local marker) goes."""
        found = [n for n in self.slurm.nodes([node]) if n.name == node]
        if found and found[0].marks.suppressed_at is not None:
            self.slurm.update_nodes([node], Comment="")
        drop_marker(self.cfg.state_path(node))


def already_requeued(exc: BaseException) -> bool:
    """Slurm refused a requeue because the job is requeued already (`Job is pending execution`)."""
    return "pending execution" in str(exc).lower()


def send_repair(compute: Any, p: dict[str, Any], live: dict[str, dict[str, Any]]) -> list:
    """Send one repair request (a MIG's recreate, or report-faulty for each node) and wait."""
    from .gcp.metadata import MigRef  # only the repair path needs it: start-up speed

    deadline = float(p.get("deadline_s", 120.0))
    if p["strategy"] == "recreate":
        mig = MigRef.from_dict(p["mig"])
        ops = compute.recreate(mig, [(info["zone"], name) for name, info in sorted(live.items())], p["request_id"],
                               deadline_s=deadline)
    else:
        ops = []
        for name, info in sorted(live.items()):
            rid = str(uuid.uuid5(uuid.UUID(p["request_id"]), name))
            rule = reasons.rule_of(info["reason"])
            ops.append(compute.report_faulty(info["zone"], name, policy.fault_behavior(rule),
                                             f"{reasons.PREFIX} {reasons.fault_text(info['reason'])}", rid,
                                             deadline_s=deadline))
    for op in ops:
        compute.wait(op, deadline_s=deadline)
    return ops


# --- the public actions -------------------------------------------------------------------


def _in_journal(pending: str) -> str:
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
        return DrainOutcome("drain-failed: " + _in_journal(outcome), True)
    if outcome.startswith("suppressed"):  # breaker open: no drain; a dead GPU still keeps the job off
        return DrainOutcome(outcome, policy.blocks_job(findings))
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
        return "requeue-failed: " + _in_journal(outcome)
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
    from .gcp.compute import ComputeError  # google only on the repair path, for start-up speed

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


# --- jobs on a GPU that failed under them ---------------------------------------------------

FAULT_CLASSIFY_BUDGET_S = 5.0  # telling wrapped jobs from others: past this, the rest count as unwrapped


@dataclass
class JobLeave:
    """One job on a node whose GPU failed: what was done and, once it is off the node, when."""

    job: RunningJob
    wrapped: bool
    action: str
    left_after_s: float | None = None  # from the fault seen to the job off the node
    requeued_by: str = ""  # "slurmagent", "wrapper", or "" (not requeued)
    signalled_at: float | None = None  # the fault flush was signalled: followed until it left
    finished: bool = True  # nothing more to follow


@dataclass
class FaultEviction:
    """The jobs running on a node whose GPU just became unusable leave it at once.

    `start()` (right after the drain stood): one squeue for the node's jobs; a wrapped job gets
    the fault flush signal on its batch step (one scancel for all): its wrapper waits only
    briefly for the trainer, syncs and requeues; any other job is requeued (cancelled when not
    requeueable) through the journal, per `[watch] running_jobs`. `poll()` follows the flushed
    jobs (one squeue) until they left the node, and past `[watch] flush_deadline_s` requeues
    those still there. Each job gets a decision line (event `fault-evict`) when it is acted on
    and, when it was flushed, one more once it is off the node, with the time from the fault."""

    cfg: Config
    slurm: Slurm
    node: str
    fault_at: float  # time.monotonic() when the fault was seen
    source: str = "watch"
    reason: str = ""
    log: DecisionLog | None = None
    clock: Callable[[], float] = time.monotonic
    jobs: list[JobLeave] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(j.finished for j in self.jobs)

    def start(self, skip: Iterable[tuple[str, int]] = ()) -> list[JobLeave]:
        """Flush or requeue every job running on the node (but those in `skip`: (job, restarts)
        already handled). Raises SlurmError when the jobs cannot be listed."""
        skipped = set(skip)
        running = [j for j in self.slurm.running_jobs(self.node) if (j.job_id, j.restarts) not in skipped]
        wrapped = self._wrapped(running)
        flush = [j for j in running if j.job_id in wrapped]
        others = [j for j in running if j.job_id not in wrapped]
        if flush:
            try:
                signal_jobs(self.slurm, [j.job_id for j in flush], str(int(FAULT_FLUSH_SIGNAL)))
                now = self.clock()
                self.jobs += [JobLeave(j, True, "fault flush signalled", signalled_at=now, finished=False)
                              for j in flush]
            except SlurmError as exc:
                warn(f"{self.node}: cannot signal the fault flush to job(s) {','.join(j.job_id for j in flush)} "
                     f"({exc}); requeueing them instead")
                others += flush
        for job in others:
            self.jobs.append(self._leave(job, wrapped=job.job_id in wrapped, fresh=True))
        self._record(self.jobs)  # a flushed job gets a second line once it is off the node
        return list(self.jobs)

    def poll(self) -> list[JobLeave]:
        """Follow the flushed jobs: those off the node, and those requeued past the deadline,
        are returned (and logged). One squeue while any is outstanding."""
        waiting = [j for j in self.jobs if not j.finished]
        if not waiting:
            return []
        try:
            running = {j.job_id: j for j in self.slurm.running_jobs(self.node)}
        except SlurmError as exc:
            warn(f"{self.node}: cannot follow the fault flush of job(s) {','.join(j.job.job_id for j in waiting)}: {exc}")
            running = None
        finished = []
        for leave in waiting:
            now = self.clock()
            seen = leave.job
            if running is not None and (seen.job_id not in running or running[seen.job_id].restarts > seen.restarts):
                self._left(leave, now)
            elif now - (leave.signalled_at or now) >= float(self.cfg.watch.flush_deadline_s):
                done = self._leave(seen, wrapped=True, fresh=False)
                leave.action = "still on the node after the deadline: " + done.action
                leave.requeued_by, leave.left_after_s = done.requeued_by, done.left_after_s
            else:
                continue
            leave.finished = True
            finished.append(leave)
        self._record(finished)
        return finished

    def wait(self, poll_s: float = 0.5, sleep: Callable[[float], None] = time.sleep) -> list[JobLeave]:
        """Poll until every flushed job left or was requeued (the deadline bounds it)."""
        while not self.done:
            sleep(poll_s)
            self.poll()
        return list(self.jobs)

    # --- the steps ---

    def _wrapped(self, jobs: list[RunningJob]) -> set[str]:
        out: set[str] = set()
        end = self.clock() + FAULT_CLASSIFY_BUDGET_S
        for job in jobs:
            if self.clock() >= end:
                break  # a slow slurmctld: the rest are requeued, which is what the deadline would do
            try:
                if self.slurm.job_is_wrapped(job.job_id):
                    out.add(job.job_id)
            except SlurmError:
                pass
        return out

    def _leave(self, job: RunningJob, *, wrapped: bool, fresh: bool) -> JobLeave:
        """Requeue (or cancel) one job through the journal, or leave it per `running_jobs`."""
        if self.cfg.watch.running_jobs != "requeue":
            return JobLeave(job, wrapped, "left alone (running_jobs = leave)")
        try:
            _, outcome = Actions(self.cfg, self.slurm, self.node).run(
                "fault-requeue", lock_wait_s=HOOK_LOCK_WAIT_S, node=self.node, job_id=job.job_id,
                restarts=job.restarts, cancel=True, fresh=fresh and job.requeue, reason=self.reason)
        except (SlurmagentError, OSError) as exc:
            outcome = f"pending: {exc}"
        leave = JobLeave(job, wrapped, _in_journal(outcome))
        if outcome == "requeued":
            leave.requeued_by, leave.left_after_s = "slurmagent", self.clock() - self.fault_at
        elif outcome.startswith("cancelled"):
            leave.left_after_s = self.clock() - self.fault_at
        return leave

    def _left(self, leave: JobLeave, now: float) -> None:
        """A flushed job is off the node: requeued by its wrapper, or ended (e.g. its requeue budget)."""
        leave.left_after_s = now - self.fault_at
        try:
            job = self.slurm.job(leave.job.job_id)
        except SlurmError:
            job = None
        if job is not None and job.restarts > leave.job.restarts:
            leave.requeued_by, leave.action = "wrapper", "flushed and requeued by its wrapper"
        else:
            leave.action = f"flushed, ended without a requeue ({job.state if job else 'gone'})"

    def _record(self, leaves: list[JobLeave]) -> None:
        add: dict[tuple[str, tuple], float] = {}
        last = None
        for leave in leaves:
            if leave.requeued_by:
                key = ("slurmagent_jobs_requeued_on_fault_total", (("by", leave.requeued_by),))
                add[key] = add.get(key, 0) + 1
            elif leave.action.startswith("cancelled"):
                key = ("slurmagent_jobs_cancelled_on_fault_total", ())
                add[key] = add.get(key, 0) + 1
            if leave.left_after_s is not None:
                last = leave.left_after_s
            if self.log is not None:
                self.log.write("fault-evict", node=self.node, source=self.source, job=leave.job.job_id,
                               restarts=leave.job.restarts, job_nodes=leave.job.num_nodes, wrapped=leave.wrapped,
                               action=leave.action, requeued_by=leave.requeued_by or None,
                               fault_to_leave_s=None if leave.left_after_s is None else round(leave.left_after_s, 3),
                               reason=self.reason or None)
        if add or last is not None:
            gauges = {("slurmagent_fault_to_leave_seconds", ()): last} if last is not None else {}
            metrics.for_node(self.cfg, self.node).update(set_=gauges, add=add)

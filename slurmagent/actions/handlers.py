"""The handlers of journal entries: one per action kind, against Slurm and Compute.

`JournalExecutor` (`executor.py`) journals an action and runs its handler here; a replay (the
next hook, timer or command after slurmctld or the API was down) runs the same handler again,
so each handler looks at the current state before it acts.

* Fault drains go through the circuit breaker (`policy/breaker.py`): one `scontrol -o show node`
  to count, the drain, and, when the breaker is on, a second read to verify against concurrent
  drains on other machines (detached, after the hook's exit, when `detach` is set: a prolog
  whose findings keep the job off the node anyway). Planned drains are journaled too, but never
  held back nor counted.
* Adding an action kind: one handler `_do_<kind>` in `EntryHandlers.handlers()` and one method
  of `JournalExecutor` that journals it.
* Opt-out (`drain_policy.opted_out`) is checked by every handler, whoever asked.

No google module is imported here: `gcp/compute.py` is imported on the repair path only.
"""

from __future__ import annotations

import math
import time
import weakref
from typing import Any, Callable

from ..core import hostlist, reasons
from ..state import metrics
from ..policy import (
    breaker as breaker_policy,
    drain as drain_policy,
    eviction as eviction_policy,
    lemon,
)
from ..state.config import Config
from ..state.decisionlog import DecisionLog, path_for, warn
from ..errors import SlurmError
from ..state.journal import Entry, Journal, Retry, StopReplay
from ..slurm.model import NodeInfo
from ..state.repair_state import drop_marker, load_state, record_history, write_marker
from ..slurm.commands import Slurm, unreachable

# What a replay that stopped because slurmctld could not be reached says (`journal` exits 3 on it).
SLURM_UNREACHABLE = "slurmctld unreachable"

# Slurm's own reason after our prolog exited non-zero: a pending drain from that prolog may
# replace it with the precise reason (it is the echo of our own failure, not an admin's).
PROLOG_FAILURE_REASONS = ("Prolog error", "Prolog failed")
RELEASE_WAIT_S = 300.0  # a journaled release waits this long for Slurm to requeue the job (held)
REQUEUE_STATES = frozenset({"FAILED", "NODE_FAIL", "COMPLETING", "BOOT_FAIL", "TIMEOUT", "OUT_OF_MEMORY"})
VIEW_REUSE_S = 5.0  # a node read this recently by this process answers the opt-out check of a requeue
_recent_views: weakref.WeakKeyDictionary[Slurm, tuple[float, dict[str, NodeInfo]]] = weakref.WeakKeyDictionary()


class EntryHandlers:
    """One handler per journal entry kind (`_do_<kind>`), run by `JournalExecutor` when an
    action is asked and again by every replay; each looks at the current state before it acts."""

    cfg: Config
    slurm: Slurm
    local_node: str
    state_dir: Any
    journal: Journal | None  # None: the job's user acting once, nothing journaled
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    compute_factory: Callable[[str], Any] | None
    fraction: float
    # Runs the breaker's check against racers after a new fault drain in the background
    # (returns False when it could not): set by a prolog whose findings keep the job off
    # the node whatever the breaker says, so its exit need not wait for that check.
    detach: Callable[[Callable[[], object]], bool] | None

    def handlers(self) -> dict[str, Callable[[Entry], str]]:
        return {"drain": self._do_drain, "requeue": self._do_requeue, "release": self._do_release,
                "resume": self._do_resume, "repair": self._do_repair, "power_down": self._do_power_down,
                "repair_cancelled": self._do_note, "fault-requeue": self._do_fault_requeue}

    # --- slurm calls mapped to replay semantics ---

    def _slurm(self, fn: Callable[[], Any]) -> Any:
        if self.journal is None:  # no replay to come: the caller gets Slurm's error and retries
            return fn()
        try:
            return fn()
        except SlurmError as exc:
            if unreachable(exc):
                raise StopReplay(f"{SLURM_UNREACHABLE}: {exc}") from None
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
        return drain_policy.opted_out(node, name, tuple(self.cfg.repair.exclude_nodes))

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
        decision = drain_policy.decide_planned_drain(found[0] if found else None, reason)
        if decision == "drain":
            self._update([node], State="DRAIN", Reason=reason)
            return "drained"
        return decision

    def _drain_fault(self, p: dict[str, Any]) -> str:
        node, reason = p["node"], reasons.clean_reason(p["reason"])
        nodes = self._nodes()
        takeover = (PROLOG_FAILURE_REASONS if p.get("takeover_prolog_error") else ()) + (
            (p["takeover_reason"],) if p.get("takeover_reason") else ())
        decision = drain_policy.decide_drain(nodes, node, reason, self.fraction, takeover_reasons=takeover)
        me = next((n for n in nodes if n.name == node), None)
        why = self.opted_out(me, node)
        if why:
            return f"excluded ({why}): not drained"
        if decision in ("no-such-node", "kept-admin-drain", "already-drained"):
            return decision
        if decision == "update-reason":
            self._update([node], State="DRAIN", Reason=reason)
            return "drained (reason updated)"
        b = breaker_policy.breaker(nodes, self.fraction, self.clock(), float(self.cfg.repair.suppressed_ttl_s))
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
        if p.get("force") or breaker_policy.allowed_drained(len(nodes), self.fraction) >= len(nodes):
            return "drained" + (" (breaker overridden)" if decision == "suppress" else "")
        if self.detach is not None and self.detach(lambda: self._verify_in_background(node, reason)):
            return "drained (the breaker checks racers after the prolog exits)"
        return self._verify_drain(node, reason)

    def _verify_in_background(self, node: str, reason: str) -> None:
        """`_verify_drain` after the prolog exited; a lost race is said in the decision log too."""
        try:
            outcome = self._verify_drain(node, reason)
        except (Retry, StopReplay) as exc:  # as on replay: the drain stands (`already-drained`)
            outcome = f"drained (breaker check failed: {exc})"
        if outcome != "drained":
            DecisionLog(path_for(self.cfg, node), use_syslog=self.cfg.hooks.syslog).write(
                "breaker", node=node, verdict="unhealthy", rule="breaker", reason=reason, action=outcome)

    def _verify_drain(self, node: str, reason: str) -> str:
        """Optimistic drain: verify against drains other machines made in the same burst."""
        now = time.time()
        self.sleep(max(0.0, math.floor(now) + 1.25 - now))
        after = self._nodes()
        if breaker_policy.keeps_drain(after, node, self.fraction):
            return "drained"
        me_after = next((n for n in after if n.name == node), None)
        if me_after is not None and me_after.ours and me_after.reason == reason:
            undo = {"State": "RESUME"}
            if me_after.comment_free:
                undo["Comment"] = reasons.suppressed_comment(self.clock(), reasons.fault_text(reason))
            self._update([node], **undo)
        self._write_marker(node)
        warn(f"CIRCUIT BREAKER: {node} not drained (lost the race for the last of "
             f"{breaker_policy.allowed_drained(len(after), self.fraction)} drain slots): {reason}")
        return "suppressed-by-breaker (lost the race)"

    def _suppress(self, me: NodeInfo | None, p: dict[str, Any], b: breaker_policy.Breaker) -> None:
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
            verb = {k: True for k in ("hold", "special_exit") if entry.payload.get(k)}
            try:
                self._slurm(lambda: self.slurm.requeue(job_ids, **verb))
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
        from ..policy import repair as repair_policy  # not on the prolog's drain path: start-up speed

        powered_down = bool(found) and p.get("powered_down") and repair_policy.dynamic_cleanup(found)[1] == [node]
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
                    raise StopReplay(f"{SLURM_UNREACHABLE}: {exc}") from None
                # e.g. `Job is pending execution`: requeued since it was seen; the read below says so
        job = self._slurm(lambda: self.slurm.job(jid))
        decision = eviction_policy.decide_fault_requeue(job, seen, cancel=bool(p.get("cancel")))
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
        from ..gcp.compute import ComputeError  # google only on the repair path, for start-up speed

        try:
            ops = send_repair(compute, p, live)
        except ComputeError as exc:
            if exc.retriable:
                raise Retry(str(exc)) from None
            self.revert_repairing(live)
            self.count_repairs(p["strategy"], "refused" if exc.refused else "failed", len(live))
            return f"failed: {exc}"
        self.repaired(list(live), p["strategy"])
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
        self.count_repairs("power-down", "requested", sum(len(g) for g in groups.values()))
        return "powered down (POWER_DOWN_ASAP): " + hostlist.compress([n for g in groups.values() for n in g])

    def _do_note(self, entry: Entry) -> str:
        """A journaled fact, nothing to do (e.g. an admin's resume cancelled our repair)."""
        return str(entry.payload.get("note", "noted"))

    def repaired(self, nodes: list[str], action: str) -> None:
        now = self.clock()
        record_history(self.state_dir, nodes, now, self.cfg.repair.lemon_window_s, self.cfg.repair.lemon_faults)
        self.count_repairs(action, "requested", len(nodes))
        # the lemon gauges count this repair now (a node it makes a lemon shows as one at once)
        metrics.for_node(self.cfg, self.local_node).update(
            set_=lemon.state_gauges(load_state(self.state_dir), now, self.cfg.repair),
            replace_prefix="slurmagent_node_faults{")

    def count_repairs(self, action: str, result: str, nodes: int) -> None:
        """`slurmagent_repairs_total{action,result}`, per node: requested, refused (Google said
        no: e.g. reportHostAsFaulty on an unsupported VM) or failed (any other error, after
        the retries)."""
        metrics.for_node(self.cfg, self.local_node).update(
            add={("slurmagent_repairs_total", (("action", action), ("result", result))): nodes})

    def compute(self, project: str) -> Any:
        if self.compute_factory is not None:
            return self.compute_factory(project)
        from ..gcp.compute import Compute  # google only on the repair path, for start-up speed

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
    import uuid  # with platform: only the repair path needs it, start-up speed of a failing prolog

    from ..policy import repair as repair_policy  # only the repair path needs it: start-up speed
    from ..gcp.metadata import MigRef  # only the repair path needs it: start-up speed

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
            ops.append(compute.report_faulty(info["zone"], name, repair_policy.fault_behavior(rule),
                                             f"{reasons.PREFIX} {reasons.fault_text(info['reason'])}", rid,
                                             deadline_s=deadline))
    for op in ops:
        compute.wait(op, deadline_s=deadline)
    return ops

"""Pure decisions: the drain circuit breaker, drain arbitration, jobs on a failed GPU, expiry.

No I/O: nodes (`nodes.NodeInfo`, parsed from one `scontrol -o show node`), the config
values and the clock go in, a decision comes out. `actions.py` and the runtimes do the talking;
which node `repair` fixes, and how, is decided in `repair_policy.py`.

Marks in the node's Slurm `Comment` (only written when the comment is empty or already
ours, never over an admin's):

* `slurmagent suppressed@<epoch> <summary>`: the breaker kept slurmagent from draining
  this unhealthy node; visible cluster-wide to `status` and `repair --force`.

Circuit breaker: at most `allowed = max(1, floor(max_drained_fraction * nodes))` nodes may
be held drained by slurmagent for a fault (`max_drained_fraction >= 1` turns it off). A new
fault drain that would go beyond is suppressed. Planned drains (expiry, maintenance,
preemption: a flex cohort shares one termination time) are never suppressed and never
counted. Concurrent prologs on different machines cannot take a lock, so a new drain is
optimistic and then verified: after the drain the node waits until slurmctld's clock has
left the second of its own drain, reads all nodes again and keeps its drain only if it
ranks among the first `allowed` fault-drained nodes in (established first, drain time,
name) order; otherwise it undoes it. Every racer ordered before a node is visible to that
node's second read, so exactly `allowed` drains survive a burst.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Iterable

from . import hostlist, reasons, xid
from .nodes import OPT_OUT_FEATURE, JobInfo, NodeInfo
from .timefmt import fmt_time, from_epoch, parse_time

ESTABLISHED_S = 5.0  # a drain older than this (relative to ours) is not part of the same burst

# Finding rules after which a job cannot run on the node at all: even with the breaker open
# the prolog keeps the job off (exit non-zero) for these.
JOB_BLOCKING_RULES = frozenset({"nvml-error", "nvml-timeout", "gpu-lost", "gpu-count"})
JOB_BLOCKING_XIDS = frozenset({79})  # GPU has fallen off the bus


def blocks_job(findings: Iterable[Any]) -> bool:
    """Can no job run here at all (GPU lost/missing, NVML dead)? Duck-typed checks.Finding."""
    for f in findings:
        if getattr(getattr(f, "severity", None), "name", "") != "DRAIN":
            continue
        if f.rule in JOB_BLOCKING_RULES or (f.rule == "xid" and f.observed in JOB_BLOCKING_XIDS):
            return True
    return False


# --- running jobs on a GPU that just failed ---------------------------------------------

# Findings after which a GPU is unusable under a running job: its jobs leave the node at once
# (the watch and healthcheck flush or requeue them). Conditions that can be transient (clock
# slowdown, PCIe width, an NVML call that timed out under load) drain the node only.
EVICTING_RULES = frozenset({"gpu-lost", "gpu-count", "nvml-error"})
EVICTING_XID_ACTIONS = frozenset({xid.XidAction.RESET_GPU, xid.XidAction.REBOOT_NODE})
EVICTING_RECOVERY_ACTIONS = frozenset({1, 2, 4})  # NVML asks for a GPU reset, a node reboot, drain and reset
STILL_RUNNING = frozenset({"RUNNING", "SUSPENDED"})


def evicts_jobs(findings: Iterable[Any]) -> bool:
    """Must the jobs running on the node leave it now? GPU lost or missing, NVML down, or an
    XID whose immediate action in NVIDIA's catalogue is a GPU reset or a node reboot (or
    NVML's recovery action saying the same). Duck-typed checks.Finding."""
    for f in findings:
        if getattr(getattr(f, "severity", None), "name", "") != "DRAIN":
            continue
        if f.rule in EVICTING_RULES:
            return True
        if f.rule == "xid" and isinstance(f.observed, int) and xid.lookup(f.observed).action in EVICTING_XID_ACTIONS:
            return True
        if f.rule == "recovery-action" and f.observed in EVICTING_RECOVERY_ACTIONS:
            return True
    return False


def decide_fault_requeue(job: JobInfo | None, seen_restarts: int, *, cancel: bool) -> str:
    """A job seen running (with `seen_restarts`) on a node whose GPU died: `requeue`, `cancel`
    (not requeueable, and cancelling is allowed), or why nothing is to be done. A higher
    restart count means someone (another node's watch, the job's wrapper) requeued it already:
    a multi-node job is requeued once, however many of its nodes see the fault."""
    if job is None:
        return "job gone"
    if job.restarts > seen_restarts:
        return "already requeued"
    if job.state not in STILL_RUNNING:
        return f"job {job.state}"
    if not job.requeue:
        return "cancel" if cancel else "not requeueable"
    return "requeue"


# --- circuit breaker --------------------------------------------------------------------


def allowed_drained(total: int, fraction: float) -> int:
    """How many nodes slurmagent may hold drained; never 0 on a non-empty cluster."""
    if fraction >= 1.0:
        return total
    return max(1, math.floor(fraction * total + 1e-9)) if total else 0


@dataclass(frozen=True)
class Breaker:
    total: int
    allowed: int
    fraction: float
    drained: tuple[str, ...]
    suppressed: tuple[str, ...]

    @property
    def enabled(self) -> bool:
        return self.fraction < 1.0

    @property
    def demand(self) -> int:
        return len(self.drained) + len(self.suppressed)

    @property
    def open(self) -> bool:
        """Tripped: more nodes want out than the limit. New drains and repairs stop."""
        return self.enabled and self.demand > self.allowed

    @property
    def full(self) -> bool:
        """No room for one more drain."""
        return self.enabled and len(self.drained) >= self.allowed

    def describe(self) -> str:
        if not self.enabled:
            return f"off (max_drained_fraction >= 1); {len(self.drained)} of {self.total} nodes drained by slurmagent"
        state = "OPEN" if self.open else ("at limit" if self.full else "closed")
        text = (f"{state}: {len(self.drained)} of {self.total} nodes drained by slurmagent, limit {self.allowed} "
                f"({self.fraction:.0%})")
        if self.suppressed:
            text += f"; {len(self.suppressed)} more unhealthy but not drained (suppressed): {', '.join(self.suppressed)}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"state": "open" if self.open else ("off" if not self.enabled else "closed"), "total": self.total,
                "allowed": self.allowed, "max_drained_fraction": self.fraction, "drained": list(self.drained),
                "suppressed": list(self.suppressed)}


def live_suppressed(n: NodeInfo, now: float, ttl_s: float) -> bool:
    m = n.marks
    return m.suppressed_at is not None and not n.ours and now - m.suppressed_at <= ttl_s


def breaker(nodes: list[NodeInfo], fraction: float, now: float | None = None, suppressed_ttl_s: float = 86400.0) -> Breaker:
    """The breaker's state: fault drains and live suppression marks (planned drains do not count)."""
    now = time.time() if now is None else now
    drained = tuple(sorted(n.name for n in nodes if n.fault_drain))
    suppressed = tuple(sorted(n.name for n in nodes if live_suppressed(n, now, suppressed_ttl_s)))
    return Breaker(len(nodes), allowed_drained(len(nodes), fraction), fraction, drained, suppressed)


def decide_drain(nodes: list[NodeInfo], node: str, reason: str, fraction: float, *,
                 takeover_reasons: tuple[str, ...] = ()) -> str:
    """What a fault drain request for `node` should do now:
    `no-such-node`, `kept-admin-drain`, `already-drained`, `update-reason` (ours, new reason),
    `drain` (new drain, to be verified against racers) or `suppress` (breaker full)."""
    me = next((n for n in nodes if n.name == node), None)
    if me is None:
        return "no-such-node"
    if me.held_by_other and me.reason not in takeover_reasons:
        return "kept-admin-drain"
    if me.ours and me.reason == reason:
        return "already-drained"
    others = sum(1 for n in nodes if n.fault_drain and n.name != node)
    full = fraction < 1.0 and others >= allowed_drained(len(nodes), fraction)
    if me.fault_drain:
        return "update-reason"  # counted already: a new fault on a node drained for another
    if me.planned_drain:  # drained ahead of its end; the fault makes it count for the breaker
        return "suppress" if full else "update-reason"
    return "suppress" if full else "drain"


def opted_out(node: NodeInfo | None, name: str, exclude: tuple[str, ...]) -> str:
    """Why slurmagent must not drain, requeue on, or repair this node ("" when it may): the
    node feature `slurmagent_off`, or `[repair] exclude_nodes` (names or hostlists)."""
    if node is not None and node.opted_out:
        return f"node feature {OPT_OUT_FEATURE}"
    for pattern in exclude:
        try:
            names = hostlist.expand(pattern)
        except ValueError:
            names = [pattern]
        if name in names:
            return "[repair] exclude_nodes"
    return ""


def decide_planned_drain(node: NodeInfo | None, reason: str) -> str:
    """What a planned drain (expiry, maintenance, preemption) of `node` should do now:
    `no-such-node`, `kept-slurmagent-drain` (a fault drain: repair owns it),
    `kept-admin-drain`, `already-drained` or `drain`. The breaker has no say."""
    if node is None:
        return "no-such-node"
    if node.fault_drain:
        return "kept-slurmagent-drain"
    if node.held_by_other:
        return "kept-admin-drain"
    if node.ours and node.reason == reason:
        return "already-drained"
    return "drain"


def rank_key(n: NodeInfo, ref_time: float | None) -> tuple[int, float, str]:
    t = n.reason_time if n.reason_time is not None else 0.0
    established = n.repairing or ref_time is None or n.reason_time is None or t < ref_time - ESTABLISHED_S
    return (0 if established else 1, t, n.name)


def keeps_drain(nodes: list[NodeInfo], node: str, fraction: float) -> bool:
    """After an optimistic drain (see the module doc): does `node` rank within the limit?"""
    if fraction >= 1.0:
        return True
    me = next((n for n in nodes if n.name == node), None)
    if me is None or not me.fault_drain:
        return False
    ours = sorted((n for n in nodes if n.fault_drain), key=lambda n: rank_key(n, me.reason_time))
    return [n.name for n in ours].index(node) < allowed_drained(len(nodes), fraction)


# --- expiry: drain ahead of the VM's end, flush its jobs in time ----------------------------

EXPIRY_SCHEMA = 1
STALE_RECHECK_S = 300.0  # the time passed but we live: ask the API again at most this often
UNDRAIN_MARGIN_S = 60.0  # the end moved out of the drain window by more than this: undo our drain
NOTICE_GRACE_S = 300.0  # alive this long after a notice's stop time, and no notice now: it is over
GPU_MAINTENANCE_NOTICE_S = 3600.0  # a GPU VM's TERMINATE_ON_HOST_MAINTENANCE comes about an hour ahead
EXPIRY_DRAIN_KEYS = ("drained", "drain", "drain_reason", "drained_at")
EXPIRY_CARRIED_KEYS = (*EXPIRY_DRAIN_KEYS, "flushed", "flushed_at", "flush_cause", "flushed_jobs", "requeued_jobs",
                       "left_jobs")


def refresh_jitter(node: str) -> float:
    """0.9..1.1, stable per node: a fleet booted together does not refresh in one burst."""
    return 0.9 + (zlib.crc32(node.encode()) % 2001) / 10000.0


def api_answer_fresh(cached: dict[str, Any] | None, now: float, refresh_s: float, node: str, *,
                     event_changed: bool = False, window_soon_s: float = 0.0) -> bool:
    """Is the cached Compute API answer still good? Not when old, nor when the VM outlived it,
    nor when the metadata `maintenance-event` changed since (the window is read again), nor
    older than STALE_RECHECK_S while a maintenance window is within `window_soon_s` (it may move)."""
    if not cached or event_changed:
        return False
    age = now - float(cached.get("checked_at_epoch", 0))
    t = cached.get("scheduling", {}).get("termination_time")
    outlived = t is not None and now > parse_time(t).timestamp() + UNDRAIN_MARGIN_S
    w = cached.get("scheduling", {}).get("maintenance_window_start")
    window_near = w is not None and parse_time(w).timestamp() - now < window_soon_s
    return age < refresh_s * refresh_jitter(node) and not ((outlived or window_near) and age > STALE_RECHECK_S)


@dataclass
class ExpiryDecision:
    """One check's decision; `expiry.py` carries out the steps and records their results in `state`."""

    state: dict[str, Any]  # the state to write, before the steps' own results
    termination: datetime | None = None
    source: str = ""
    remaining_s: float | None = None
    notes: list[str] = field(default_factory=list)  # what the check saw (notices, live migration, old state)
    release: str | None = None  # undo our own drain, for this reason (then drop EXPIRY_DRAIN_KEYS)
    drain_reason: str | None = None  # drain now with this reason
    flush_cause: str | None = None  # flush the running jobs now
    next_check_s: float | None = None  # when the next threshold is crossed (loop mode)


def _our_drain_stands(old: dict[str, Any]) -> bool:
    return bool(old.get("drained") and old.get("drain_reason")
                and str(old.get("drain", "")).startswith(("drained", "already-drained", "pending")))


def _remembered_notice(withdrawn: dict[str, Any] | None, now: float, drain_lead_s: float) -> dict[str, Any] | None:
    """A withdrawn maintenance notice, while a re-issue should keep its stop time (a notice
    withdrawn and re-issued every few minutes must not push T an hour away each time). It is
    cancelled for real, and forgotten, once withdrawn for longer than `drain_lead_s` or once its
    stop time is NOTICE_GRACE_S past (the VM lived through it). A known API window wins over it."""
    if not withdrawn:
        return None
    try:
        t = parse_time(withdrawn["termination_time"]).timestamp()
        since = parse_time(withdrawn["withdrawn_at"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return None
    if now - since > drain_lead_s or now > t + NOTICE_GRACE_S:
        return None
    return withdrawn


def decide_expiry(*, now: float, node: str, boot_id: str, old: dict[str, Any], override: datetime | None,
                  api: dict[str, Any] | None, events: Any, lookup_failed: bool, drain_lead_s: float,
                  flush_lead_s: float, max_time_s: Callable[[], float] | None = None) -> ExpiryDecision:
    """The expiry watch's decision for one check, from what it knows now.

    `old`: the state file; `override`: `[expiry] termination_time`; `api`: the (cached) Compute
    API answer; `events`: the metadata notices (gcp.events.Events) or None; `lookup_failed`:
    the metadata server or the API failed this time (a failed lookup never undoes a drain);
    `max_time_s`: the node's largest partition MaxTime, asked only when a time is known."""
    d = ExpiryDecision({"schema": EXPIRY_SCHEMA, "node": node, "boot_id": boot_id, "checked_at": fmt_time(from_epoch(now))})
    if old and old.get("boot_id") != boot_id:
        d.notes.append(f"discarded the expiry state of an earlier boot ({old.get('boot_id') or 'unknown'})")
        old = {}
    old = dict(old)
    state = d.state

    # 1. termination time: config, else the (cached) Compute API
    termination, model, source = override, "", "config"
    if override is None:
        source = "compute-api"
        if api:
            state["api"], state["scheduling"] = api, api["scheduling"]
            t = api["scheduling"].get("termination_time")
            termination = parse_time(t) if t else None
            model = str(api["scheduling"].get("provisioning_model") or "")

    # 2. host maintenance and preemption. T for a maintenance notice: the API's
    # upcomingMaintenance.windowStartTime when known, else about an hour ahead on a GPU VM, else
    # 60 s; a preemption: 30 s. A notice is remembered until the VM outlives it, or dropped when
    # withdrawn well before its T (the window was rescheduled or cancelled).
    sched = api["scheduling"] if api and override is None else {}
    window_text = sched.get("maintenance_window_start")
    window = parse_time(window_text) if window_text else None
    terminates = sched.get("on_host_maintenance") == "TERMINATE"
    notice = old.get("notice")
    remembered = _remembered_notice(old.get("withdrawn_notice"), now, drain_lead_s)
    withdrawn = events is not None and not events.error and events.notice is None
    if notice and withdrawn:
        t_old = parse_time(notice["termination_time"]).timestamp()
        if now < t_old - UNDRAIN_MARGIN_S:
            d.notes.append(f"the {notice['kind']} notice of {notice['seen_at']} was withdrawn (rescheduled or cancelled)")
            if notice["kind"] == "maintenance":  # its T is kept for a re-issue (see _remembered_notice)
                remembered = {**notice, "withdrawn_at": fmt_time(from_epoch(now))}
            notice = None
        elif now > t_old + NOTICE_GRACE_S:
            if _our_drain_stands(old):
                d.release = f"the {notice['kind']} notice of {notice['seen_at']} passed and the VM lives on"
            notice = None
    if events is not None and events.notice and not notice:
        kind, lead = events.notice
        when = now + lead
        if kind == "maintenance":
            when = window.timestamp() if window is not None else now + (
                GPU_MAINTENANCE_NOTICE_S if sched.get("gpu_vm") else lead)
        notice = {"kind": kind, "seen_at": fmt_time(from_epoch(now)), "termination_time": fmt_time(from_epoch(when)),
                  "value": events.maintenance if kind == "maintenance" else events.preempted}
        d.notes.append(f"{'preemption' if kind == 'preempt' else events.maintenance} notice")
        if kind == "maintenance" and window is None and remembered is not None:
            if parse_time(remembered["termination_time"]).timestamp() < when:
                notice.update(termination_time=remembered["termination_time"], seen_at=remembered["seen_at"])
                d.notes.append(f"re-issued after its withdrawal at {remembered['withdrawn_at']}: it keeps the stop "
                               f"time it first announced, {remembered['termination_time']}")
            remembered = None
    elif notice and notice["kind"] == "maintenance" and window is not None and \
            fmt_time(window) != notice["termination_time"]:
        d.notes.append(f"maintenance window moved to {fmt_time(window)}")
        notice = {**notice, "termination_time": fmt_time(window)}
    elif events is not None and events.migrating and old.get("last_maintenance_event") != events.maintenance:
        d.notes.append(f"{events.maintenance}: live migration, nothing to do")
    if events is not None and not events.error:
        state["last_maintenance_event"] = events.maintenance
    if remembered is not None:
        state["withdrawn_notice"] = remembered
    kind = "expiry"
    if notice:
        state["notice"] = notice
        t_notice = parse_time(notice["termination_time"])
        if termination is None or t_notice < termination:
            kind = notice["kind"]
            termination, source = t_notice, "maintenance-event" if kind == "maintenance" else "preempted"
    elif window is not None and terminates and (termination is None or window < termination):
        kind, termination, source = "maintenance", window, "upcoming-maintenance"  # scheduled, no notice yet

    state.update({k: old[k] for k in EXPIRY_CARRIED_KEYS if k in old})  # this boot's drain/flush flags
    d.termination, d.source = termination, source
    if termination is None:
        if not lookup_failed and d.release is None and not notice and _our_drain_stands(old):
            d.release = "the termination time moved"
        return d
    remaining = termination.timestamp() - now
    d.remaining_s = remaining
    state.update(termination_time=fmt_time(termination), source=source, remaining_s=round(remaining))

    # 3. drain at T - drain lead (at once when the notice is shorter), or undo our drain when the
    # end moved out of the window (a later flex end, a rescheduled or cancelled maintenance)
    drain_at = max(drain_lead_s, max_time_s() if max_time_s is not None else 0.0)
    if remaining <= drain_at:
        d.drain_reason = reasons.expiry_reason(termination, kind, model)
    elif d.release is None and not lookup_failed and remaining > drain_lead_s + UNDRAIN_MARGIN_S \
            and _our_drain_stands(old):
        d.release = "the termination time moved"

    # 4. flush at T - flush lead (at once when the notice is shorter)
    if remaining <= flush_lead_s:
        if notice and kind != "expiry":
            d.flush_cause = f"{notice['value']} notice"
        elif kind == "maintenance":
            d.flush_cause = f"host maintenance in {max(remaining, 0):.0f} s"
        else:
            d.flush_cause = f"VM expiry in {max(remaining, 0):.0f} s"
    ahead = [remaining - x for x in (drain_at, flush_lead_s) if remaining - x > 0]
    d.next_check_s = min(ahead) if ahead else None
    return d

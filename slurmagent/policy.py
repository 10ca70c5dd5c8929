"""Pure decisions: the drain circuit breaker, drain arbitration and which nodes to repair.

No I/O: nodes (`nodes.NodeInfo`, parsed from one `scontrol -o show node`), the config
values and the clock go in, a decision comes out. `actions.py` and the runtimes do the talking.

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

import json
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

# reportHostAsFaulty fault reason per rule (InstancesReportHostAsFaultyRequestFaultReason.behavior).
PERFORMANCE_RULES = frozenset({"hw-slowdown", "pcie-width", "nvlink-down", "nvml-timeout"})
SDC_RULES = frozenset({"sdc", "silent-data-corruption"})  # e.g. an admin's `slurmagent: sdc: loss spike on rank 3`
GPU_LOSS_RULES = frozenset({"gpu-lost", "gpu-count", "nvml-error", "ecc-uncorrectable", "row-remap-failure",
                            "row-remap-pending", "retired-pages-pending", "recovery-action"})

# --- reasons -> repair calls ----------------------------------------------------------


def fault_behavior(rule: str) -> str:
    """The fault reason reportHostAsFaulty gets for a drain rule: UNRECOVERABLE_GPU_ERROR for a
    lost/unusable GPU and drain-class XIDs, PERFORMANCE for slowdowns, SILENT_DATA_CORRUPTION
    for a reported wrong-result fault, BEHAVIOR_UNSPECIFIED for anything else."""
    if rule in PERFORMANCE_RULES:
        return "PERFORMANCE"
    if rule in SDC_RULES:
        return "SILENT_DATA_CORRUPTION"
    if rule in GPU_LOSS_RULES or rule.startswith("xid "):
        return "UNRECOVERABLE_GPU_ERROR"
    return "BEHAVIOR_UNSPECIFIED"


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


# --- repair planning --------------------------------------------------------------------


@dataclass
class RepairPlan:
    todo: list[str] = field(default_factory=list)       # repair these now
    needs_drain: list[str] = field(default_factory=list)  # suppressed nodes --force drains first
    skipped: dict[str, str] = field(default_factory=dict)  # not now, not an error
    refused: dict[str, str] = field(default_factory=dict)  # named but not ours: an error
    suppressed: list[str] = field(default_factory=list)  # held back by the open breaker


def plan_repair(nodes: list[NodeInfo], requested: list[str], *, force: bool, breaker_state: Breaker, now: float,
                retry_after_s: float = 3600.0, history: dict[str, list[float]] | None = None,
                max_per_day: int = 3, strategy: str = "") -> RepairPlan:
    """What to repair now, skip or refuse. A busy node waits for its jobs to end, except one
    that is powered down (`strategy`): POWER_DOWN_ASAP lets its jobs finish first by itself."""
    plan = RepairPlan()
    by_name = {n.name: n for n in nodes}
    history = history or {}
    if requested:
        candidates = []
        for name in requested:
            n = by_name.get(name)
            if n is None:
                plan.refused[name] = "no such node in Slurm"
            elif n.ours:
                candidates.append(n)
            elif force and n.name in breaker_state.suppressed and (
                    not n.held_by_other or n.reason in ("Prolog error", "Prolog failed")):
                plan.needs_drain.append(n.name)  # the breaker kept it from draining: --force does it now
                candidates.append(n)
            elif n.held_by_other:
                plan.refused[name] = (f"drained by someone else (reason {n.reason or 'none'!r}): "
                                      "slurmagent only repairs nodes it drained itself")
            else:
                plan.refused[name] = f"not drained by slurmagent (state {n.state})"
    else:
        candidates = [n for n in nodes if n.ours]
    for n in candidates:
        fresh = n.name in plan.needs_drain
        if not fresh and not reasons.repairable(n.reason):
            plan.skipped[n.name] = f"{reasons.rule_of(n.reason)!r} is not a hardware fault a new VM fixes: left drained"
            continue
        if n.repairing and (n.reason_time is None or now - n.reason_time < retry_after_s):
            plan.skipped[n.name] = "repair already requested" + (
                f" {now - n.reason_time:.0f} s ago" if n.reason_time is not None else "")
            continue
        if n.busy and not force and not powers_down(strategy, n):
            plan.skipped[n.name] = "jobs still running on it: repaired once they end (or --force)"
            continue
        recent = [t for t in history.get(n.name, []) if now - t < 86400]
        if len(recent) >= max_per_day and not force:
            plan.refused[n.name] = (f"repaired {len(recent)} times in 24 h and still failing: "
                                    "left drained for an admin (or --force)")
            continue
        plan.todo.append(n.name)
    if breaker_state.open and not force:
        plan.suppressed, plan.todo = plan.todo, []
        plan.needs_drain = []
    return plan


# --- repair requests: one per MIG (recreate) or per node (report-faulty) -------------------


def mig_short(mig: dict[str, str] | None) -> str:
    if not mig:
        return "?"
    return f"{mig['scope']}/{mig['location']}/instanceGroupManagers/{mig['name']}"


def known_target(strategy: str, cached: dict[str, Any] | None, zone: str) -> dict[str, Any] | None:
    """Where a node's repair goes when that is known without asking the API (the cache: its
    MIG for `recreate`, its VM's facts for `auto`; the zone for `report-faulty`); None: look the VM up."""
    if strategy == "recreate" and cached and cached.get("mig"):
        return cached
    if strategy == "auto" and cached and cached.get("vm"):
        return cached
    if strategy == "report-faulty":
        return {"zone": cached.get("zone", zone) if cached else zone}
    return None


def dry_run_line(name: str, action: str, cached: dict[str, Any] | None, needs_drain: bool, reason: str,
                 why: str = "") -> str:
    """`repair --dry-run`: what would happen to the node, and why (auto's choice)."""
    if action == "recreate":
        where = (cached or {}).get("mig")
        verb = "recreate via " + (f"MIG {mig_short(where)}" if where else "its MIG (looked up at run time)")
    elif action == "report-faulty":
        verb = f"report host as faulty [{fault_behavior(reasons.rule_of(reason))}]"
    elif action == "power-down":
        verb = "power down (POWER_DOWN_ASAP)"
    elif action == "fail":
        verb = "fail"
    else:
        verb = "leave it drained"
    return (f"{name}: would {'drain and ' if needs_drain else ''}{verb}"
            + f" ({reasons.fault_text(reason) or 'suppressed fault'})" + (f": {why}" if why else ""))


def repair_requests(targets: dict[str, dict[str, Any]], strategy: str, reason_of: dict[str, str], project: str,
                    deadline_s: float, new_id: Callable[[], str]) -> list[dict[str, Any]]:
    """The repair requests to send: ONE per MIG with all its nodes (`recreate`), or one per
    node (`report-faulty`), each with its own request id (reused by a replay)."""
    groups: dict[str, list[str]] = {}
    for name, t in targets.items():
        key = json.dumps(t.get("mig"), sort_keys=True) if strategy == "recreate" else name
        groups.setdefault(key, []).append(name)
    requests = []
    for members in groups.values():
        live = {n: {"zone": targets[n]["zone"], "reason": reason_of[n]} for n in sorted(members)}
        requests.append({"strategy": strategy, "project": project, "mig": targets[members[0]].get("mig"),
                         "nodes": live, "request_id": new_id(), "deadline_s": deadline_s})
    return requests


# --- which repair each VM gets ([repair] strategy) -----------------------------------------

# Machine types whose host Google takes back through reportHostAsFaulty: A3 Ultra, A4, A4X (and,
# per Google's troubleshooting page for the API, A3 Mega and A3 High with 8 GPUs); only for a
# RUNNING VM on the reservation-bound provisioning model. A refusal falls back to recreate anyway.
REPORTABLE_MACHINE_TYPES = ("a3-ultragpu-", "a4-highgpu-", "a4x-highgpu-", "a3-megagpu-8g", "a3-highgpu-8g")
GPU_MACHINE_FAMILIES = ("a2-", "a3-", "a4-", "a4x-", "g2-", "g4-")


@dataclass(frozen=True)
class VmFacts:
    """What `repair` needs to know about a node's VM (one instances.get, or a list entry)."""

    zone: str
    status: str = ""  # RUNNING, TERMINATED, ...
    machine_type: str = ""  # the last segment: a3-ultragpu-8g
    provisioning_model: str = ""  # STANDARD | SPOT | FLEX_START | RESERVATION_BOUND | "" (STANDARD)
    reservation: str = ""  # reservationAffinity.consumeReservationType
    mig: dict[str, str] | None = None  # the MIG of `created-by` (MigRef.to_dict), None: in no MIG
    gpus: int = 0  # guestAccelerators, summed

    def to_dict(self) -> dict[str, Any]:
        return {"zone": self.zone, "status": self.status, "machine_type": self.machine_type,
                "provisioning_model": self.provisioning_model, "reservation": self.reservation, "mig": self.mig,
                "gpus": self.gpus}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VmFacts:
        return cls(str(d.get("zone", "")), str(d.get("status", "")), str(d.get("machine_type", "")),
                   str(d.get("provisioning_model", "")), str(d.get("reservation", "")), d.get("mig"),
                   int(d.get("gpus", 0) or 0))

    @property
    def reservation_bound(self) -> bool:
        """Created through a reservation: the reservation-bound model (or a standard VM that
        consumes a specific reservation)."""
        return self.provisioning_model == "RESERVATION_BOUND" or (
            self.provisioning_model in ("", "STANDARD") and self.reservation == "SPECIFIC_RESERVATION")

    @property
    def gpu_vm(self) -> bool:
        return self.gpus > 0 or self.machine_type.startswith(GPU_MACHINE_FAMILIES)


def report_refusal(vm: VmFacts) -> str:
    """Why Google would refuse reportHostAsFaulty for this VM; "" when it takes it."""
    if not vm.machine_type.startswith(REPORTABLE_MACHINE_TYPES):
        return f"machine type {vm.machine_type or 'unknown'} is not A3 Ultra/A4/A4X: no reportHostAsFaulty"
    if not vm.reservation_bound:
        model = {"FLEX_START": "flex-start", "SPOT": "spot", "": "standard"}.get(vm.provisioning_model,
                                                                                vm.provisioning_model.lower())
        return f"{model} VM: Google takes reportHostAsFaulty only for reservation-bound VMs"
    if vm.status and vm.status != "RUNNING":
        return f"VM is {vm.status}, not RUNNING: no reportHostAsFaulty"
    return ""


@dataclass(frozen=True)
class RepairChoice:
    """What `repair` does with one node: recreate | report-faulty | power-down | leave | fail."""

    action: str
    why: str = ""


def choose_repair(strategy: str, node: NodeInfo, vm: VmFacts | None, refused: str = "") -> RepairChoice:
    """The repair a drained node gets. `vm`: its VM's facts (None when not looked up: the
    strategy needs none, or the lookup failed); `refused`: Google refused reportHostAsFaulty
    for this VM before (then a MIG recreate, or it stays drained). Never a deletion."""
    if powers_down(strategy, node):
        return RepairChoice("power-down", "dynamic node: Slurm gives the next job a fresh VM" if node.dynamic
                            else "[repair] strategy power-down")
    if strategy == "report-faulty" and not refused:
        return RepairChoice("report-faulty", "[repair] strategy report-faulty")
    if vm is None:
        return RepairChoice("fail", "its VM was not found")
    if strategy in ("recreate", "report-faulty"):
        if vm.mig:
            return RepairChoice("recreate", f"reportHostAsFaulty refused ({refused})" if refused else "")
        return RepairChoice("fail", "not created by a managed instance group: cannot recreate it")
    why_not = f"reportHostAsFaulty refused ({refused})" if refused else report_refusal(vm)
    if not why_not:
        model = "reservation-bound" if vm.provisioning_model == "RESERVATION_BOUND" else "reservation"
        return RepairChoice("report-faulty", f"running {model} {vm.machine_type}")
    if vm.mig:
        return RepairChoice("recreate", why_not)
    return RepairChoice("leave", f"in no MIG and {why_not}: left drained for an admin (never deleted)")


def powers_down(strategy: str, node: NodeInfo) -> bool:
    """Is this node's repair a power-down (a dynamic node under `auto`, or `power-down`)?"""
    return strategy == "power-down" or (strategy == "auto" and node.dynamic)


def needs_vm(strategy: str, node: NodeInfo) -> bool:
    """Does choose_repair need the VM's facts for this node (an instances.get, unless cached)?"""
    return strategy not in ("none", "report-faulty") and not powers_down(strategy, node)


def dynamic_cleanup(nodes: list[NodeInfo]) -> tuple[list[str], list[str]]:
    """Dynamic nodes slurmagent must not leave DOWN: (power down: drained by us ahead of the VM's
    end and now down, the VM gone), (resume: powered down by us but still DOWN in Slurm, so
    Slurm may power them up again for the next job)."""
    power_down, resume = [], []
    for n in nodes:
        if not n.dynamic or not reasons.is_ours(n.reason):
            continue
        gone = n.down or "NOT_RESPONDING" in n.flags
        if n.planned_drain and gone and not n.flags & {"POWERED_DOWN", "POWERING_DOWN", "POWER_DOWN"}:
            power_down.append(n.name)
        elif n.down and "POWERED_DOWN" in n.flags and not n.flags & {"POWERING_DOWN", "POWERING_UP"}:
            resume.append(n.name)
    return sorted(power_down), sorted(resume)


def cancelled_repairs(nodes: list[NodeInfo], requested: dict[str, float]) -> list[str]:
    """Nodes with a repair we asked for that an admin resumed by hand meanwhile: in Slurm,
    no longer drained nor down, and slurmd not restarted since the request (a recreated or
    moved VM comes back with a new slurmd: that is the repair done, not cancelled)."""
    out = []
    by_name = {n.name: n for n in nodes}
    for name, at in requested.items():
        n = by_name.get(name)
        if n is None or n.drained or n.down or n.flags & {"POWERED_DOWN", "POWERING_DOWN", "POWER_DOWN", "POWERING_UP"}:
            continue  # still ours, being recreated, or powered down by us
        if n.slurmd_start is not None and n.slurmd_start > at:
            continue
        out.append(name)
    return sorted(out)


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
    withdrawn = events is not None and not events.error and events.notice is None
    if notice and withdrawn:
        t_old = parse_time(notice["termination_time"]).timestamp()
        if now < t_old - UNDRAIN_MARGIN_S:
            d.notes.append(f"the {notice['kind']} notice of {notice['seen_at']} was withdrawn (rescheduled or cancelled)")
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
    elif notice and notice["kind"] == "maintenance" and window is not None and \
            fmt_time(window) != notice["termination_time"]:
        d.notes.append(f"maintenance window moved to {fmt_time(window)}")
        notice = {**notice, "termination_time": fmt_time(window)}
    elif events is not None and events.migrating and old.get("last_maintenance_event") != events.maintenance:
        d.notes.append(f"{events.maintenance}: live migration, nothing to do")
    if events is not None and not events.error:
        state["last_maintenance_event"] = events.maintenance
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

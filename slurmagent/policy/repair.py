"""Pure decisions of `repair`: which drained nodes to repair, how, and what request to send.

No I/O: nodes (`slurm/model.NodeInfo`), the breaker's state (`policy/breaker.Breaker`), a VM's facts (one
instances.get, cached) and the clock go in, a plan or a choice comes out; `commands/repair.py` and
`actions/` do the talking. Never a deletion: a VM nobody can recreate stays drained.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ..core import reasons
from ..core.vm import VmFacts
from ..slurm.model import NodeInfo
from .breaker import Breaker

# reportHostAsFaulty fault reason per rule (InstancesReportHostAsFaultyRequestFaultReason.behavior).
PERFORMANCE_RULES = frozenset({"hw-slowdown", "pcie-width", "nvlink-down", "nvml-timeout"})
SDC_RULES = frozenset({"sdc", "silent-data-corruption"})  # e.g. an admin's `slurmagent: sdc: loss spike on rank 3`
GPU_LOSS_RULES = frozenset({"gpu-lost", "gpu-count", "nvml-error", "ecc-uncorrectable", "row-remap-failure",
                            "row-remap-pending", "retired-pages-pending", "recovery-action", "dcgm-diag"})

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


# --- repair planning --------------------------------------------------------------------


@dataclass
class RepairPlan:
    """What one repair pass does, node by node."""
    todo: list[str] = field(default_factory=list)       # repair these now
    needs_drain: list[str] = field(default_factory=list)  # suppressed nodes --force drains first
    skipped: dict[str, str] = field(default_factory=dict)  # not now, not an error
    refused: dict[str, str] = field(default_factory=dict)  # named but not ours: an error
    suppressed: list[str] = field(default_factory=list)  # held back by the open breaker
    adopt: list[str] = field(default_factory=list)  # another tool's drain, re-drained as ours first


def adopted(node: NodeInfo, adopt_reasons: tuple[str, ...]) -> bool:
    """Drained or down by someone else for a Reason an admin handed to repair (`[repair] adopt_reasons`,
    `re.search`). The one exception to "only `slurmagent:` reasons": nothing else is ever taken."""
    return (bool(adopt_reasons) and node.held_by_other and bool(node.reason)
            and any(re.search(p, node.reason) for p in adopt_reasons))


def plan_repair(nodes: list[NodeInfo], requested: list[str], *, force: bool, breaker_state: Breaker, now: float,
                retry_after_s: float = 3600.0, history: dict[str, list[float]] | None = None,
                max_per_day: int = 3, strategy: str = "", adopt_reasons: tuple[str, ...] = ()) -> RepairPlan:
    """What to repair now, skip or refuse. A busy node waits for its jobs to end, except one
    that is powered down (`strategy`): POWER_DOWN_ASAP lets its jobs finish first by itself.
    A node `adopted` (another tool's drain an admin handed over) is repaired as ours once
    re-drained with its reason kept (`plan.adopt`); every other foreign drain or DOWN stays."""
    plan = RepairPlan()
    adopting = {n.name for n in nodes if adopted(n, adopt_reasons)}
    by_name = {n.name: n for n in nodes}
    history = history or {}
    if requested:
        candidates = []
        for name in requested:
            n = by_name.get(name)
            if n is None:
                plan.refused[name] = "no such node in Slurm"
            elif n.ours or n.name in adopting:
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
        candidates = [n for n in nodes if n.ours or n.name in adopting]
    for n in candidates:
        fresh = n.name in plan.needs_drain or n.name in adopting  # its reason is not ours (yet)
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
        if n.name in adopting:
            plan.adopt.append(n.name)
    if breaker_state.open and not force:
        plan.suppressed, plan.todo = plan.todo, []
        plan.needs_drain, plan.adopt = [], []
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


def choose_repair(strategy: str, node: NodeInfo, vm: VmFacts | None, refused: str = "",
                  lemon: str = "") -> RepairChoice:
    """The repair a drained node gets. `vm`: its VM's facts (None when not looked up: the
    strategy needs none, or the lookup failed); `refused`: Google refused reportHostAsFaulty
    for this VM before (then a MIG recreate, or it stays drained); `lemon`: why this node is a
    lemon to escalate (policy/lemon.py): reportHostAsFaulty where its VM takes it. Never a deletion."""
    if powers_down(strategy, node):
        return RepairChoice("power-down", "dynamic node: Slurm gives the next job a fresh VM" if node.dynamic
                            else "[repair] strategy power-down")
    if lemon and vm is not None and not refused and not report_refusal(vm):
        return RepairChoice("report-faulty", lemon)
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

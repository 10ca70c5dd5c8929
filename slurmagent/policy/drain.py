"""Pure drain decisions: may this node be drained now, and does a finding keep the job off.

Fault drains go through the breaker (`breaker.py`); planned drains (expiry, maintenance) never do.
"""

from __future__ import annotations

from typing import Any, Iterable
from ..core import hostlist
from ..slurm.model import OPT_OUT_FEATURE, NodeInfo
from .breaker import allowed_drained

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



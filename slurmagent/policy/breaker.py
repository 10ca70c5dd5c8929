"""The drain circuit breaker: how many nodes slurmagent may hold drained for a fault.

No I/O: nodes (`slurm/model.NodeInfo`, parsed from one `scontrol -o show node`), the config
values and the clock go in, a decision comes out. `actions/` and the runtimes do the talking;
which node `repair` fixes, and how, is decided in `policy/repair.py`.

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
node's second read, so exactly `allowed` drains survive a burst. (A prolog whose job cannot
run on the node whatever the breaker says exits first and leaves that read to a detached
process: Slurm requeues its job without waiting for the second to pass.)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any
from ..slurm.model import NodeInfo

ESTABLISHED_S = 5.0  # a drain older than this (relative to ours) is not part of the same burst


def allowed_drained(total: int, fraction: float) -> int:
    """How many nodes slurmagent may hold drained; never 0 on a non-empty cluster."""
    if fraction >= 1.0:
        return total
    return max(1, math.floor(fraction * total + 1e-9)) if total else 0


@dataclass(frozen=True)
class Breaker:
    """The circuit breaker's count: fault-drained nodes against the drains allowed."""
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
        state = "off" if not self.enabled else ("open" if self.open else ("at-limit" if self.full else "closed"))
        return {"state": state, "total": self.total,
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



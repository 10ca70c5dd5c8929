"""Pure decisions of the repair loop: the drain circuit breaker and which nodes to repair.

No I/O: node views (parsed from one `scontrol -o show node`), the config values and the
clock go in, a decision comes out. `repair.py` does the talking.

Marks in the node's Slurm `Comment` (only written when the comment is empty or already
ours, never over an admin's):

* `slurmagent suppressed@<epoch> <summary>`: the breaker kept slurmagent from draining
  this unhealthy node; visible cluster-wide to `status` and `repair --force`.

Circuit breaker: at most `allowed = max(1, floor(max_drained_fraction * nodes))` nodes may
be held drained by slurmagent (`max_drained_fraction >= 1` turns it off). A new drain that
would go beyond is suppressed. Concurrent prologs on different machines cannot take a lock,
so a new drain is optimistic and then verified: after the drain the node waits until
slurmctld's clock has left the second of its own drain, reads all nodes again and keeps
its drain only if it ranks among the first `allowed` drained nodes in (established first,
drain time, name) order; otherwise it undoes it. Every racer ordered before a node is
visible to that node's second read, so exactly `allowed` drains survive a burst.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable

PREFIX = "slurmagent:"
REPAIRING = "repairing"
COMMENT_TAG = "slurmagent"
MAX_REASON = 200

# Finding rules after which a job cannot run on the node at all: even with the breaker open
# the prolog keeps the job off (exit non-zero) for these.
JOB_BLOCKING_RULES = frozenset({"nvml-error", "nvml-timeout", "gpu-lost", "gpu-count"})
JOB_BLOCKING_XIDS = frozenset({79})  # GPU has fallen off the bus

# Rules that are not hardware faults a new VM would fix: `repair` leaves these drained.
NOT_REPAIRED_RULES = ("expiry", "maintenance", "internal error", "termination", "preempt")

# reportHostAsFaulty fault behaviour per rule (everything else: UNRECOVERABLE_GPU_ERROR).
PERFORMANCE_RULES = frozenset({"hw-slowdown", "pcie-width", "nvlink-down", "nvml-timeout"})

# States in which slurmd has not (re)registered the node with slurmctld.
UNREGISTERED_FLAGS = frozenset({"DOWN", "NOT_RESPONDING", "UNKNOWN", "FUTURE", "POWERED_DOWN", "POWERING_UP",
                                "POWER_DOWN", "POWERING_DOWN", "REBOOT_ISSUED", "REBOOT_REQUESTED"})
BUSY_FLAGS = frozenset({"ALLOCATED", "MIXED", "COMPLETING"})
ESTABLISHED_S = 5.0  # a drain older than this (relative to ours) is not part of the same burst


# --- node views -----------------------------------------------------------------------


@dataclass(frozen=True)
class Marks:
    drained_at: float | None = None
    suppressed_at: float | None = None
    suppressed_summary: str = ""

    @property
    def empty(self) -> bool:
        return self.drained_at is None and self.suppressed_at is None


def parse_comment(comment: str) -> Marks:
    if not comment.startswith(COMMENT_TAG + " "):
        return Marks()
    drained = suppressed = None
    summary: list[str] = []
    for token in comment.split(" ")[1:]:
        key, at, value = token.partition("@")
        if at and key in ("drained", "suppressed") and not summary:
            try:
                stamp = float(value)
            except ValueError:
                continue
            if key == "drained":
                drained = stamp
            else:
                suppressed = stamp
        elif token:
            summary.append(token)
    return Marks(drained, suppressed, " ".join(summary) if suppressed is not None else "")


def suppressed_comment(now: float, summary: str) -> str:
    text = re.sub(r"\s+", " ", re.sub(r"[^A-Za-z0-9 _.,:;/()@+#%-]", " ", summary)).strip()
    return f"{COMMENT_TAG} suppressed@{now:.3f} {text}"[:MAX_REASON]


class DrainFlags:
    """Node-state predicates over `flags` (Slurm's State split on `+`) and `reason`."""

    flags: frozenset[str]
    reason: str

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.flags

    @property
    def down(self) -> bool:
        return "DOWN" in self.flags

    @property
    def ours(self) -> bool:
        """Drained by slurmagent: the only nodes slurmagent resumes or repairs."""
        return self.drained and self.reason.startswith(PREFIX)

    @property
    def held_by_other(self) -> bool:
        """Drained or down for a reason that is not ours (an admin or Slurm itself)."""
        return (self.drained or self.down) and not self.reason.startswith(PREFIX)


@dataclass(frozen=True)
class NodeView(DrainFlags):
    name: str
    flags: frozenset[str]
    reason: str = ""
    reason_time: float | None = None  # epoch seconds of the reason (slurmctld's clock, 1 s resolution)
    comment: str = ""
    slurmd_start: float | None = None
    raw: dict[str, str] = field(default_factory=dict, compare=False, repr=False)


    @property
    def repairing(self) -> bool:
        return self.ours and reason_body(self.reason).startswith(REPAIRING + ":")

    @property
    def busy(self) -> bool:
        return bool(self.flags & BUSY_FLAGS)

    @property
    def registered(self) -> bool:
        return bool(self.flags) and not (self.flags & UNREGISTERED_FLAGS)

    @property
    def marks(self) -> Marks:
        return parse_comment(self.comment)

    @property
    def comment_free(self) -> bool:
        """We may write the comment: empty or already ours (never an admin's)."""
        return not self.comment or self.comment.startswith(COMMENT_TAG + " ")

    @property
    def state(self) -> str:
        return "+".join(sorted(self.flags, key=lambda f: (f not in _BASE_STATES, f)))


_BASE_STATES = frozenset({"IDLE", "ALLOCATED", "MIXED", "DOWN", "UNKNOWN", "FUTURE", "ERROR"})


_REASON_STAMP = re.compile(r" \[(?P<user>[^\]@]*)@(?P<time>[0-9T:-]+)\]$")


def parse_slurm_time(text: str) -> float | None:
    """`2026-11-30T09:49:04` (slurmctld's local time) -> epoch seconds."""
    if not text or text in ("None", "Unknown", "(null)", "N/A"):
        return None
    try:
        return time.mktime(datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timetuple())
    except ValueError:
        return None


def node_view(kv: dict[str, str]) -> NodeView:
    """One `scontrol -o show node` line, already split into Key=Value pairs."""
    flags = frozenset(f for f in re.split(r"[+*]", kv.get("State", "")) if f)
    reason = kv.get("Reason", "")
    reason_time = None
    m = _REASON_STAMP.search(reason)
    if m:
        reason_time = parse_slurm_time(m["time"])
        reason = reason[: m.start()]
    if reason == "(null)":
        reason = ""
    comment = kv.get("Comment", "")
    if comment == "(null)":
        comment = ""
    return NodeView(
        name=kv.get("NodeName", ""),
        flags=flags,
        reason=reason.strip(),
        reason_time=reason_time,
        comment=comment.strip(),
        slurmd_start=parse_slurm_time(kv.get("SlurmdStartTime", "")),
        raw=kv,
    )


# --- reasons ----------------------------------------------------------------------------


def reason_body(reason: str) -> str:
    """`slurmagent: xid 79 on gpu 3 (...)` -> `xid 79 on gpu 3 (...)`."""
    return reason[len(PREFIX):].strip() if reason.startswith(PREFIX) else reason


def fault_text(reason: str) -> str:
    """The fault without the repair state: `repairing: xid 79 ...` -> `xid 79 ...`."""
    body = reason_body(reason)
    if body.startswith(REPAIRING + ":"):
        body = body[len(REPAIRING) + 1:].strip()
    return body


def repairing_reason(reason: str) -> str:
    return f"{PREFIX} {REPAIRING}: {fault_text(reason)}"[:MAX_REASON]


def fault_reason(reason: str) -> str:
    """Back from `repairing` to the plain fault reason (after a failed repair request)."""
    return f"{PREFIX} {fault_text(reason)}"[:MAX_REASON]


def rule_of(reason: str) -> str:
    text = fault_text(reason)
    m = re.match(r"xid \d+", text)
    if m:
        return m[0]
    return text.split(":", 1)[0].strip()


def repairable(reason: str) -> bool:
    rule = rule_of(reason)
    return not any(rule == r or rule.startswith(r + " ") or rule.startswith(r + "-") for r in NOT_REPAIRED_RULES)


def fault_behavior(rule: str) -> str:
    """Fault behaviour for reportHostAsFaulty (InstancesReportHostAsFaultyRequestFaultReason)."""
    return "PERFORMANCE" if rule in PERFORMANCE_RULES else "UNRECOVERABLE_GPU_ERROR"


def blocks_job(findings: Iterable[Any]) -> bool:
    """Can no job run here at all (GPU lost/missing, NVML dead)? Duck-typed checks.Finding."""
    for f in findings:
        if getattr(getattr(f, "severity", None), "name", "") != "DRAIN":
            continue
        if f.rule in JOB_BLOCKING_RULES or (f.rule == "xid" and f.observed in JOB_BLOCKING_XIDS):
            return True
    return False


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


def live_suppressed(n: NodeView, now: float, ttl_s: float) -> bool:
    m = n.marks
    return m.suppressed_at is not None and not n.ours and now - m.suppressed_at <= ttl_s


def breaker(nodes: list[NodeView], fraction: float, now: float | None = None, suppressed_ttl_s: float = 86400.0) -> Breaker:
    now = time.time() if now is None else now
    drained = tuple(sorted(n.name for n in nodes if n.ours))
    suppressed = tuple(sorted(n.name for n in nodes if live_suppressed(n, now, suppressed_ttl_s)))
    return Breaker(len(nodes), allowed_drained(len(nodes), fraction), fraction, drained, suppressed)


def decide_drain(nodes: list[NodeView], node: str, reason: str, fraction: float, *,
                 takeover_reasons: tuple[str, ...] = ()) -> str:
    """What a drain request for `node` should do now:
    `no-such-node`, `kept-admin-drain`, `already-drained`, `update-reason` (ours, new reason),
    `drain` (new drain, to be verified against racers) or `suppress` (breaker full)."""
    me = next((n for n in nodes if n.name == node), None)
    if me is None:
        return "no-such-node"
    if me.held_by_other and me.reason not in takeover_reasons:
        return "kept-admin-drain"
    if me.ours:
        return "already-drained" if me.reason == reason else "update-reason"
    others = sum(1 for n in nodes if n.ours and n.name != node)
    if fraction < 1.0 and others >= allowed_drained(len(nodes), fraction):
        return "suppress"
    return "drain"


def rank_key(n: NodeView, ref_time: float | None) -> tuple[int, float, str]:
    t = n.reason_time if n.reason_time is not None else 0.0
    established = n.repairing or ref_time is None or n.reason_time is None or t < ref_time - ESTABLISHED_S
    return (0 if established else 1, t, n.name)


def keeps_drain(nodes: list[NodeView], node: str, fraction: float) -> bool:
    """After an optimistic drain (see the module doc): does `node` rank within the limit?"""
    if fraction >= 1.0:
        return True
    me = next((n for n in nodes if n.name == node), None)
    if me is None or not me.ours:
        return False
    ours = sorted((n for n in nodes if n.ours), key=lambda n: rank_key(n, me.reason_time))
    return [n.name for n in ours].index(node) < allowed_drained(len(nodes), fraction)


# --- repair planning --------------------------------------------------------------------


@dataclass
class RepairPlan:
    todo: list[str] = field(default_factory=list)       # repair these now
    needs_drain: list[str] = field(default_factory=list)  # suppressed nodes --force drains first
    skipped: dict[str, str] = field(default_factory=dict)  # not now, not an error
    refused: dict[str, str] = field(default_factory=dict)  # named but not ours: an error
    suppressed: list[str] = field(default_factory=list)  # held back by the open breaker


def plan_repair(nodes: list[NodeView], requested: list[str], *, force: bool, breaker_state: Breaker, now: float,
                retry_after_s: float = 3600.0, history: dict[str, list[float]] | None = None,
                max_per_day: int = 3) -> RepairPlan:
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
        if not fresh and not repairable(n.reason):
            plan.skipped[n.name] = f"{rule_of(n.reason)!r} is not a hardware fault a new VM fixes: left drained"
            continue
        if n.repairing and (n.reason_time is None or now - n.reason_time < retry_after_s):
            plan.skipped[n.name] = "repair already requested" + (
                f" {now - n.reason_time:.0f} s ago" if n.reason_time is not None else "")
            continue
        if n.busy and not force:
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

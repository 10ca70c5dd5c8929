"""What one `repair` run did, or with `--dry-run` would do, per node: its exit code and its JSON.

The JSON (`repair --dry-run --json`, documented in docs/admin/commands.md) says per node what
the text lines say: the action, whether it goes through the node's MIG, its VM or Slurm, and
why; a node that is skipped or failed says why too. Pure: the runtime fills the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core import reasons
from ..errors import EXIT_OK, EXIT_PROBLEMS, EXIT_UNREACHABLE
from .repair import fault_behavior, mig_short

# Where each action is sent: the MIG (recreateInstances), the VM (reportHostAsFaulty) or
# Slurm (POWER_DOWN_ASAP: Slurm's power saving deletes the VM); `leave` goes nowhere.
VIA = {"recreate": "mig", "report-faulty": "vm", "power-down": "slurm"}
REFUSED = "refused: "  # how `repair` words a node it was named but may not repair (not ours, no such node)


@dataclass
class RepairResult:
    ok: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    compute_calls: int = 0
    plan: dict[str, dict[str, Any]] = field(default_factory=dict)  # --dry-run: node -> plan_entry
    unreachable: str = ""  # the first Compute API error that was no answer (network, timeout, 429/5xx)

    @property
    def exit_code(self) -> int:
        """3 when the Compute API could not be reached wins over 1 (some failed): an outage."""
        return EXIT_UNREACHABLE if self.unreachable else (EXIT_PROBLEMS if self.failed else EXIT_OK)


def plan_entry(name: str, action: str, target: dict[str, Any] | None, needs_drain: bool, reason: str,
               why: str = "") -> dict[str, Any]:
    """One node of the dry-run plan: the facts `repair.dry_run_line` puts in words."""
    target = target or {}
    mig = target.get("mig") if action == "recreate" else None
    return _entry(name, "planned", action=action, via=VIA.get(action),
                  mig=mig_short(mig) if mig else None, zone=target.get("zone") or None, drain_first=needs_drain,
                  fault=reasons.fault_text(reason) or None, why=why,
                  fault_behavior=fault_behavior(reasons.rule_of(reason)) if action == "report-faulty" else None)


def _entry(name: str, outcome: str, why: str = "", **facts: Any) -> dict[str, Any]:
    blank = {"action": None, "via": None, "mig": None, "zone": None, "drain_first": False, "fault": None,
             "fault_behavior": None}
    return {"node": name, "outcome": outcome, **blank, **facts, "why": why}



def dry_run_json(res: RepairResult | None, strategy: str, now: float, slurm_error: str | None = None) -> dict[str, Any]:
    """`repair --dry-run --json`. `res` None: Slurm could not be read (`slurm_error`), so
    `nodes` is null, not an empty plan."""
    if res is None:
        return {"dry_run": True, "time": now, "strategy": strategy, "slurm_error": slurm_error,
                "compute_error": None, "nodes": None, "exit_code": EXIT_UNREACHABLE}
    nodes = [_entry(n, *(("refused", why[len(REFUSED):]) if why.startswith(REFUSED) else ("failed", why)))
             for n, why in res.failed.items()]
    nodes += [_entry(n, "skipped", why=why) for n, why in res.skipped.items() if n not in res.failed]
    nodes += [e for n, e in res.plan.items() if n not in res.failed]
    return {"dry_run": True, "time": now, "strategy": strategy, "slurm_error": None,
            "compute_error": res.unreachable or None, "nodes": nodes, "exit_code": res.exit_code}

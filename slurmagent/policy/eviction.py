"""Pure decisions on running jobs when a GPU fails under them: leave the node at once, or not."""

from __future__ import annotations

from typing import Any, Iterable
from ..core import xid
from ..slurm.model import JobInfo


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



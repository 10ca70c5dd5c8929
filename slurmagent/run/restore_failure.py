"""A restore that failed on a node's own disk or path: requeue the job without that node.

A node whose checkpoint directory cannot take the checkpoint (a file where the directory must
be, a full or read-only disk) fails every attempt that lands there, while any other node would
do. So the wrapper requeues the job (the same retrying requeue and the same budget as a flush:
an attempt that could not even restore made no progress) and adds the node(s) to the job's
ExcNodeList. Slurm (22.05) accepts that update only once the job is PENDING, so it follows the
requeue, within the time Slurm holds a requeued job (`cred_expire` + 1 s). The nodes the job
already excludes are read before the requeue: right after it, Slurm SIGTERMs the batch step's
processes, which may end an squeue or scontrol we run (the update is tried again).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

from ..checkpoint.manifest import Manifest
from ..checkpoint.errors import NodeDiskError, is_node_local
from ..errors import SlurmagentError
from ..state.host import node_name

__all__ = ["NodeExcluder", "exclude_with_retries", "failed_nodes", "no_progress_streak", "requeue_without"]

EXCLUDE_DEADLINE_S = 15.0  # well inside the time Slurm holds a requeued job and before KillWait's SIGKILL


class NodeExcluder(Protocol):
    """What the wrapper needs to keep its job off a node (the journal-less `JournalExecutor`)."""

    def excluded_nodes(self, job_id: str) -> list[str]: ...

    def exclude_nodes(self, job_id: str, nodes: list[str], keep: list[str] = ...) -> list[str]: ...


def failed_nodes(exc: BaseException, env) -> list[str]:
    """The nodes a restore failure belongs to when it is theirs alone (disk, path); else []."""
    if not is_node_local(exc):
        return []
    named = list(exc.nodes) if isinstance(exc, NodeDiskError) else []
    return named or [node_name(None, env)]


def no_progress_streak(manifest: Manifest | None, restart_count: int) -> int:
    """The no-progress streak of an attempt that could not restore `manifest`: the attempts since
    the one that committed it made no progress either (they committed nothing newer)."""
    if manifest is None:
        return restart_count + 1
    return manifest.no_progress + max(1, restart_count - manifest.attempt)


def requeue_without(sup: Any, outcome: Any, exc: BaseException, nodes: list[str], slurm: NodeExcluder) -> Any:
    """Requeue the job (within the budget) and keep it off `nodes`; says why on the job's stderr.
    `sup`: the wrapper's Supervisor (its store, identity, `say` and `_hand_back`); `outcome`: its Outcome."""
    why = str(exc) if isinstance(exc, SlurmagentError) else f"{getattr(exc, 'strerror', '') or exc}"
    names = ", ".join(nodes)
    sup.say(f"restore failed on {names}, not starting the job: {why}")
    manifest = None
    try:
        manifest = sup.store.latest_manifest(deadline_s=30.0) if sup.store is not None else None
    except SlurmagentError:
        pass
    owner = getattr(sup.store, "owner", None)
    if manifest is not None and owner and manifest.owner != owner:
        manifest = None  # another submission's: its no-progress streak is not ours
    job = sup.ident.job_id
    keep: list[str] = []
    try:
        keep = slurm.excluded_nodes(job)  # before the requeue (see the module doc)
    except SlurmagentError as exc2:
        sup.say(f"could not read the nodes job {job} excludes already ({exc2})")
    sup._hand_back(outcome, streak=no_progress_streak(manifest, sup.ident.restart_count),
                   what=f"restore failed on {names} (the job never started)")
    if not outcome.requeued:
        return outcome
    try:
        listed = exclude_with_retries(lambda j, n: slurm.exclude_nodes(j, n, keep), job, nodes)
        sup.say(f"job {job} will not run on {names} again (ExcNodeList={','.join(listed)}): its checkpoint "
                "directory there cannot take the checkpoint")
        outcome.summary += f", without {names}"
    except SlurmagentError as exc2:
        sup.say(f"could not keep job {job} off {names} ({exc2}): it may land there again")
    return outcome


def exclude_with_retries(exclude: Callable[[str, list[str]], list[str]], job: str, nodes: list[str],
                         deadline_s: float = EXCLUDE_DEADLINE_S, sleep: Callable[[float], None] = time.sleep,
                         clock: Callable[[], float] = time.monotonic) -> list[str]:
    """`exclude(job, nodes)`, tried again with backoff until `deadline_s` (an scontrol ended by the
    requeue's SIGTERM, a job still completing)."""
    end, pause = clock() + deadline_s, 0.5
    while True:
        try:
            return exclude(job, nodes)
        except SlurmagentError:
            if clock() + pause > end:
                raise
        sleep(pause)
        pause = min(pause * 2, 4.0)

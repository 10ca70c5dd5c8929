"""A restore that failed on a node's own disk or path: requeue the job without that node.

A node whose checkpoint directory cannot take the checkpoint (a file where the directory must
be, a full or read-only disk) fails every attempt that lands there, while any other node would
do. So the wrapper requeues the job (the same retrying requeue and the same budget as a flush:
an attempt that could not even restore made no progress) and adds the node(s) to the job's
ExcNodeList. Slurm accepts that update only while the job is PENDING, so it comes after the
requeue (Slurm holds a requeued job for at least `cred_expire` seconds before it starts again).
"""

from __future__ import annotations

from typing import Any, Callable

from .checkpoint import Manifest
from .checkpoint_errors import NodeDiskError, is_node_local
from .errors import SlurmagentError
from .host import node_name

__all__ = ["failed_nodes", "no_progress_streak", "requeue_without"]


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


def requeue_without(sup: Any, outcome: Any, exc: BaseException, nodes: list[str],
                    exclude: Callable[[str, list[str]], object]) -> Outcome:
    """Requeue the job (within the budget) and keep it off `nodes`; says why on the job's stderr.
    `sup`: the wrapper's Supervisor (its store, identity, `say` and `_hand_back`), `outcome` its Outcome."""
    why = str(exc) if isinstance(exc, SlurmagentError) else f"{exc.strerror or exc} ({exc.filename})"
    names = ", ".join(nodes)
    sup.say(f"restore failed on {names}, not starting the job: {why}")
    manifest = None
    try:
        manifest = sup.store.latest_manifest(deadline_s=30.0) if sup.store is not None else None
    except SlurmagentError:
        pass
    streak = no_progress_streak(manifest, sup.ident.restart_count)
    sup._hand_back(outcome, streak=streak, what=f"restore failed on {names} (the job never started)")
    if not outcome.requeued:
        return outcome
    job = sup.ident.job_id
    try:
        excluded = exclude(job, nodes)
        listed = ",".join(excluded) if isinstance(excluded, list) else names
        sup.say(f"job {job} will not run on {names} again (ExcNodeList={listed}): its checkpoint directory "
                "there cannot take the checkpoint")
        outcome.summary += f", without {names}"
    except SlurmagentError as exc2:
        sup.say(f"could not keep job {job} off {names} ({exc2}): it may land there again")
    return outcome

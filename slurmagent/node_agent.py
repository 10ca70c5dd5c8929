"""The node agent of a multi-node job: one task per node (`slurmagent node-agent restore|sync`).

It runs in an `srun --overlap` step of the job (see `allocation.py`) and works on this node's
local checkpoint directory only: a restore makes it hold exactly the committed checkpoint
(or this node's part), a sync uploads its blobs without committing. Each task prints one
report line (`allocation.NodeReport`) that the batch step merges into one commit.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, TextIO

from .allocation import UNCOMMITTED_SUFFIX, NodeReport, newest_changes, select_for_node
from .checkpoint import Manifest, RestoreError, state_file_for
from .checkpoint_errors import is_node_local
from .errors import SlurmagentError


class BlobStore(Protocol):
    """What the agent needs from the checkpoint store (slurmagent.gcp.storage.GcsCheckpointStore)."""

    def read_manifest(self, *, deadline_s: float = ...) -> tuple[Manifest | None, int]: ...

    def restore_manifest(self, ckpt_dir, manifest: Manifest, *, deadline_s: float = ..., state_file=...) -> None: ...

    def sync(self, ckpt_dir, attempt: int, state_file, deadline_s: float = ..., *, commit: bool = ...) -> Any: ...


def prepare_dir(ckpt_dir: Path) -> None:
    """`D` on this node: created private (0700) when missing."""
    ckpt_dir.mkdir(mode=0o700, parents=True, exist_ok=True)


def set_aside_uncommitted(ckpt_dir: Path, keep: Iterable[str]) -> list[str]:
    """Move every file of `ckpt_dir` that is not in `keep` to `<ckpt_dir>.uncommitted/` (kept,
    never deleted; a later move replaces an older one), and drop the folders left empty."""
    keep = set(keep)
    aside = Path(str(ckpt_dir).rstrip("/") + UNCOMMITTED_SUFFIX)
    moved: list[str] = []
    for dirpath, dirnames, filenames in os.walk(ckpt_dir, topdown=True):
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]  # moved, never followed
        dirnames[:] = [d for d in dirnames if d not in links]
        for name in (*filenames, *links):
            path = Path(dirpath, name)
            rel = path.relative_to(ckpt_dir).as_posix()
            if rel in keep:
                continue
            dest = aside / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.is_dir() and not dest.is_symlink():
                shutil.rmtree(dest)
            os.replace(path, dest)
            moved.append(rel)
    for dirpath, _dirnames, _files in sorted(os.walk(ckpt_dir), key=lambda w: -len(w[0])):
        if Path(dirpath) != ckpt_dir:
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
    return moved


def agent_restore(store: BlobStore | None, ckpt_dir: Path, *, index: int, node: str, num_nodes: int,
                  generation: int, scope: str, deadline_s: float, state_file: Path | None = None) -> NodeReport:
    """Make this node's `D` hold exactly the committed checkpoint of `generation` (or its part);
    `state_file`, the node's hash cache, learns the restored files."""
    report = NodeReport(index=index, node=node, ok=False)
    try:
        prepare_dir(ckpt_dir)
        if store is None:  # no remote: only the directory
            report.ok = True
            return report
        manifest, found = store.read_manifest(deadline_s=min(60.0, deadline_s))
        if found != generation:
            raise RestoreError(f"the committed checkpoint changed during the restore (generation {found}, "
                               f"the job read {generation}); not resuming from a mix")
        mine = select_for_node(manifest, index, num_nodes, scope) if manifest else Manifest(0)
        moved = set_aside_uncommitted(ckpt_dir, mine.files)
        if moved:
            report.messages.append(f"{len(moved)} file(s) not in the committed checkpoint moved to "
                                   f"{ckpt_dir}{UNCOMMITTED_SUFFIX}/")
        if manifest is not None:
            store.restore_manifest(ckpt_dir, mine, deadline_s=deadline_s, state_file=state_file)
        report.generation = found
        report.ok = True
    except (SlurmagentError, OSError) as exc:
        report.error = str(exc) if isinstance(exc, SlurmagentError) else f"{type(exc).__name__}: {exc}"
        report.node_local = is_node_local(exc)  # this node's disk or path: the job goes elsewhere
    return report


def agent_sync(store: BlobStore, ckpt_dir: Path, *, index: int, node: str, attempt: int, state_file: Path,
               deadline_s: float) -> NodeReport:
    """Upload this node's `D` (blobs only) and report its files and their change times."""
    report = NodeReport(index=index, node=node, ok=False, started_ns=time.time_ns())
    try:
        result = store.sync(ckpt_dir, attempt, state_file, deadline_s=deadline_s, commit=False)
        report.files = result.files
        report.files_sent, report.bytes_sent = result.files_sent, result.bytes_sent
        report.ctimes = newest_changes(ckpt_dir)  # after the upload: a change during it counts
        report.ok = True
    except (SlurmagentError, OSError) as exc:
        report.error = str(exc) if isinstance(exc, SlurmagentError) else f"{type(exc).__name__}: {exc}"
    return report


def node_agent_main(action: str, *, ckpt_dir: str, remote: str, state_file: str | None, attempt: int,
                    generation: int, scope: str, deadline_s: float, env: Mapping[str, str],
                    out: TextIO = sys.stdout, err: TextIO = sys.stderr, transfers: int = 16,
                    parallel_upload_mib: int = 0) -> int:
    """`slurmagent node-agent restore|sync`: one task of the agent step; one report line."""
    index = int(env.get("SLURM_NODEID") or 0)
    node = env.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]
    num_nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    store = None
    if remote:
        from .gcp.storage import GcsCheckpointStore  # start-up speed: google libraries only where used

        # run_id: what this node saw in the bucket is checked once per attempt, not every round
        store = GcsCheckpointStore(remote, max_workers=transfers, parallel_upload_mib=parallel_upload_mib,
                                   run_id=env.get("SLURM_JOB_ID") or "job")
    path = Path(ckpt_dir)
    state = Path(state_file) if state_file else state_file_for(path)
    if action == "restore":
        report = agent_restore(store, path, index=index, node=node, num_nodes=num_nodes, generation=generation,
                               scope=scope, deadline_s=deadline_s, state_file=state)
    elif store is None:
        report = NodeReport(index=index, node=node, ok=True)
    else:
        report = agent_sync(store, path, index=index, node=node, attempt=attempt,
                            state_file=state,
                            deadline_s=deadline_s)
    for message in report.messages:
        print(f"slurmagent node-agent {node}: {message}", file=err, flush=True)
    print(report.to_line(), file=out, flush=True)
    return 0

"""The node agent of a multi-node job: one task per node (`slurmagent node-agent restore|sync`).

It runs in an `srun --overlap` step of the job (see `run/multinode.py`) and works on this node's
local checkpoint directory only: a restore makes it hold exactly the committed checkpoint
(or this node's part), a sync uploads its blobs without committing. Each task sends one
report (`run/agent_reports.NodeReport`) over the framed channel on stdout (`run/agent_channel.py`: short
lines that srun never tears, whatever the report's size); the batch step merges them into
one commit. The launcher runs it with `python -P` in `/`, so a module in the job's directory
(`uuid.py`, `json.py`) never shadows one the agent imports.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, TextIO

from .agent_channel import write_frames
from .agent_reports import NodeReport, select_for_node
from ..checkpoint.manifest import Manifest
from ..checkpoint.errors import RestoreError
from ..checkpoint.hash_cache import state_file_for
from ..checkpoint.cut import round_views, unit_files, unit_marks, unit_signatures
from ..checkpoint.saved import declared_sets, read_declarations
from ..slurm.job_processes import checkpoint_writers
from ..checkpoint.errors import is_node_local
from ..errors import SlurmagentError
from ..slurm import env as slurm_env
from ..state.host import node_name
from ..state.private_dirs import check_private_file, ensure_private_dir, private_ckpt_dir
from ..state.progress import PROGRESS_ENV
from .job import DirRecord

TOKEN_ENV = "SLURMAGENT_PEER_TOKEN"  # the batch step's per-restore token for the peers (never in argv)
from .uncommitted import KEEP_SETS, keep_own_files, moved_message, set_aside_uncommitted  # noqa: F401 - re-exported


class BlobStore(Protocol):
    """What the agent needs from the checkpoint store (slurmagent.checkpoint.gcs.store.GcsCheckpointStore)."""

    def read_manifest(self, *, deadline_s: float = ...) -> tuple[Manifest | None, int]: ...

    def restore_manifest(self, ckpt_dir, manifest: Manifest, *, deadline_s: float = ..., state_file=...,
                         peers: Any = ...) -> None: ...

    def sync(self, ckpt_dir, attempt: int, state_file, deadline_s: float = ..., *, commit: bool = ...) -> Any: ...


def prepare_dir(ckpt_dir: Path, private: Iterable[str] = ()) -> None:
    """`D` on this node: created private (0700) when missing, refused when another user owns
    it or can write it (so are the files beside it: `private_dirs.private_ckpt_dir`); and each
    of `private` (the requeue hold on the batch node's PATH, which srun carries to every node)
    created private here too, so that no other user can plant a program at that path."""
    private_ckpt_dir(ckpt_dir)
    for d in map(Path, private):
        for path in (d.parent, d):  # the per-user parent too: another user's is refused
            ensure_private_dir(path, what="private dir", hint="; remove it or set TMPDIR")


def agent_restore(store: BlobStore | None, ckpt_dir: Path, *, index: int, node: str, num_nodes: int,
                  generation: int, scope: str, deadline_s: float, state_file: Path | None = None,
                  owner: str = "", private: Iterable[str] = (), fresh: bool = False,
                  peers: Any = None, keep_uncommitted: int = KEEP_SETS) -> NodeReport:
    """Make this node's `D` hold exactly the committed checkpoint of `generation` (or its part),
    every other file moved aside (none committed yet: all of them); `state_file`, the node's
    hash cache, learns the restored files. No remote: `D` keeps only files the record beside it
    says `owner` (this job) wrote. `peers` (`checkpoint/gcs/peers.PeerSession`): the job's other
    nodes serve what their caches hold, and this one serves its own until every agent is done."""
    report = NodeReport(index=index, node=node, ok=False)
    started = time.monotonic()
    try:
        _restore_here(store, ckpt_dir, report, index=index, num_nodes=num_nodes, generation=generation, scope=scope,
                      deadline_s=deadline_s, state_file=state_file, owner=owner, private=private, fresh=fresh,
                      peers=peers, keep_uncommitted=keep_uncommitted)
    finally:
        if peers is not None:
            peers.finish(max(deadline_s - (time.monotonic() - started), 1.0))
            report.messages.extend(peers.messages)
            if peers.fetched:
                report.messages.append(f"{peers.fetched} file(s) ({peers.fetched_bytes} bytes) from the job's other "
                                       f"nodes in {peers.seconds:.2f} s, checked against their content ids")
    return report


def _restore_here(store: BlobStore | None, ckpt_dir: Path, report: NodeReport, *, index: int, num_nodes: int,
                  generation: int, scope: str, deadline_s: float, state_file: Path | None, owner: str,
                  private: Iterable[str], fresh: bool, peers: Any, keep_uncommitted: int = KEEP_SETS) -> None:
    try:
        prepare_dir(ckpt_dir, private)
        if store is None:  # no remote: the directory is the only copy
            moved = keep_own_files(ckpt_dir, DirRecord(ckpt_dir, owner, "", fresh), keep_uncommitted)
            if moved:
                report.messages.append(moved_message(ckpt_dir, moved, "another job left"))
            report.ok = True
            return
        handed = peers.manifest(generation) if peers is not None else None  # the batch step's: no bucket read
        manifest, found = handed if handed is not None else store.read_manifest(deadline_s=min(60.0, deadline_s))
        if found != generation:
            raise RestoreError(f"the committed checkpoint changed during the restore (generation {found}, "
                               f"the job read {generation}); not resuming from a mix")
        mine = select_for_node(manifest, index, num_nodes, scope) if manifest else Manifest(0)
        moved = set_aside_uncommitted(ckpt_dir, mine.files, keep_uncommitted)
        if moved:
            report.messages.append(moved_message(ckpt_dir, moved, "not in the committed checkpoint"))
        if manifest is not None:
            extra = {"peers": peers} if peers is not None else {}
            store.restore_manifest(ckpt_dir, mine, deadline_s=deadline_s, state_file=state_file, **extra)
            cache = getattr(store, "last_cache", None)
            if cache is not None and cache.taken:
                report.messages.append(f"{cache.taken} file(s) ({cache.taken_bytes} bytes) from the node-local cache "
                                       f"{cache.root} in {cache.seconds:.2f} s ({cache.hashed} hash-checked, the others "
                                       "unchanged since verified); not downloaded")
        report.generation = found
        report.ok = True
    except (SlurmagentError, OSError) as exc:
        report.error = str(exc) if isinstance(exc, SlurmagentError) else f"{type(exc).__name__}: {exc}"
        report.node_local = is_node_local(exc)  # this node's disk or path: the job goes elsewhere


def agent_sync(store: BlobStore, ckpt_dir: Path, *, index: int, node: str, attempt: int, state_file: Path,
               deadline_s: float, clock_ns: Callable[[], int] = time.time_ns, job_id: str = "") -> NodeReport:
    """Upload this node's `D` (blobs only) and report its files, how its units look after the
    upload (`checkpoint/cut.unit_signatures`) and this node's clock."""
    report = NodeReport(index=index, node=node, ok=False, started_ns=clock_ns())
    try:
        check_private_file(state_file)  # never a hash cache another user wrote
        before = unit_files(ckpt_dir)
        result = store.sync(ckpt_dir, attempt, state_file, deadline_s=deadline_s, commit=False)
        report.files = result.files
        report.files_sent, report.bytes_sent = result.files_sent, result.bytes_sent
        writing, appending = checkpoint_writers(ckpt_dir, job_id)  # the job's processes on this node
        report.writing, report.appending = sorted(writing), sorted(appending)
        after = unit_files(ckpt_dir)
        report.views = round_views(before, after, report.appending, time.time_ns(), unit_marks(ckpt_dir, after))
        report.declared = declared_sets(read_declarations(ckpt_dir), before, after)  # this node's ranks' trainer.saved
        report.units = unit_signatures(ckpt_dir)  # after the upload: a change during it counts
        report.ok = True
    except (SlurmagentError, OSError) as exc:
        report.error = str(exc) if isinstance(exc, SlurmagentError) else f"{type(exc).__name__}: {exc}"
    return report


def ask_root_here(raw: str, node: str, index: int) -> bytes:
    """The agent's part of `hang/remote.RemoteRanks.ask_root_there`: the request, asked of this node's root when
    it names this node (the other agents answer nothing); the answer as the report payload."""
    from ..actions.channel_client import DRAIN_DEADLINE_S, DRAIN_TIMEOUT_S, answer_line, ask_root  # start-up speed

    try:
        request = json.loads(raw)
        if not isinstance(request, dict) or request.get("node") != node:
            return b"{}"
        socket_path = str(request.pop("socket"))
        answer = answer_line(ask_root(socket_path, request, timeout_s=DRAIN_TIMEOUT_S, deadline_s=DRAIN_DEADLINE_S))
    except (OSError, ValueError, KeyError) as exc:
        answer = f"no answer from root on {node} ({exc})"
    return json.dumps({"index": index, "node": node, "answer": answer}).encode()


def node_agent_main(action: str, *, ckpt_dir: str, remote: str, state_file: str | None, attempt: int,
                    generation: int, scope: str, deadline_s: float, env: Mapping[str, str],
                    out: TextIO = sys.stdout, err: TextIO = sys.stderr, transfers: int = 16,
                    parallel_upload_mib: int = 0, owner: str = "", private: Iterable[str] = (),
                    fresh: bool = False, cache_gib: float = -1.0, cache_copies: int = 2, cache_dir: str = "",
                    peers: str = "", keep_uncommitted: int = KEEP_SETS, ask: str = "") -> int:
    """`slurmagent node-agent restore|sync|evidence|samples|drain|writers`: one task of the agent step; one framed report."""
    index = slurm_env.node_index(env)
    node = node_name(None, env)
    progress_dir = env.get(PROGRESS_ENV, "")  # the hang watch's, in the agents' environment (run/main.py)
    if action == "evidence":  # a hang: this node's ranks, stacks and GPU state (hang/remote.py)
        from ..hang.remote import BATCH_NODE_ENV, node_evidence  # start-up speed: only on a hang

        # the batch node's wrapper reads its own at the same time (two py-spy on one rank: one is refused)
        write_frames(out, index, b"{}" if node == env.get(BATCH_NODE_ENV) else node_evidence(progress_dir, node, index))
        return 0
    if action == "samples":  # a silence: one stack sample of this node's ranks (hang/samples.py)
        from ..hang.remote import BATCH_NODE_ENV, node_stacks  # start-up speed: only in a silence

        write_frames(out, index, b"{}" if node == env.get(BATCH_NODE_ENV) else node_stacks(progress_dir, node, index))
        return 0
    if action == "drain":  # a hang on this node: its root asked here, where it sees the ranks (hang/remote.py)
        write_frames(out, index, ask_root_here(ask, node, index))
        return 0
    if action == "writers":  # the trainer is about to be killed: what this node's ranks hold open is torn
        report = NodeReport(index=index, node=node, ok=True)
        try:
            writing, appending = checkpoint_writers(Path(ckpt_dir), slurm_env.job_id(env) or "")
            report.writing, report.appending = sorted(writing), sorted(appending)
        except OSError as exc:
            report.ok, report.error = False, f"{type(exc).__name__}: {exc}"
        write_frames(out, index, report.payload())
        return 0
    num_nodes = slurm_env.num_nodes(env)
    store = None
    if remote:
        from ..checkpoint.gcs.store import GcsCheckpointStore  # start-up speed: google libraries only where used

        # run_id: what this node saw in the bucket is checked once per attempt, not every round
        store = GcsCheckpointStore(remote, max_workers=transfers, parallel_upload_mib=parallel_upload_mib,
                                   run_id=slurm_env.job_id(env) or "job", local_cache_gib=cache_gib,
                                   local_cache_dir=cache_dir, local_cache_copies=cache_copies)
    path = Path(ckpt_dir)
    state = Path(state_file) if state_file else state_file_for(path)
    if action == "restore":
        session = None
        if peers and store is not None and env.get(TOKEN_ENV):
            from ..checkpoint.gcs.peers import PeerSession  # start-up speed: a multi-node restore's only

            session = PeerSession(peers, env[TOKEN_ENV], index, node)
        report = agent_restore(store, path, index=index, node=node, num_nodes=num_nodes, generation=generation,
                               scope=scope, deadline_s=deadline_s, state_file=state, owner=owner, private=private,
                               fresh=fresh, peers=session, keep_uncommitted=keep_uncommitted)
    elif store is None:
        report = NodeReport(index=index, node=node, ok=True)
    else:
        report = agent_sync(store, path, index=index, node=node, attempt=attempt,
                            state_file=state,
                            deadline_s=deadline_s, job_id=slurm_env.job_id(env) or "")
    if action == "sync" and progress_dir:  # the hang watch's view of this node's ranks
        from ..hang.remote import node_phases, node_ranks  # start-up speed: only for a job with a hang watch

        report.ranks, report.phases = node_ranks(progress_dir, node), node_phases(progress_dir, node)
    for message in report.messages:
        print(f"slurmagent node-agent {node}: {message}", file=err, flush=True)
    write_frames(out, index, report.payload())
    return 0

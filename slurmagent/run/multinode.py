"""Multi-node jobs: one checkpoint for a whole allocation whose nodes write to local disks.

The wrapper is the batch step around `srun` (`exec slurmagent run --ckpt-dir D -- srun ...`)
and `D` is a node-local path, the same on every node. The batch host cannot see the other
nodes' disks, so a small agent of ours (`node_agent.py`) runs on every node, one task per
node, in an `srun --overlap` step of the job itself (Slurm tracks and ends it like any step):

Each agent's report comes back whole over a framed channel on the step's stdout
(`run/agent_channel.py`); the step sets its own srun options, runs the agents isolated from the
job's directory and can be cancelled (`agent_step`): the flush cancels the round in flight
(`AllocationStore.cancel_rounds`) so a hung agent never holds the final sync, and a node
without a report is named.

* **restore** (before the command starts): every agent creates `D`, reads the committed
  manifest, checks it is the generation the wrapper read, and makes `D` hold exactly that
  checkpoint: by default all of it (the union of every node's files: DCP's rank 1 reads rank
  0's shards and `.metadata`), with `--restore-scope node` only the files that node index
  held when it was committed. Files in `D` that are not in the checkpoint are moved to
  `D.uncommitted/` (a newer local file on one node is not a checkpoint). The job resumes only
  when every agent reports the same generation in place (all or nothing).
* **sync** (periodic, and final after the command ended): every agent hashes and uploads its
  own `D` (content-addressed blobs, no manifest) and reports its files. The wrapper merges the
  reports and commits ONE job-level manifest, fenced like a single-node one, only when every
  node's upload succeeded: a node that failed leaves the last complete checkpoint in place.

Merging. A name present on several nodes with different content: the copy changed since the
restore wins, else the lowest node index, with a warning. A node *wrote* a file when its copy
differs from the restored one or it wrote it before (the restored manifest's `writers`); a
node that holds only the restored, unchanged copy did not. A file no node of this job wrote
any more while one of its writers is in the job was deleted by that writer (rank 0 rotating
old checkpoints) and leaves the checkpoint, whatever other nodes still hold from the restore;
a step folder one of its writer nodes removed whole leaves whole, with the files other nodes
wrote into it (`checkpoint/cut.Rotations`: HF's `rng_state_1.pth`).

While the command still runs, a commit is a consistent cut (`checkpoint/cut.py`): units (step
folders, the files of one folder) are taken only when quiet for a whole round on every node,
which compares each node's disk with itself only, so node clocks never decide it. Each report
carries its agent's clock, which the batch step compares with its own (a warning above
CLOCK_SKEW_WARN_S). After the command ended, the final sync takes every node's files as they are.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence, TextIO
from ..core import hostlist
from ..slurm import env as slurm_env
from .agent_channel import read_frames
from .agent_step import Rounds, agent_env, run_step
from ..checkpoint.errors import CheckpointError, RestoreError
from ..checkpoint.manifest import Manifest, no_progress_after
from ..checkpoint.cut import SETTLE_S, QuietCut, Rotations, unit_of
from ..checkpoint.errors import NodeDiskError
from .cut_store import check_held_back_objects
from ..errors import SlurmagentError
from .agent_reports import Merged, NodeReport, content_key, merge_reports, writers_before
from .node_agent import TOKEN_ENV

AGENT_STEP_NAME = "slurmagent-node-agent"
WRITERS_DEADLINE_S = 10.0  # the kill-time record of open files: one short agent round before the kill

SCOPES = ("all", "node")
CLOCK_SKEW_WARN_S = 2.0  # an agent's clock further than this from the batch step's is said


class AllocationError(SlurmagentError):
    """A multi-node job cannot be covered safely (wrapper inside srun, %n in a shared path)."""

    exit_code = 2


# --------------------------------------------------------------------------- who we are


@dataclass(frozen=True)
class Allocation:
    """The nodes of this job, as the batch step sees them."""

    job_id: str
    num_nodes: int
    nodes: tuple[str, ...] = field(default=(), compare=False)  # by node index, to name a silent node

    def node(self, index: int) -> str:
        return self.nodes[index] if 0 <= index < len(self.nodes) else ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Allocation | None:
        """The allocation when this is a multi-node job's batch step, else None.

        A wrapper started by srun as one of several tasks (one wrapper per rank) cannot own a
        job-level checkpoint: refused with the layout that works."""
        job_id, step = slurm_env.job_id(env), slurm_env.step_id(env)
        if job_id is None:
            return None
        try:
            nodes = slurm_env.num_nodes(env)
            step_tasks = slurm_env.step_num_tasks(env)
        except ValueError:
            return None
        if step not in (None, "", "batch") and step_tasks > 1:
            raise AllocationError(
                f"slurmagent run is one of {step_tasks} tasks of step {job_id}.{step}: "
                "run it once, as the batch step around srun (exec slurmagent run --ckpt-dir DIR -- srun CMD)")
        if nodes <= 1:
            return None
        try:
            names = tuple(hostlist.expand(slurm_env.node_list(env)))
        except ValueError:
            names = ()
        return cls(job_id, nodes, names if len(names) == nodes else ())


# --------------------------------------------------------------------------- launching agents


class AgentLauncher(Protocol):
    def run(self, args: list[str], deadline_s: float, cancel: threading.Event | None = None) -> list[NodeReport]: ...


SILENT = ("no report from ", "no whole report from ")  # how a launcher names a node it has no report of


class SrunLauncher:
    """Runs `slurmagent node-agent ARGS` once per node of the job: `srun --overlap`, one task
    per node, inside the allocation (so Slurm tracks, signals and ends it), with a deadline and
    a cancel (`agent_step`). Each agent's report comes back whole over the framed channel
    (`run/agent_channel.py`); a node without one is named."""

    def __init__(self, alloc: Allocation, env: Mapping[str, str], *, srun: str = "srun",
                 python: str = sys.executable, err: TextIO = sys.stderr, workdir: str = "/"):
        self.alloc = alloc
        self.env = agent_env(env)
        self.srun = srun
        self.python = python
        self.err = err
        self.workdir = workdir  # not the job's cwd: its `uuid.py` must not shadow the agent's imports

    def argv(self, args: list[str]) -> list[str]:
        n = self.alloc.num_nodes
        return [self.srun, "--overlap", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", "--cpus-per-task=1",
                "--gres=none", "--mpi=none", "--kill-on-bad-exit=1", f"--job-name={AGENT_STEP_NAME}",
                "--export=ALL", "--input=none", f"--chdir={self.workdir}",
                self.python, "-P", "-m", "slurmagent.entry", "node-agent", *args]  # -P: no cwd on sys.path

    def _silent(self, index: int, why: str, prefix: str = SILENT[0]) -> NodeReport:
        r = NodeReport(index=index, node=self.alloc.node(index), ok=False)
        r.error = f"{prefix}{r.who}{why}"
        return r

    def payloads(self, args: list[str], deadline_s: float) -> dict[int, bytes]:
        """A one-off round's whole raw reports by node index (the hang's evidence); none when srun fails."""
        try:
            step = run_step(self.argv(args), self.env, deadline_s)
        except OSError:
            return {}
        return read_frames(step.stdout.splitlines()).reports

    def run(self, args: list[str], deadline_s: float, cancel: threading.Event | None = None) -> list[NodeReport]:
        n = self.alloc.num_nodes
        if cancel is not None and cancel.is_set():
            return [self._silent(i, ": cancelled before the agents started") for i in range(n)]
        try:
            step = run_step(self.argv(args), self.env, deadline_s, cancel)
        except OSError as exc:
            return [NodeReport(index=i, node=self.alloc.node(i), ok=False,
                               error=f"cannot run {self.srun}: {exc.strerror or exc}") for i in range(n)]
        for line in step.stderr.splitlines():
            if line.strip():
                print(line, file=self.err, flush=True)
        got = read_frames(step.stdout.splitlines())
        if step.ended == "deadline":
            why = f" within {deadline_s:g} s"
        elif step.ended == "cancelled":
            why = f": cancelled after {step.seconds:.0f} s"
        else:
            why = f" (srun exited {step.returncode}: {(step.stderr.strip().splitlines() or ['no output'])[-1]})"
        out = []
        for i in range(n):
            report = NodeReport.from_payload(got.reports[i]) if i in got.reports else None
            if report is not None and report.index == i:
                out.append(report)
            elif i in got.damaged or report is not None:
                out.append(self._silent(i, f": {got.damaged.get(i) or 'a report of another node index'}{why}",
                                        SILENT[1]))
            else:
                out.append(self._silent(i, why))
        return out


# --------------------------------------------------------------------------- the job-level store


@dataclass(frozen=True)
class AllocationSyncResult:
    files_sent: int
    bytes_sent: int
    manifest_generation: int | None
    files_total: int
    nodes: int
    manifest: Manifest | None = None  # the job-level manifest committed by this sync (None: none)
    held_back: tuple[str, ...] = ()  # units whose new content this commit left out (checkpoint/cut.unit_of)
    pending_since: float | None = None  # batch clock: the oldest change on any node that no commit holds yet


class Committer(Protocol):
    """The bucket side the batch step needs (slurmagent.checkpoint.gcs.store.GcsCheckpointStore)."""

    url: str

    def read_manifest(self, *, deadline_s: float = ...) -> tuple[Manifest | None, int]: ...

    def commit(self, manifest: Manifest, *, deadline_s: float = ...) -> int: ...


class AllocationStore:
    """The wrapper's CheckpointStore for a multi-node job: restore and sync run on every node
    through the agents; the batch step alone reads and commits the job-level manifest."""

    def __init__(self, alloc: Allocation, committer: Committer | None, launcher: AgentLauncher, *,
                 scope: str = "all", err: TextIO = sys.stderr, agent_options: Sequence[str] = (),
                 restore_options: Sequence[str] = (), settle_s: float = SETTLE_S):
        if scope not in SCOPES:
            raise AllocationError(f"--restore-scope must be one of {', '.join(SCOPES)}, not {scope!r}")
        self.alloc = alloc
        self.committer = committer
        self.launcher = launcher
        self.scope = scope
        self.err = err
        self.agent_options = list(agent_options)  # the store's tunables, for every agent
        self.restore_options = list(restore_options)  # who the job is, dirs to make private on every node
        self.trainer_running: Callable[[], bool] = lambda: False  # set by `run/main.py`
        self.baseline: Manifest | None = None  # what was restored
        self.last_committed: Manifest | None = None
        self.cut = QuietCut(settle_s=settle_s)
        self.rotations = Rotations()  # step folders a writer node removed whole (rank-0 rotation)
        self.clock_ns: Callable[[], int] = time.time_ns  # the batch step's wall clock
        self.pending: dict[str, float] = {}  # relpath -> when a round first saw it differ from the commit
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self.rounds = Rounds()  # cancel_rounds ends the agent step in flight
        self.on_reports: Callable[[list[NodeReport]], None] | None = None
        self.torn: set[str] = set()  # files the job's ranks held open for writing when it was killed

    def record_torn(self, ckpt_dir: str | os.PathLike, deadline_s: float = WRITERS_DEADLINE_S) -> None:
        """Just before the trainer is killed: every node's files open for writing now are torn,
        whatever they look like afterwards; the final sync leaves their units at the last commit.
        A node that does not answer in time is said: its files count by the final sync's evidence."""
        reports = self.launcher.run(["writers", "--ckpt-dir", os.path.abspath(ckpt_dir)], deadline_s)
        self.torn = {rel for r in reports if r.ok for rel in r.writing}
        failed = self._failures(reports, "the kill-time record of open files")
        if failed:
            self.say(f"{failed}; that node's files are judged by the final sync's evidence alone")

    def say(self, message: str) -> None:
        print(f"slurmagent run: {message}", file=self.err, flush=True)

    def _failures(self, reports: list[NodeReport], what: str) -> str:
        """"upload failed on n1 (node index 0): ..." per failed agent; a silent node as its launcher named it."""
        return "; ".join(r.error if r.error.startswith(tuple(p + r.who for p in SILENT))
                         else f"{what} failed on {r.who}: {r.error}" for r in reports if not r.ok)

    def cancel_rounds(self) -> None:
        """The flush begins: end the agent step in flight, and any round asked for before now,
        so a hung agent cannot hold the final sync (which comes after, with its own budget)."""
        self.rounds.cancel()

    def _round(self, ticket: int, args: list[str], deadline_s: float) -> list[NodeReport]:
        with self.rounds.running(ticket) as cancel:
            reports = self.launcher.run(args + self.agent_options, deadline_s, cancel)
        if cancel.is_set():
            silent = "; ".join(r.error for r in reports if not r.ok) or "every node had reported"
            self.say(f"the flush cancelled the node agents' round in flight: {silent}")
        return reports

    @property
    def url(self) -> str:
        return self.committer.url if self.committer is not None else ""

    # The checkpoint identity (slurmagent.run.identity) is decided once, here in the batch step,
    # on the committer: the agents never commit, so they need not know the owner.
    @property
    def owner(self) -> str | None:
        return getattr(self.committer, "owner", None)

    @owner.setter
    def owner(self, value: str | None) -> None:
        if self.committer is not None:
            self.committer.owner = value

    def read_manifest(self, *, deadline_s: float = 60.0) -> tuple[Manifest | None, int]:
        return self.committer.read_manifest(deadline_s=deadline_s) if self.committer is not None else (None, 0)

    def claim(self, manifest: Manifest, over: Manifest | None, generation: int, *, deadline_s: float = 60.0) -> int:
        return self.committer.claim(manifest, over, generation, deadline_s=deadline_s)

    def latest_manifest(self, *, deadline_s: float = 60.0) -> Manifest | None:
        """The committed job-level manifest (a multi-node restore always takes it)."""
        return self.committer.read_manifest(deadline_s=deadline_s)[0] if self.committer is not None else None

    def restore(self, ckpt_dir, *, deadline_s: float = 1800.0, state_file=None) -> Manifest | None:
        ticket = self.rounds.ticket()  # before the lock: a round waiting for it is cancelled too
        manifest, generation = (None, 0)
        if self.committer is not None:
            manifest, generation = self.committer.read_manifest(deadline_s=min(60.0, deadline_s))
        args = ["restore", "--ckpt-dir", os.path.abspath(ckpt_dir),
                "--remote", self.committer.url if self.committer else "",
                "--generation", str(generation), "--scope", self.scope, "--deadline", f"{max(deadline_s - 5.0, 1.0):g}"]
        if state_file is not None:
            args += ["--state-file", os.path.abspath(state_file)]
        coordinator = self._peers(manifest, generation, deadline_s)
        try:
            if coordinator is not None:
                args += ["--peers", coordinator.address]
            reports = self._round(ticket, args + self.restore_options, deadline_s)
        finally:
            if coordinator is not None:
                coordinator.close()
                self.peer_env.pop(TOKEN_ENV, None)
        failed = self._failures(reports, "restore")
        if failed:
            local = [r.node for r in reports if not r.ok and r.node_local and r.node]
            if local:  # the job is requeued without these nodes
                raise NodeDiskError(failed, nodes=local)
            raise RestoreError(failed)
        self.baseline = self.last_committed = manifest
        if manifest is not None:
            self.say(f"every node of the job ({self.alloc.num_nodes}) holds the checkpoint of attempt "
                     f"{manifest.attempt} ({'all' if self.scope == 'all' else 'its own'} files)")
        return manifest

    def _peers(self, manifest: Manifest | None, generation: int, deadline_s: float):
        """The meeting point of this restore's peers (`checkpoint/gcs/peers.Coordinator`), its token
        put in the agents' environment; it hands them the manifest read here (of `generation`).
        None when there is nothing to restore, no node caches (`--cache-gib` below 0) or this host
        has no address the others can reach."""
        if manifest is None or not self.peers_on:
            return None
        from ..checkpoint.gcs.peers import Coordinator, new_token, peer_host  # start-up speed: restore only

        host = peer_host(os.environ)
        if not host:
            return None
        token = new_token()
        sizes = {content_key(e): e["size"] for e in manifest.regular_files().values()}
        try:
            coordinator = Coordinator(self.alloc.num_nodes, token, sizes, host,
                                      barrier_s=min(60.0, max(deadline_s / 4, 5.0)),
                                      manifest=manifest.to_json().encode(), generation=generation)
        except OSError as exc:
            self.say(f"no peers for this restore (cannot listen on {host}: {exc.strerror or exc}); the bucket serves")
            return None
        self.peer_env[TOKEN_ENV] = token
        return coordinator

    @property
    def peers_on(self) -> bool:
        opts = self.agent_options
        gib = opts[opts.index("--cache-gib") + 1] if "--cache-gib" in opts[:-1] else "-1"
        return float(gib) >= 0 and isinstance(getattr(self.launcher, "env", None), dict)

    @property
    def peer_env(self) -> dict:
        """The agents' environment (the launcher's), where the peers' token travels."""
        env = getattr(self.launcher, "env", None)
        return env if isinstance(env, dict) else {}

    def _check_held_back(self, files: dict[str, dict], reports: list[NodeReport], deadline_s: float) -> None:
        if self.committer is not None:
            check_held_back_objects(self.committer, files, (e for r in reports for e in r.files.values()),
                                    deadline_s)

    def sync(self, ckpt_dir, attempt: int, state_file, deadline_s: float = 600.0,
             restored: Manifest | None = None) -> AllocationSyncResult:
        ticket = self.rounds.ticket()  # before the lock: a round waiting for it is cancelled too
        with self._lock:
            running = self.trainer_running()
            args = ["sync", "--ckpt-dir", os.path.abspath(ckpt_dir),
                    "--remote", self.committer.url if self.committer else "",
                    "--state-file", os.path.abspath(state_file), "--attempt", str(attempt),
                    "--deadline", f"{max(deadline_s - 5.0, 1.0):g}"]
            sent_ns = self.clock_ns()
            reports = self._round(ticket, args, deadline_s)
            received_ns = self.clock_ns()
            if self.on_reports is not None:
                self.on_reports(reports)  # the hang watch's view of the other nodes' ranks (hang/remote.py)
            failed = self._failures(reports, "upload")
            if failed:
                raise CheckpointError(f"{failed}; the last complete checkpoint stays")
            self._check_clocks(reports, sent_ns, received_ns)
            merged = merge_reports(reports, baseline=self.baseline)
            previous = self.last_committed
            merged = self._without_rotated(merged, reports, previous)
            for rel, why in merged.conflicts.items():  # once per file and job, not every round
                if rel not in self._warned:
                    self._warned.add(rel)
                    self.say(f"WARNING: {why}")
            # While the trainer runs: only units quiet for a whole round on every node (checkpoint/cut).
            cut = self.cut.take(merged.files, merged.writers, {r.index: r.units for r in reports},
                                previous_files=previous.files if previous else None,
                                previous_writers=previous.writers if previous else None, running=running,
                                node_names={r.index: r.who for r in reports},
                                writing={rel for r in reports for rel in r.writing} if running else set(self.torn),
                                views={r.index: r.views for r in reports} if running else None,
                                appending={rel for r in reports for rel in r.appending},
                                declared=[d for r in reports for d in r.declared] if running else ())
            for message in cut.messages:
                self.say(message)
            sent = sum(r.files_sent for r in reports), sum(r.bytes_sent for r in reports)
            extra = dict(held_back=tuple(cut.held_back))
            if self.committer is None or not cut.files:
                return AllocationSyncResult(*sent, None, len(cut.files), len(reports),
                                            pending_since=self._pending_since(merged.files, previous, sent_ns), **extra)
            self._check_held_back(cut.files, reports, deadline_s)
            manifest = Manifest(attempt=attempt, files=cut.files, node_count=self.alloc.num_nodes,
                                writers=cut.writers,
                                no_progress=no_progress_after(restored or self.baseline, cut.files))
            generation = self.committer.commit(manifest, deadline_s=max(deadline_s / 4, 10.0))
            self.last_committed = manifest
            return AllocationSyncResult(*sent, generation, len(cut.files), len(reports), manifest,
                                        pending_since=self._pending_since(merged.files, manifest, sent_ns), **extra)

    def _without_rotated(self, merged: Merged, reports: list[NodeReport], previous: Manifest | None) -> Merged:
        """`merged` less the step folders a writer node removed whole (checkpoint/cut.Rotations)."""
        committed = {rel: writers_before(previous, rel) for rel in previous.files} if previous else {}
        gone = self.rotations.drop({r.index: r.files for r in reports}, merged.writers, committed)
        if not gone:
            return merged
        keep = {rel for rel in merged.files if unit_of(rel) not in gone}
        return Merged({rel: e for rel, e in merged.files.items() if rel in keep},
                      {rel: w for rel, w in merged.writers.items() if rel in keep},
                      {rel: why for rel, why in merged.conflicts.items() if rel in keep},
                      sorted(set(merged.dropped) | (set(merged.files) - keep)))

    def _check_clocks(self, reports: list[NodeReport], sent_ns: int, received_ns: int) -> None:
        """Each agent's clock against the batch step's: its reading must fall between our send
        and receive times. The cut does not depend on it; Slurm's credentials and every log do."""
        bound = int(CLOCK_SKEW_WARN_S * 1e9)
        for r in reports:
            if not r.started_ns:
                continue
            ahead, behind = r.started_ns - received_ns, sent_ns - r.started_ns
            if max(ahead, behind) <= bound or f"clock:{r.index}" in self._warned:
                continue
            self._warned.add(f"clock:{r.index}")
            how = f"{ahead / 1e9:.1f} s ahead of" if ahead > 0 else f"{behind / 1e9:.1f} s behind"
            self.say(f"WARNING: the clock of {r.who} is {how} the batch step's (more than {CLOCK_SKEW_WARN_S:g} s): "
                     "periodic commits do not depend on it, but Slurm's credentials and log times do; run NTP "
                     "(chrony) on every node")

    def _pending_since(self, now_files: dict[str, dict], committed: Manifest | None, round_ns: int) -> float | None:
        """The oldest change on any node that the commit does not hold, on the batch step's clock
        (when a round first saw it: at most one interval late), for the lag gauge."""
        held = committed.files if committed is not None else {}
        differ = {rel for rel in now_files.keys() | held.keys()
                  if rel not in now_files or rel not in held or content_key(now_files[rel]) != content_key(held[rel])}
        self.pending = {rel: self.pending.get(rel, round_ns / 1e9) for rel in differ}
        return min(self.pending.values()) if self.pending else None


def allocation_store(env: Mapping[str, str], committer: Committer | None, *, ckpt_dir_option: str | None,
                     scope: str = "all", err: TextIO = sys.stderr,
                     agent_options: Sequence[str] = (), restore_options: Sequence[str] = (),
                     settle_s: float = SETTLE_S) -> AllocationStore | None:
    """The multi-node store when this wrapper is a multi-node job's batch step, else None."""
    alloc = Allocation.from_env(env)
    if alloc is None:
        return None
    if ckpt_dir_option and "%n" in ckpt_dir_option:
        raise AllocationError(
            f"--ckpt-dir {ckpt_dir_option}: %n would name the batch host on every node (all ranks get the same "
            "SLURMAGENT_CKPT_DIR); give a node-local path that is the same on every node")
    return AllocationStore(alloc, committer, SrunLauncher(alloc, env, err=err), scope=scope, err=err,
                           agent_options=agent_options, restore_options=restore_options, settle_s=settle_s)

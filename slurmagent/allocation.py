"""Multi-node jobs: one checkpoint for a whole allocation whose nodes write to local disks.

The wrapper is the batch step around `srun` (`exec slurmagent run --ckpt-dir D -- srun ...`)
and `D` is a node-local path, the same on every node. The batch host cannot see the other
nodes' disks, so a small agent of ours (`node_agent.py`) runs on every node, one task per
node, in an `srun --overlap` step of the job itself (Slurm tracks and ends it like any step):

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
restore wins, else the lowest node index, with a warning. While the command still runs, a
commit is a consistent cut at the instant T the first agent began (every node looked at its
`D` after T). Its units are the top-level folders (step folders) and the top-level files taken
together; a unit is taken as it is when no node changed anything in it after T (inode change
times, which a write, a rename and a removal all move), and, for a folder that only some nodes
hold (rank 0's `torch.save`), when it was the same in the previous round too; any other unit
stays as it was in the previous commit. So rank 0's new `.metadata` never lands beside rank 1's
older shard. Node clocks must agree (NTP), as Slurm's own credentials require. After the
command ended, the final sync takes every node's files as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence, TextIO

from .checkpoint import CheckpointError, Manifest, RestoreError, entry_content_id, no_progress_after
from .checkpoint_errors import NodeDiskError
from .errors import SlurmagentError

REPORT_TAG = "slurmagent-node-report "
AGENT_STEP_NAME = "slurmagent-node-agent"
SCOPES = ("all", "node")
UNCOMMITTED_SUFFIX = ".uncommitted"

# Step-request variables of the batch environment that would shape our one-task-per-node
# step like the trainer's (8 tasks, GPUs, memory per CPU...); the agent step sets its own.
_STEP_REQUEST_VARS = (
    "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS_PER_SOCKET", "SLURM_NTASKS_PER_CORE",
    "SLURM_NTASKS_PER_GPU", "SLURM_CPUS_PER_TASK", "SLURM_CPUS_PER_GPU", "SLURM_MEM_PER_CPU", "SLURM_MEM_PER_NODE",
    "SLURM_MEM_PER_GPU", "SLURM_GPUS", "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK", "SLURM_GPUS_PER_SOCKET",
    "SLURM_TRES_PER_TASK", "SLURM_DISTRIBUTION", "SLURM_CPU_BIND", "SLURM_HINT", "SLURM_EXACT", "SLURM_OVERLAP",
    "SLURM_STEP_GRES", "SLURM_NETWORK",
)


class AllocationError(SlurmagentError):
    """A multi-node job cannot be covered safely (wrapper inside srun, %n in a shared path)."""

    exit_code = 2


# --------------------------------------------------------------------------- who we are


@dataclass(frozen=True)
class Allocation:
    """The nodes of this job, as the batch step sees them."""

    job_id: str
    num_nodes: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Allocation | None:
        """The allocation when this is a multi-node job's batch step, else None.

        A wrapper started by srun as one of several tasks (one wrapper per rank) cannot own a
        job-level checkpoint: refused with the layout that works."""
        if not env.get("SLURM_JOB_ID"):
            return None
        try:
            nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
            step_tasks = int(env.get("SLURM_STEP_NUM_TASKS") or 1)
        except ValueError:
            return None
        if env.get("SLURM_STEP_ID") not in (None, "", "batch") and step_tasks > 1:
            raise AllocationError(
                f"slurmagent run is one of {step_tasks} tasks of step {env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}: "
                "run it once, as the batch step around srun (exec slurmagent run --ckpt-dir DIR -- srun CMD)")
        if nodes <= 1:
            return None
        return cls(env["SLURM_JOB_ID"], nodes)


# --------------------------------------------------------------------------- node reports


@dataclass
class NodeReport:
    """What one node's agent says it did (one JSON line on the agent step's stdout)."""

    index: int
    node: str
    ok: bool
    error: str = ""
    generation: int = 0  # restore: the manifest generation now in place
    files: dict[str, dict] = field(default_factory=dict)  # sync: relpath -> manifest entry
    ctimes: dict[str, int] = field(default_factory=dict)  # sync: unit -> newest change (ns)
    started_ns: int = 0  # sync: when this agent began to look at D (wall clock)
    files_sent: int = 0
    bytes_sent: int = 0
    messages: list[str] = field(default_factory=list)
    node_local: bool = False  # restore: failed because of this node's disk or path (another node would do)

    def to_line(self) -> str:
        return REPORT_TAG + json.dumps(self.__dict__, separators=(",", ":"))

    @classmethod
    def from_line(cls, line: str) -> NodeReport | None:
        if not line.startswith(REPORT_TAG):
            return None
        try:
            raw = json.loads(line[len(REPORT_TAG):])
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})
        except (ValueError, TypeError, KeyError):
            return None

    @property
    def who(self) -> str:
        return f"{self.node or '?'} (node index {self.index})"


def unit_of(relpath: str) -> str:
    """The unit of a consistent cut a file belongs to: its top-level folder, or "" for the
    files at the top level (taken together: an index and the shards beside it)."""
    return relpath.split("/", 1)[0] if "/" in relpath else ""


def newest_changes(ckpt_dir: Path) -> dict[str, int]:
    """Unit -> newest inode change time in it (a rename, a rewrite, a name being written, a
    removal: each bumps one). "" is the top level: its files and `D` itself, whose change
    time moves when a top-level entry is added, renamed or removed."""
    try:
        out = {"": os.stat(ckpt_dir).st_ctime_ns}
        entries = list(os.scandir(ckpt_dir))
    except FileNotFoundError:
        return {"": 0}  # no directory: nothing in it changed
    for entry in entries:
        try:
            newest = entry.stat(follow_symlinks=False).st_ctime_ns
        except FileNotFoundError:
            continue
        if not entry.is_dir(follow_symlinks=False):
            out[""] = max(out[""], newest)
            continue
        for dirpath, dirnames, filenames in os.walk(entry.path):
            for name in (*dirnames, *filenames):
                try:
                    newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_ctime_ns)
                except FileNotFoundError:
                    continue
        out[entry.name] = newest
    return out


# --------------------------------------------------------------------------- merging (pure)


@dataclass
class Merged:
    files: dict[str, dict]
    writers: dict[str, list[int]]
    conflicts: dict[str, str] = field(default_factory=dict)  # relpath -> what was kept and why
    held_back: list[str] = field(default_factory=list)  # units kept as previously committed ("": top-level files)


def merge_reports(
    reports: Sequence[NodeReport],
    *,
    baseline: Manifest | None,
    previous: Manifest | None = None,
    cut_ns: int | None = None,
    partial_seen: dict[str, tuple[frozenset[int], str]] | None = None,
) -> Merged:
    """One checkpoint from every node's files.

    `baseline`: the checkpoint restored at start (decides which copy "changed since the
    restore"). `cut_ns`: None when no trainer runs any more (take everything); else the
    instant T of a consistent cut (module doc), with `previous` the last commit and
    `partial_seen` the folders seen on only some nodes last round (updated in place)."""
    copies: dict[str, list[tuple[int, dict]]] = {}
    for r in sorted(reports, key=lambda r: r.index):
        for rel, entry in r.files.items():
            copies.setdefault(rel, []).append((r.index, entry))
    files: dict[str, dict] = {}
    writers: dict[str, list[int]] = {}
    conflicts: dict[str, str] = {}
    for rel, cands in copies.items():
        writers[rel] = [i for i, _ in cands]
        if len({_same(e) for _, e in cands}) == 1:
            files[rel] = cands[0][1]
            continue
        was = _same(baseline.files[rel]) if baseline and rel in baseline.files else None
        changed = [(i, e) for i, e in cands if _same(e) != was]
        index, entry = min(changed or cands, key=lambda c: c[0])
        files[rel] = entry
        if len(changed) == 1:
            # the normal case after a restore of every file to every node: one rank rewrote
            # its file, the other nodes still hold the restored copy; nothing to warn about
            continue
        conflicts[rel] = (f"{rel} differs on node indexes {[i for i, _ in cands]}: kept node {index}'s copy "
                          "(the lowest node index)")
    if cut_ns is None:
        return Merged(files, writers, conflicts)

    # Units of the cut: each top-level folder, and all top-level files together ("").
    units = {unit_of(rel) for rel in files}
    taken: set[str] = set()
    seen_now: dict[str, tuple[frozenset[int], str]] = {}
    for unit in units:
        holders = [r for r in reports if unit == "" or unit in r.ctimes or any(unit_of(f) == unit for f in r.files)]
        settled = all(r.ctimes.get(unit, cut_ns + 1) <= cut_ns for r in holders)
        if settled and unit and len(holders) < len(reports):  # a folder that some nodes do not hold
            key = (frozenset(r.index for r in holders), _digest({k: e for k, e in files.items() if unit_of(k) == unit}))
            seen_now[unit] = key
            settled = partial_seen is not None and partial_seen.get(unit) == key
        if settled:
            taken.add(unit)
    if partial_seen is not None:
        partial_seen.clear()
        partial_seen.update(seen_now)
    cut_files = {rel: e for rel, e in files.items() if unit_of(rel) in taken}
    cut_writers = {rel: w for rel, w in writers.items() if unit_of(rel) in taken}
    held = units - taken
    # A unit gone from every node was removed before T (dropped), unless the top level of
    # some node changed after T (it may have existed at T: kept as previously committed).
    top_changed = any(r.ctimes.get("", cut_ns + 1) > cut_ns for r in reports)
    if previous is not None:
        for rel, e in previous.files.items():
            unit = unit_of(rel)
            if unit in taken or (unit not in units and not top_changed):
                continue
            cut_files[rel] = e
            if rel in previous.writers:
                cut_writers[rel] = previous.writers[rel]
            held.add(unit)
    return Merged(cut_files, cut_writers, conflicts, sorted(held))


def _same(entry: dict) -> str:
    """What makes two manifest entries the same file: its content (or link target), wherever stored."""
    return entry_content_id(entry)


def _digest(files: Mapping[str, dict]) -> str:
    return hashlib.sha256(json.dumps(sorted((k, _same(v)) for k, v in files.items())).encode()).hexdigest()


def select_for_node(manifest: Manifest, index: int, num_nodes: int, scope: str) -> Manifest:
    """The part of `manifest` that node `index` must hold: all of it, or (scope "node") the
    files that node index held when it was committed."""
    if scope == "all" or not manifest.node_count:
        return manifest
    if manifest.node_count != num_nodes:
        raise RestoreError(
            f"--restore-scope node: the checkpoint was written by {manifest.node_count} nodes, this job has "
            f"{num_nodes}; restore it whole (--restore-scope all) or run on {manifest.node_count} nodes")
    files = {rel: e for rel, e in manifest.files.items() if index in manifest.writers.get(rel, [index])}
    return Manifest(manifest.attempt, manifest.created, files, manifest.node_count,
                    {rel: w for rel, w in manifest.writers.items() if rel in files})


# --------------------------------------------------------------------------- launching agents


class AgentLauncher(Protocol):
    def run(self, args: list[str], deadline_s: float) -> list[NodeReport]: ...


class SrunLauncher:
    """Runs `slurmagent node-agent ARGS` once per node of the job: `srun --overlap`, one task
    per node, inside the allocation (so Slurm tracks, signals and ends it), with a deadline."""

    def __init__(self, alloc: Allocation, env: Mapping[str, str], *, srun: str = "srun",
                 python: str = sys.executable, err: TextIO = sys.stderr):
        self.alloc = alloc
        self.env = {k: v for k, v in env.items() if k not in _STEP_REQUEST_VARS}
        self.srun = srun
        self.python = python
        self.err = err

    def argv(self, args: list[str]) -> list[str]:
        n = self.alloc.num_nodes
        return [self.srun, "--overlap", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", "--cpus-per-task=1",
                "--gres=none", "--mpi=none", "--kill-on-bad-exit=1", f"--job-name={AGENT_STEP_NAME}",
                self.python, "-m", "slurmagent.entry", "node-agent", *args]

    def run(self, args: list[str], deadline_s: float) -> list[NodeReport]:
        argv = self.argv(args)
        try:
            proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
        except OSError as exc:
            return [NodeReport(index=i, node="", ok=False, error=f"cannot run {self.srun}: {exc.strerror or exc}")
                    for i in range(self.alloc.num_nodes)]
        try:
            stdout, stderr = proc.communicate(timeout=deadline_s + 20.0)  # + the step's start
        except subprocess.TimeoutExpired:
            proc.terminate()  # srun passes TERM on to the agents and ends the step
            try:
                stdout, stderr = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            stderr += f"\nthe node agents did not finish within {deadline_s:g} s"
        for line in stderr.splitlines():
            if line.strip():
                print(line, file=self.err, flush=True)
        reports = {r.index: r for r in map(NodeReport.from_line, stdout.splitlines()) if r is not None}
        why = f"srun exited {proc.returncode}: {(stderr.strip().splitlines() or ['no output'])[-1]}"
        return [reports.get(i) or NodeReport(index=i, node="", ok=False, error=f"no report ({why})")
                for i in range(self.alloc.num_nodes)]


# --------------------------------------------------------------------------- the job-level store


@dataclass(frozen=True)
class AllocationSyncResult:
    files_sent: int
    bytes_sent: int
    manifest_generation: int | None
    files_total: int
    nodes: int
    manifest: Manifest | None = None  # the job-level manifest committed by this sync (None: none)


class Committer(Protocol):
    """The bucket side the batch step needs (slurmagent.gcp.storage.GcsCheckpointStore)."""

    url: str

    def read_manifest(self, *, deadline_s: float = ...) -> tuple[Manifest | None, int]: ...

    def commit(self, manifest: Manifest, *, deadline_s: float = ...) -> int: ...


class AllocationStore:
    """The wrapper's CheckpointStore for a multi-node job: restore and sync run on every node
    through the agents; the batch step alone reads and commits the job-level manifest."""

    def __init__(self, alloc: Allocation, committer: Committer | None, launcher: AgentLauncher, *,
                 scope: str = "all", err: TextIO = sys.stderr, agent_options: Sequence[str] = ()):
        if scope not in SCOPES:
            raise AllocationError(f"--restore-scope must be one of {', '.join(SCOPES)}, not {scope!r}")
        self.alloc = alloc
        self.committer = committer
        self.launcher = launcher
        self.scope = scope
        self.err = err
        self.agent_options = list(agent_options)  # the store's tunables, for every agent
        self.trainer_running: Callable[[], bool] = lambda: False  # set by the runner
        self.baseline: Manifest | None = None  # what was restored
        self.last_committed: Manifest | None = None
        self.partial_seen: dict[str, tuple[frozenset[int], str]] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def say(self, message: str) -> None:
        print(f"slurmagent run: {message}", file=self.err, flush=True)

    def _failures(self, reports: list[NodeReport]) -> str:
        return "; ".join(f"{r.who}: {r.error}" for r in reports if not r.ok)

    @property
    def url(self) -> str:
        return self.committer.url if self.committer is not None else ""

    def latest_manifest(self, *, deadline_s: float = 60.0) -> Manifest | None:
        """The committed job-level manifest (a multi-node restore always takes it)."""
        return self.committer.read_manifest(deadline_s=deadline_s)[0] if self.committer is not None else None

    def restore(self, ckpt_dir, *, deadline_s: float = 1800.0, state_file=None) -> Manifest | None:
        manifest, generation = (None, 0)
        if self.committer is not None:
            manifest, generation = self.committer.read_manifest(deadline_s=min(60.0, deadline_s))
        args = ["restore", "--ckpt-dir", str(ckpt_dir), "--remote", self.committer.url if self.committer else "",
                "--generation", str(generation), "--scope", self.scope, "--deadline", f"{deadline_s:g}"]
        if state_file is not None:
            args += ["--state-file", str(state_file)]
        reports = self.launcher.run(args + self.agent_options, deadline_s)
        failed = self._failures(reports)
        if failed:
            local = [r.node for r in reports if not r.ok and r.node_local and r.node]
            if local:  # the job is requeued without these nodes
                raise NodeDiskError(f"restore failed on {failed}", nodes=local)
            raise RestoreError(f"restore failed on {failed}")
        self.baseline = self.last_committed = manifest
        if manifest is not None:
            self.say(f"every node of the job ({self.alloc.num_nodes}) holds the checkpoint of attempt "
                     f"{manifest.attempt} ({'all' if self.scope == 'all' else 'its own'} files)")
        return manifest

    def _check_held_back(self, files: dict[str, dict], reports: list[NodeReport], deadline_s: float) -> None:
        if self.committer is not None:
            _check_held_back_objects(self.committer, files, reports, deadline_s)

    def sync(self, ckpt_dir, attempt: int, state_file, deadline_s: float = 600.0,
             restored: Manifest | None = None) -> AllocationSyncResult:
        with self._lock:
            running = self.trainer_running()
            args = ["sync", "--ckpt-dir", str(ckpt_dir), "--remote", self.committer.url if self.committer else "",
                    "--state-file", str(state_file), "--attempt", str(attempt),
                    "--deadline", f"{max(deadline_s - 5.0, 1.0):g}"]
            reports = self.launcher.run(args + self.agent_options, deadline_s)
            failed = self._failures(reports)
            if failed:
                raise CheckpointError(f"upload failed on {failed}; the last complete checkpoint stays")
            # While the trainer runs: a cut at the instant the first agent began (every node
            # looked at its D after it).
            cut_ns = min(r.started_ns for r in reports) if running else None
            merged = merge_reports(reports, baseline=self.baseline, previous=self.last_committed, cut_ns=cut_ns,
                                   partial_seen=self.partial_seen)
            for rel, why in merged.conflicts.items():  # once per file and job, not every round
                if rel not in self._warned:
                    self._warned.add(rel)
                    self.say(f"WARNING: {why}")
            sent = sum(r.files_sent for r in reports), sum(r.bytes_sent for r in reports)
            if self.committer is None or not merged.files:
                return AllocationSyncResult(*sent, None, len(merged.files), len(reports))
            self._check_held_back(merged.files, reports, deadline_s)
            manifest = Manifest(attempt=attempt, files=merged.files, node_count=self.alloc.num_nodes,
                                writers=merged.writers,
                                no_progress=no_progress_after(restored or self.baseline, merged.files))
            generation = self.committer.commit(manifest, deadline_s=max(deadline_s / 4, 10.0))
            self.last_committed = manifest
            return AllocationSyncResult(*sent, generation, len(merged.files), len(reports), manifest)


def _check_held_back_objects(committer: Committer, files: dict[str, dict], reports: Sequence[NodeReport],
                            deadline_s: float) -> None:
    """Entries no node reported (held back as previously committed) must still have their blob in
    the bucket (a lifecycle rule may have deleted it, and no node holds those bytes to send again)."""
    check = getattr(committer, "missing_objects", None)
    reported = {entry_content_id(e) for r in reports for e in r.files.values() if "link" not in e}
    held = {rel: e for rel, e in files.items() if "link" not in e and entry_content_id(e) not in reported}
    if check is None or not held:
        return
    missing = check(held, deadline_s=max(deadline_s / 4, 10.0))
    if missing:
        raise CheckpointError(
            f"not committing: {len(missing)} file(s) kept as previously committed ({', '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''}) have no blob in {committer.url} any more and no node "
            "holds them; the next round commits what the nodes hold")


def allocation_store(env: Mapping[str, str], committer: Committer | None, *, ckpt_dir_option: str | None,
                     scope: str = "all", err: TextIO = sys.stderr,
                     agent_options: Sequence[str] = ()) -> AllocationStore | None:
    """The multi-node store when this wrapper is a multi-node job's batch step, else None."""
    alloc = Allocation.from_env(env)
    if alloc is None:
        return None
    if ckpt_dir_option and "%n" in ckpt_dir_option:
        raise AllocationError(
            f"--ckpt-dir {ckpt_dir_option}: %n would name the batch host on every node (all ranks get the same "
            "SLURMAGENT_CKPT_DIR); give a node-local path that is the same on every node")
    return AllocationStore(alloc, committer, SrunLauncher(alloc, env, err=err), scope=scope, err=err,
                           agent_options=agent_options)

"""A multi-node job's ranks on its other nodes, for the batch step's hang watch.

A rank on node 2 writes its `progress()` file on node 2: the progress directory is made at the
same path on every node by the restore round (`--private-dir`), and the batch step cannot read
another node's disk. The node agents (run/multinode.py's `srun --overlap` step, no other
process) tell it, two ways:

- every sync round (`[checkpoint] sync_interval_s`, 60 s by default) each agent adds its node's
  ranks to its report: step, the step's time, pid, process state. A rank whose step changed is
  progress at the time the batch step received the report, on its own clock (node clocks never
  decide a hang). The step's own time, on its node's clock, is used as it is by the straggler
  watch only (policy/stall.py StragglerWatch: NTP-synchronised nodes assumed). Cost: a few small files read per node and round. Freshness: one sync
  interval plus the round's time, so remote-only progress keeps a job alive only when the
  limit is above that (the adaptive floor, 120 s, is); on the batch node the ranks, the
  output file (srun forwards every rank's lines to it) and the checkpoint directory are read
  every 2 s as before.
- on a hang, one evidence round (`node-agent evidence`, at most EVIDENCE_DEADLINE_S): each
  agent reads its ranks' process states now (running, stopped `T`, `D`, gone), their py-spy
  stacks where installed and its GPU state. A node whose agent does not answer keeps the
  states of its last sync report, marked as old; the batch step names the suspect among all
  of the job's nodes.

- on a hang that points at one of them, a drain asked by that node's agent of that node's own
  root (`node-agent drain`), which drains only on what it sees there (actions/root_evidence.py).

Pure but for `node_ranks`/`node_evidence` (this node's files and processes).
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ..policy.stall import RankState
from ..state import progress as progress_files
from . import evidence

BATCH_NODE_ENV = "SLURMAGENT_HANG_BATCH_NODE"  # in the agents' environment: that node's agent skips the evidence
ASK_THERE_DEADLINE_S = 60.0  # an agent step's start, then root's own look there (a GPU check: 20 s)
EVIDENCE_DEADLINE_S = 25.0
SAMPLE_DEADLINE_S = 20.0  # one stack sample round of the agents (py-spy: 10 s at most)  # py-spy (10 s) and the GPU check (20 s) run side by side on each node
MAX_GPU_TEXT = 64 * 1024


def node_ranks(progress_dir: str | Path, node: str, proc: str = "/proc") -> list[dict[str, Any]]:
    """This node's ranks (their files name it, or no node) with their process state now."""
    mine = {r: p for r, p in progress_files.read_all(progress_dir).items() if p.on(node)}
    return [r.__dict__ for r in evidence.rank_states(mine, node, proc)]


def node_phases(progress_dir: str | Path, node: str) -> list[dict[str, Any]]:
    """This node's ranks' open phases (`trainer.phase`), for the sync report."""
    return [p.__dict__ for p in progress_files.read_phases(progress_dir).values() if p.on(node)]


def node_stacks(progress_dir: str | Path, node: str, index: int,
                py_spy: Callable[[list[int]], dict[int, str]] = evidence.py_spy_dumps) -> bytes:
    """One stack sample of this node's ranks (hang/samples.py): {rank: main-thread frames or null}."""
    from .samples import main_frames  # start-up speed: only in a silence

    mine = {r: p for r, p in progress_files.read_all(progress_dir).items() if p.on(node)}
    dumps = py_spy([p.pid for p in mine.values()]) if mine else {}
    frames = {str(r): main_frames(dumps.get(p.pid, "")) for r, p in mine.items()}
    return json.dumps({"index": index, "node": node, "frames": frames}).encode()


def node_evidence(progress_dir: str | Path, node: str, index: int, *, proc: str = "/proc",
                  py_spy: Callable[[list[int]], dict[int, str]] = evidence.py_spy_dumps,
                  gpu_state: Callable[[], tuple[str, str]] = evidence.gpu_state) -> bytes:
    """One node's evidence as the agent's report payload: ranks, py-spy dumps, GPU state."""
    ranks = node_ranks(progress_dir, node, proc)
    gpu: list[tuple[str, str]] = []
    t = threading.Thread(target=lambda: gpu.append(gpu_state()), daemon=True)
    t.start()
    pids = [r["pid"] for r in ranks if r["state"] not in ("gone", "Z")]
    flight = evidence.flight_recorder_dumps([r["rank"] for r in ranks if r["state"] not in ("gone", "Z")])
    dumps = py_spy(pids) if pids else {}
    t.join(evidence.GPU_TIMEOUT_S + 2)
    text, fault = gpu[0] if gpu else ("GPU state did not come in time", "")
    by_pid = {r["pid"]: r["rank"] for r in ranks}
    return json.dumps({"index": index, "node": node, "ranks": ranks, "gpu": text[:MAX_GPU_TEXT], "fault": fault,
                       "flight": flight[:MAX_GPU_TEXT], "dumps": {str(by_pid[p]): d for p, d in dumps.items() if p in by_pid}}).encode()


def _phase(raw: Any, node: str) -> progress_files.Phase | None:
    """A phase from an agent's report (the job's own processes wrote it: checked, never trusted further)."""
    try:
        p = progress_files.Phase(int(raw["rank"]), str(raw["name"])[:40], float(raw["started"]),
                                 float(raw["expected_s"]), int(raw["pid"]), node)
    except (KeyError, TypeError, ValueError):
        return None
    return p if p.rank >= 0 and math.isfinite(p.started) and math.isfinite(p.expected_s) else None


def _rank_state(raw: Any, node: str) -> RankState | None:
    """A rank from an agent's report (the job's own processes wrote it: checked, never trusted further)."""
    try:
        r = RankState(int(raw["rank"]), node, int(raw["pid"]), str(raw["state"])[:8],
                      None if raw.get("step") is None else int(raw["step"]),
                      None if raw.get("last_at") is None else float(raw["last_at"]))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return r if r.rank >= 0 else None


@dataclass
class RemoteEvidence:
    ranks: list[RankState] = field(default_factory=list)
    dumps: dict[int, str] = field(default_factory=dict)  # rank -> py-spy text
    gpu: dict[str, tuple[str, str]] = field(default_factory=dict)  # node -> (check --json text, fault)
    notes: list[str] = field(default_factory=list)  # a node that did not answer, and what stands in for it
    flight: dict[str, str] = field(default_factory=dict)  # node -> what its flight-recorder ask did


class RemoteRanks:
    """The other nodes' ranks as their agents last reported them.

    `ask(args, deadline_s)`: one agent round with `args`, each node index's raw payload
    (run/multinode.SrunLauncher.payloads); None outside a multi-node job."""

    def __init__(self, node: str, progress_dir: str | Path, ckpt_dir: str | Path,
                 ask: Callable[[list[str], float], dict[int, bytes]] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.node, self.progress_dir, self.ckpt_dir = node, str(progress_dir), str(ckpt_dir)
        self.ask, self.clock = ask, clock
        self.ranks: dict[int, RankState] = {}  # rank -> as its node's agent last saw it
        self.seen_at: dict[str, float] = {}  # node -> when its last report came (our clock)
        self.phases: dict[int, progress_files.Phase] = {}  # rank -> its open phase, as its node last said

    def take(self, reports: Iterable[Any]) -> None:
        """The ranks in a sync round's node reports (run/agent_reports.NodeReport.ranks); called
        from the sync thread."""
        now = self.clock()
        ranks, seen, phases = dict(self.ranks), dict(self.seen_at), dict(self.phases)  # replaced whole: read meanwhile
        for report in reports:
            node = getattr(report, "node", "")
            if not getattr(report, "ok", False) or not node or node == self.node:
                continue
            seen[node] = now
            phases = {r: p for r, p in phases.items() if p.node != node}  # the node's report says all of its own
            for raw in getattr(report, "phases", None) or []:
                phase = _phase(raw, node) if isinstance(raw, dict) else None
                if phase is not None:
                    phases[phase.rank] = phase
            for raw in getattr(report, "ranks", None) or []:
                r = _rank_state(raw, node) if isinstance(raw, dict) else None
                if r is not None:
                    ranks[r.rank] = r
        self.ranks, self.seen_at, self.phases = ranks, seen, phases

    def stacks(self, deadline_s: float = SAMPLE_DEADLINE_S) -> dict[int, str | None]:
        """One stack sample of the other nodes' ranks (`node-agent samples`): rank -> frames or None."""
        out: dict[int, str | None] = {}
        if self.ask is None:
            return out
        for payload in self.ask(["samples", "--ckpt-dir", self.ckpt_dir, "--deadline", f"{deadline_s:g}"],
                                deadline_s).values():
            try:
                doc = json.loads(payload)
            except ValueError:
                continue
            if not isinstance(doc, dict) or doc.get("node") == self.node or not isinstance(doc.get("frames"), dict):
                continue
            for rank, frames in doc["frames"].items():
                if str(rank).isdigit() and (frames is None or isinstance(frames, str)):
                    out[int(rank)] = None if frames is None else frames[:4096]
        return out

    def progress(self) -> dict[int, tuple[int | None, float | None]]:
        """rank -> (step, its time) on the other nodes: a change is progress (HangMonitor.poll)."""
        return {rank: (r.step, r.last_at) for rank, r in self.ranks.items()}

    def ask_root_there(self, node: str, request: dict[str, Any], deadline_s: float = ASK_THERE_DEADLINE_S) -> str:
        """`request` (a drain of `node`, with the socket of that node's root) asked by the job's agent
        on `node`, whose root sees that node's processes (`node-agent drain`); its answer line."""
        if self.ask is None:
            return f"no agent on {node} to ask its root"
        args = ["drain", "--ckpt-dir", self.ckpt_dir, "--ask", json.dumps(request), "--deadline", f"{deadline_s:g}"]
        for payload in self.ask(args, deadline_s).values():
            try:
                doc = json.loads(payload)
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get("node") == node and isinstance(doc.get("answer"), str):
                return doc["answer"][:300]
        return f"no answer from the job's agent on {node} within {deadline_s:g} s"

    def evidence(self, deadline_s: float = EVIDENCE_DEADLINE_S) -> RemoteEvidence:
        """Every other node's ranks, py-spy stacks and GPU state now, from one evidence round."""
        out = RemoteEvidence()
        got: dict[str, dict] = {}
        if self.ask is not None:
            args = ["evidence", "--ckpt-dir", self.ckpt_dir, "--deadline", f"{deadline_s:g}"]
            for payload in self.ask(args, deadline_s).values():
                try:
                    doc = json.loads(payload)
                except ValueError:
                    continue
                if isinstance(doc, dict) and isinstance(doc.get("node"), str) and doc["node"] != self.node:
                    got[doc["node"]] = doc
        fresh: set[int] = set()
        for node, doc in sorted(got.items()):
            for raw in doc.get("ranks") or []:
                r = _rank_state(raw, node) if isinstance(raw, dict) else None
                if r is not None:
                    out.ranks.append(r)
                    fresh.add(r.rank)
            dumps = doc.get("dumps") if isinstance(doc.get("dumps"), dict) else {}
            out.dumps.update({int(k): str(v) for k, v in dumps.items() if str(k).isdigit()})
            out.gpu[node] = (str(doc.get("gpu", "")), str(doc.get("fault", ""))[:200])
            if doc.get("flight"):
                out.flight[node] = str(doc["flight"])[:MAX_GPU_TEXT]
        now, last = self.clock(), self.ranks
        for node in sorted({r.node for r in last.values()} - set(got)):
            old = [r for r in last.values() if r.node == node and r.rank not in fresh]
            out.ranks.extend(old)
            out.notes.append(f"{node}: no evidence from its agent; its ranks as its last sync report said "
                             f"{now - self.seen_at.get(node, now):.0f} s ago")
        out.ranks.sort(key=lambda r: r.rank)
        return out

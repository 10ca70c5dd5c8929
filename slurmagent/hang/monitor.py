"""The wrapper's hang watch on its node: sample the progress signals, apply the stall rule,
and on a hang collect the evidence, name a suspect node and stop the job's processes.

Signals, cheapest first: the ranks' `trainer.progress` files (`state/progress.py`), the
checkpoint directory changing (any file, temporary ones included: a long checkpoint write
is progress), the job's output growing (the wrapper's stdout/stderr when they are files: the
batch step's StdOut, which the trainer inherits; srun forwards every rank's lines to it), and, in
a multi-node job, the other nodes' ranks as their node agents report them (`hang/remote.py`).
Sampled every `poll_s` from the wrapper's main loop, judged on its clock (`policy/stall.py`).
A hung trainer gets no checkpoint signal:
it could not act on it; the last committed checkpoint is what counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from ..policy.stall import RANK_SIGNALS, STOPPED_STATES, Evidence, StallRule, StallWatch, StragglerRule, StragglerWatch, suspect
from ..state import progress as progress_files
from . import evidence
from .remote import RemoteEvidence, RemoteRanks
from .samples import StackSamples, main_frames

HANG_CAUSE = "hang"  # a flush cause that starts with it is ours (run/supervisor.py, core/goodput.end_of)
MAX_DIR_ENTRIES = 100_000


def dir_signature(path: Path, limit: int = MAX_DIR_ENTRIES) -> tuple:
    """(files, bytes, newest mtime) of everything under `path`, without reading a file."""
    count = size = newest = 0
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            count += 1
            size += st.st_size
            newest = max(newest, st.st_mtime_ns)
            if count >= limit:
                return count, size, newest
    return count, size, newest


def output_bytes(fds: tuple[int, ...]) -> int:
    """Bytes in the distinct regular files behind `fds` (stdout and stderr are often one file)."""
    seen: dict[tuple[int, int], int] = {}
    for fd in fds:
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if (st.st_mode & 0o170000) == 0o100000:
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


class CountingStream:
    """The wrapper's own stderr, counting what it writes: the wrapper's lines in the job's
    output (a sync report, a failing bucket said every few minutes) are not the job's progress."""

    def __init__(self, inner):
        self.inner, self.written = inner, 0

    def write(self, text: str) -> int:
        self.written += len(text.encode(errors="replace"))
        return self.inner.write(text)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def no_stacks() -> str:
    """Why the ranks' stacks cannot be had on this node, "" when py-spy may read them (a denial
    under ptrace_scope 1, for ranks that are not the wrapper's children, shows in the samples)."""
    if evidence.py_spy_exe() is None:
        return "py-spy is not installed (pip install 'slurmagent[hang]')"
    scope = evidence.ptrace_scope()
    if scope is not None and scope >= 2:
        return f"kernel.yama.ptrace_scope = {scope} lets no job read its ranks' stacks"
    return ""


class HangMonitor:
    def __init__(self, rule: StallRule, *, progress_dir: Path, ckpt_dir: Path, node: str, job: str, attempt: int,
                 say: Callable[[str], None], ask_drain: Callable[[str, str, int], str] | None = None,
                 ask_count: Callable[[str, str, int], str] | None = None, remote: RemoteRanks | None = None,
                 straggler: StragglerRule | None = None, straggler_report: Callable[[int, str, str], None] | None = None,
                 poll_s: float = 2.0, clock: Callable[[], float] = time.monotonic, out_fds: tuple[int, ...] = (1, 2),
                 own_stream: CountingStream | None = None, proc: str = "/proc", gpu_state: Callable[[], tuple[str, str]] = evidence.gpu_state,
                 py_spy: Callable[[list[int]], dict[int, str]] = evidence.py_spy_dumps,
                 wall: Callable[[], float] = time.time, stacks: str = ""):
        self.rule, self.progress_dir, self.ckpt_dir = rule, Path(progress_dir), Path(ckpt_dir)
        self.node, self.job, self.attempt, self.say = node, job, attempt, say
        self.ask_drain, self.poll_s, self.clock, self.out_fds, self.proc = ask_drain, poll_s, clock, out_fds, proc
        self.gpu_state, self.py_spy, self.own_stream = gpu_state, py_spy, own_stream
        self.ask_count, self.remote = ask_count, remote  # ask_drain/ask_count(node, detail, pid)
        self.output_mark = -1  # the job's output bytes (ours taken off) at their highest: only growth past it counts
        self.stragglers = StragglerWatch(straggler) if straggler is not None else None
        self.straggler_report = straggler_report
        self.watch: StallWatch | None = None
        self.next_poll = 0.0
        self.last: dict[str, object] = {}
        self.cause = ""
        self.folder: Path | None = None
        self.suspect_node = ""
        self.wall = wall  # the phases' clock (their files hold wall times)
        self.said_blind = False
        self.first_rank_wall: float | None = None  # when a rank's own progress first moved (wall)
        self.last_moved_wall: float | None = None  # when any signal last moved (wall): the report's last progress
        self.first_step: tuple[int, float] | None = None  # (step, its wall time): the attempt's first progress seen
        self.last_step: tuple[int, float] | None = None  # the highest step seen, for the report's recompute
        # adaptive rule: the ranks' stacks through a silence, or why there are none ("" = sample them)
        self.blind = stacks or ("" if not rule.adaptive else no_stacks())
        self.stack_samples = StackSamples(self._take_stacks, clock) if rule.adaptive and not self.blind else None
        if self.blind and rule.adaptive:
            say(f"hang watch: {self.blind}: no stacks to show the ranks stuck, so a silence is a hang only after "
                f"{max(rule.floor_s, rule.blind_floor_s):g} s at least (a stopped, gone or zombie rank sooner)")

    def progress_times(self) -> tuple[float | None, float | None]:
        """(first rank progress, last progress of any signal), wall clock, for the attempt's ledger record."""
        return (None if self.first_rank_wall is None else round(self.first_rank_wall, 3),
                None if self.last_moved_wall is None else round(self.last_moved_wall, 3))

    def progress_steps(self) -> tuple[int | None, int | None, float | None]:
        """(first step, last step, seconds per step) the ranks' `trainer.progress` showed this
        attempt, from their own times: the report's recompute is the steps redone at this pace."""
        if self.first_step is None or self.last_step is None:
            return None, None, None
        (s0, t0), (s1, t1) = self.first_step, self.last_step
        pace = round((t1 - t0) / (s1 - s0), 6) if s1 > s0 and t1 >= t0 else None
        return s0, s1, pace

    def current_step(self) -> int | None:
        """The highest step a rank has shown so far (None: none yet)."""
        last = self.last_step
        return None if last is None else last[0]

    def _rank_time(self, current: dict) -> float:
        """The newest of this node's ranks' own progress times, not later than now."""
        times = [at for _, at in current["progress"].values() if isinstance(at, (int, float))]
        return min(max(times), self.wall()) if times else self.wall()

    def _note_steps(self, ranks: dict) -> None:
        for step, at in ranks.values():
            if not isinstance(step, int) or not isinstance(at, (int, float)):
                continue
            if self.first_step is None or step < self.first_step[0]:
                self.first_step = (step, float(at))
            if self.last_step is None or step > self.last_step[0]:
                self.last_step = (step, float(at))

    def owns(self, cause: str) -> bool:
        return bool(self.cause) and cause == self.cause

    # --- sampling -----------------------------------------------------------------------------

    def sample(self) -> dict[str, object]:
        ranks = self._local_ranks()
        ours = self.own_stream.written if self.own_stream else 0
        out: dict[str, object] = {"progress": {r: (p.step, p.at) for r, p in ranks.items()},
                                  "checkpoint directory": dir_signature(self.ckpt_dir),
                                  "output": output_bytes(self.out_fds) - ours}
        if self.remote is not None:
            out["progress on other nodes"] = self.remote.progress()
        out["phases"] = {r: (p.name, p.started) for r, p in self._phases().items()}
        return out

    def _phases(self) -> dict:
        here = {r: p for r, p in progress_files.read_phases(self.progress_dir).items() if p.on(self.node)}
        return {**(self.remote.phases if self.remote is not None else {}), **here}

    def _take_stacks(self) -> dict[int, str | None]:
        """Every rank's main-thread frames now: this node's by py-spy, the others' by their agents."""
        ranks = self._local_ranks()
        dumps = self.py_spy([p.pid for p in ranks.values()]) if ranks else {}
        out = {r: main_frames(dumps.get(p.pid, "")) for r, p in ranks.items()}
        return {**(self.remote.stacks() if self.remote is not None else {}), **out}

    def what_ranks_show(self, now: float) -> Evidence | None:
        """What the ranks show in this silence (adaptive rule): a live phase, a stopped rank, the
        stacks' verdict; sampled from half the short limit on."""
        w = self.watch
        if w is None or not self.rule.adaptive or w.last is None:
            return None
        live = [p for p in self._phases().values() if p.live(self.wall(), self.rule.ceiling_s)]
        if live:
            return Evidence(phase=live[0].words(self.wall()))
        limit = w.limit() or 0.0
        if w.silence(now) < limit / 2 or not w.ranks_reported:
            return Evidence()
        states = evidence.rank_states(self._local_ranks(), self.node, self.proc)
        states += list(self.remote.ranks.values()) if self.remote is not None else []
        stopped = next((f"rank {r.rank} on {r.node or 'this node'} {STOPPED_STATES[r.state]} (pid {r.pid})"
                        for r in sorted(states, key=lambda r: r.rank) if r.state in STOPPED_STATES), "")
        if self.stack_samples is None:
            return Evidence(stopped=stopped, stacks="blind", detail=self.blind)
        verdict, detail = self.stack_samples.verdict({r.rank for r in states}, self.rule.samples)
        if verdict == "blind" and not self.said_blind:
            self.said_blind = True
            self.say(f"hang watch: {detail} (py-spy denied? kernel.yama.ptrace_scope, docs/user/hangs.md): a silence "
                     f"is a hang only after {max(self.rule.floor_s, self.rule.blind_floor_s):g} s at least")
        if not verdict:  # `samples` of them from half the short limit to the limit
            self.stack_samples.maybe(max(1.0, limit / (2 * max(1, self.rule.samples - 1))))
        return Evidence(stopped=stopped, stacks=verdict, detail=detail)

    def _local_ranks(self) -> dict:
        """This node's ranks (a rank of another node on a path that is not node-local is its agent's)."""
        return {r: p for r, p in progress_files.read_all(self.progress_dir).items() if p.on(self.node)}

    def poll(self, child: subprocess.Popen) -> str:
        """The hang's cause ("hang: ...") when the rule says so now, else ""; cheap between samples."""
        now = self.clock()
        if self.rule.off or now < self.next_poll:
            return ""
        self.next_poll = now + self.poll_s
        current = self.sample()
        self._note_steps({**current.get("progress on other nodes", {}), **current["progress"]})
        if self.watch is None:  # the first sample is the start (the trainer was just started)
            self.watch, self.last, self.output_mark = StallWatch(self.rule, now), current, current["output"]
            return ""
        grew = current["output"] > self.output_mark  # a truncation, rotation or our own line is no progress
        self.output_mark = max(self.output_mark, current["output"])
        moved = [k for k, v in current.items() if (grew if k == "output" else v != self.last.get(k))]
        self.last = current
        if moved:  # a rank's own progress dates itself (the poll sees it up to poll_s late)
            moved_at = self._rank_time(current) if "progress" in moved else self.wall()
            self.last_moved_wall = max(self.last_moved_wall or moved_at, moved_at)
            if self.first_rank_wall is None and any(k in RANK_SIGNALS for k in moved):
                self.first_rank_wall = self.last_moved_wall
            self.watch.progressed(now, moved[0], ranks=any(k in RANK_SIGNALS for k in moved),
                                  learn=moved != ["phases"])
            if self.stack_samples is not None:
                self.stack_samples.reset()
        if self.stragglers is not None:
            self._stragglers(now, {**current.get("progress on other nodes", {}), **current["progress"]})
        why = self.watch.stalled(now, self.what_ranks_show(now))
        if why:
            self.cause = f"{HANG_CAUSE}: {why}"
        return self.cause

    def _stragglers(self, now: float, ranks: dict) -> None:
        steps = {r: (at, step) for r, (step, at) in ranks.items() if step is not None and at is not None}
        far = self.remote.ranks if self.remote is not None else {}
        rule = self.stragglers.rule
        for found in self.stragglers.observe(now, steps):
            rank, value, median = found.rank, found.value, found.median
            node = far[rank].node if rank in far and rank not in self._local_ranks() else self.node
            over = f"for {rule.windows} windows of {rule.window_s:g} s"
            if found.step_s is None:
                detail = (f"rank {rank} straggles: {value:.2f} s/step, {value / median:.1f}x the other ranks' "
                          f"median {median:.2f} s/step {over}")
            else:  # the root channel keeps 150 characters: what and how much first
                detail = (f"rank {rank} straggles: busy {value:.3f} s per step, {value / median:.1f}x the other "
                          f"ranks' median {median:.3f} s, {over} (in lockstep at {found.step_s:.3f} s/step: it "
                          f"reaches each step {found.lag_s:.3f} s after the first rank)")
            self.say(f"straggler on node {node}: {detail}")
            if self.straggler_report is not None:
                self.straggler_report(rank, detail, node)

    # --- the hang ------------------------------------------------------------------------------

    def stop(self, child: subprocess.Popen) -> None:
        """Evidence first (this node's, and the other nodes' through their agents, side by side),
        then the suspect's drain asked (or, with no suspect, the hang counted against every node
        of the job); the caller then kills the job's processes (run/child.kill_group: SIGKILL,
        never the checkpoint signal)."""
        started = self.clock()
        remote: list[RemoteEvidence] = []
        far = threading.Thread(target=lambda: remote.append(self.remote.evidence()), daemon=True)
        if self.remote is not None:
            far.start()
        ranks = evidence.rank_states(self._local_ranks(), self.node, self.proc)
        procs = evidence.session_processes(child.pid, self.proc)
        pids = [r.pid for r in ranks if r.state not in ("gone", "Z")] or [p for p, st, _ in procs if st != "Z"]
        gpu: list[tuple[str, str]] = []
        t = threading.Thread(target=lambda: gpu.append(self.gpu_state()), daemon=True)
        t.start()
        flight = evidence.flight_recorder_dumps([r.rank for r in ranks if r.state not in ("gone", "Z")])
        dumps = self.py_spy(pids)
        t.join(evidence.GPU_TIMEOUT_S + 2)
        if self.remote is not None:
            far.join(max(1.0, started + evidence.GPU_TIMEOUT_S + 10 - self.clock()))
        far_ev = remote[0] if remote else RemoteEvidence(notes=["the other nodes' evidence did not come in time"]
                                                         if self.remote is not None else [])
        gpu_text, gpu_fault = gpu[0] if gpu else ("GPU state did not come in time", "")
        ranks = sorted(ranks + far_ev.ranks, key=lambda r: r.rank)
        faults = {self.node: gpu_fault, **{n: f for n, (_, f) in far_ev.gpu.items()}}
        seen = self.stack_samples.samples[-1] if self.stack_samples is not None and self.stack_samples.samples else {}
        node, detail = suspect(ranks, faults, frames=seen)
        self.suspect_node = node
        summary = f"{self.cause}; {self._states(ranks)}; {detail}; {self._act(node, detail, ranks)}"
        if far_ev.notes:
            summary += "; " + "; ".join(far_ev.notes)
        summary += f"; evidence took {self.clock() - started:.1f} s"
        files = {"summary.txt": summary + "\n",
                 "ranks.json": json.dumps([r.__dict__ for r in ranks], indent=1) + "\n",
                 "processes.txt": "".join(f"{p} {st} {cmd}\n" for p, st, cmd in procs),
                 f"gpu-{self.node or 'node'}.json": gpu_text,
                 **{f"gpu-{n}.json": text for n, (text, _) in far_ev.gpu.items()}}
        by_pid = {r.pid: r.rank for r in ranks if r.node == self.node}
        for pid, text in dumps.items():
            files[f"py-spy-{'rank-%d' % by_pid[pid] if pid in by_pid else 'pid-%d' % pid}.txt"] = text
        files.update({f"py-spy-rank-{rank}.txt": text for rank, text in far_ev.dumps.items()})
        flights = {self.node: flight, **far_ev.flight}
        files.update({f"flight-recorder-{n or 'node'}.txt": text for n, text in flights.items() if text})
        try:
            where = evidence.evidence_dir(evidence.output_file(), Path.cwd(), f"slurmagent-{self.job}", self.attempt)
            self.folder = evidence.write_folder(where, files)
            where = f"evidence in {self.folder}"
        except OSError as exc:
            where = f"evidence NOT written ({exc.strerror or exc})"
        self.say(f"{summary}; {where}")
        self.say("hang: no checkpoint signal to a hung trainer (it could not act on it): killing its processes; "
                 "the last committed checkpoint counts")

    @staticmethod
    def _states(ranks: list) -> str:
        return ", ".join(f"rank {r.rank} on {r.node or 'this node'} {r.state} step {r.step}" for r in ranks) \
            or "no rank reported progress"

    def _act(self, node: str, detail: str, ranks: list) -> str:
        """Ask the suspect node's root for its drain, naming the job's rank there (the stopped one
        first); that root drains only on what it sees itself (run/main.py routes another node's ask
        through the job's agent there). Not granted: the hang is counted against that node (the
        lemon count), which its root checks too. A hang that names no node counts against none."""
        if not self.node:
            return "not a Slurm job: no node to drain"
        if not node:
            return "no node to blame: none drained, no hang counted"
        if self.ask_drain is None:
            return f"suspect {node}: not drained from here (no root channel)"
        there = sorted((r for r in ranks if r.node == node and r.state != "gone"), key=lambda r: r.rank)
        pid = next((r.pid for r in there if r.state in STOPPED_STATES), there[0].pid if there else 0)
        answer = self.ask_drain(node, detail, pid)
        if answer.startswith("granted") or self.ask_count is None:
            return f"drain of {node} asked: {answer}"
        return f"drain of {node} asked: {answer}; the hang counted against {node} instead: {self.ask_count(node, detail, pid)}"

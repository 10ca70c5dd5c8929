"""Jobs on a GPU that failed under them leave the node at once (for `watch` and `healthcheck`).

Wrapped jobs (`slurmagent run`) get the fault flush signal and requeue themselves after a
short sync; the others get a journaled `fault-requeue` that acts once per job and restart
count, so every node of a multi-node job may ask without requeueing it twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..state import metrics
from .executor import JournalExecutor, in_journal
from ..state.config import Config
from ..state.decisionlog import DecisionLog, warn
from ..errors import SlurmagentError, SlurmError
from ..slurm.model import FAULT_FLUSH_SIGNAL, RunningJob
from ..slurm.commands import Slurm

FAULT_CLASSIFY_BUDGET_S = 5.0  # telling wrapped jobs from others: past this, the rest count as unwrapped


@dataclass
class JobLeave:
    """One job on a node whose GPU failed: what was done and, once it is off the node, when."""

    job: RunningJob
    wrapped: bool
    action: str
    left_after_s: float | None = None  # from the fault seen to the job off the node
    requeued_by: str = ""  # "slurmagent", "wrapper", or "" (not requeued)
    signalled_at: float | None = None  # the fault flush was signalled: followed until it left
    finished: bool = True  # nothing more to follow


@dataclass
class FaultEviction:
    """The jobs running on a node whose GPU just became unusable leave it at once.

    `start()` (right after the drain stood): one squeue for the node's jobs; a wrapped job gets
    the fault flush signal on its batch step (one scancel for all): its wrapper waits only
    briefly for the trainer, syncs and requeues; any other job is requeued (cancelled when not
    requeueable) through the journal, per `[watch] running_jobs`. `poll()` follows the flushed
    jobs (one squeue) until they left the node, and past `[watch] flush_deadline_s` requeues
    those still there. Each job gets a decision line (event `fault-evict`) when it is acted on
    and, when it was flushed, one more once it is off the node, with the time from the fault."""

    cfg: Config
    slurm: Slurm
    node: str
    fault_at: float  # time.monotonic() when the fault was seen
    source: str = "watch"
    reason: str = ""
    log: DecisionLog | None = None
    clock: Callable[[], float] = time.monotonic
    jobs: list[JobLeave] = field(default_factory=list)

    @property
    def executor(self) -> JournalExecutor:
        return JournalExecutor(self.cfg, self.slurm, self.node)

    @property
    def done(self) -> bool:
        return all(j.finished for j in self.jobs)

    def start(self, skip: Iterable[tuple[str, int]] = ()) -> list[JobLeave]:
        """Flush or requeue every job running on the node (but those in `skip`: (job, restarts)
        already handled). Raises SlurmError when the jobs cannot be listed."""
        skipped = set(skip)
        running = [j for j in self.slurm.running_jobs(self.node) if (j.job_id, j.restarts) not in skipped]
        wrapped = self._wrapped(running)
        flush = [j for j in running if j.job_id in wrapped]
        others = [j for j in running if j.job_id not in wrapped]
        if flush:
            try:
                self.executor.signal_jobs([j.job_id for j in flush], str(int(FAULT_FLUSH_SIGNAL)))
                now = self.clock()
                self.jobs += [JobLeave(j, True, "fault flush signalled", signalled_at=now, finished=False)
                              for j in flush]
            except SlurmError as exc:
                warn(f"{self.node}: cannot signal the fault flush to job(s) {','.join(j.job_id for j in flush)} "
                     f"({exc}); requeueing them instead")
                others += flush
        for job in others:
            self.jobs.append(self._leave(job, wrapped=job.job_id in wrapped, fresh=True))
        self._record(self.jobs)  # a flushed job gets a second line once it is off the node
        return list(self.jobs)

    def poll(self) -> list[JobLeave]:
        """Follow the flushed jobs: those off the node, and those requeued past the deadline,
        are returned (and logged). One squeue while any is outstanding."""
        waiting = [j for j in self.jobs if not j.finished]
        if not waiting:
            return []
        try:
            running = {j.job_id: j for j in self.slurm.running_jobs(self.node)}
        except SlurmError as exc:
            warn(f"{self.node}: cannot follow the fault flush of job(s) {','.join(j.job.job_id for j in waiting)}: {exc}")
            running = None
        finished = []
        for leave in waiting:
            now = self.clock()
            seen = leave.job
            if running is not None and (seen.job_id not in running or running[seen.job_id].restarts > seen.restarts):
                self._left(leave, now)
            elif now - (leave.signalled_at or now) >= float(self.cfg.watch.flush_deadline_s):
                done = self._leave(seen, wrapped=True, fresh=False)
                leave.action = "still on the node after the deadline: " + done.action
                leave.requeued_by, leave.left_after_s = done.requeued_by, done.left_after_s
            else:
                continue
            leave.finished = True
            finished.append(leave)
        self._record(finished)
        return finished

    def wait(self, poll_s: float = 0.5, sleep: Callable[[float], None] = time.sleep) -> list[JobLeave]:
        """Poll until every flushed job left or was requeued (the deadline bounds it)."""
        while not self.done:
            sleep(poll_s)
            self.poll()
        return list(self.jobs)

    # --- the steps ---

    def _wrapped(self, jobs: list[RunningJob]) -> set[str]:
        out: set[str] = set()
        end = self.clock() + FAULT_CLASSIFY_BUDGET_S
        for job in jobs:
            if self.clock() >= end:
                break  # a slow slurmctld: the rest are requeued, which is what the deadline would do
            try:
                if self.slurm.job_is_wrapped(job.job_id):
                    out.add(job.job_id)
            except SlurmError:
                pass
        return out

    def _leave(self, job: RunningJob, *, wrapped: bool, fresh: bool) -> JobLeave:
        """Requeue (or cancel) one job through the journal, or leave it per `running_jobs`."""
        if self.cfg.watch.running_jobs != "requeue":
            return JobLeave(job, wrapped, "left alone (running_jobs = leave)")
        try:
            outcome = self.executor.fault_requeue(job.job_id, job.restarts, fresh=fresh and job.requeue,
                                                  reason=self.reason)
        except (SlurmagentError, OSError) as exc:
            outcome = f"pending: {exc}"
        leave = JobLeave(job, wrapped, in_journal(outcome))
        if outcome == "requeued":
            leave.requeued_by, leave.left_after_s = "slurmagent", self.clock() - self.fault_at
        elif outcome.startswith("cancelled"):
            leave.left_after_s = self.clock() - self.fault_at
        return leave

    def _left(self, leave: JobLeave, now: float) -> None:
        """A flushed job is off the node: requeued by its wrapper, or ended (e.g. its requeue budget)."""
        leave.left_after_s = now - self.fault_at
        try:
            job = self.slurm.job(leave.job.job_id)
        except SlurmError:
            job = None
        if job is not None and job.restarts > leave.job.restarts:
            leave.requeued_by, leave.action = "wrapper", "flushed and requeued by its wrapper"
        else:
            leave.action = f"flushed, ended without a requeue ({job.state if job else 'gone'})"

    def _record(self, leaves: list[JobLeave]) -> None:
        add: dict[tuple[str, tuple], float] = {}
        last = None
        for leave in leaves:
            if leave.requeued_by:
                key = ("slurmagent_jobs_requeued_on_fault_total", (("by", leave.requeued_by),))
                add[key] = add.get(key, 0) + 1
            elif leave.action.startswith("cancelled"):
                key = ("slurmagent_jobs_cancelled_on_fault_total", ())
                add[key] = add.get(key, 0) + 1
            if leave.left_after_s is not None:
                last = leave.left_after_s
            if self.log is not None:
                self.log.write("fault-evict", node=self.node, source=self.source, job=leave.job.job_id,
                               restarts=leave.job.restarts, job_nodes=leave.job.num_nodes, wrapped=leave.wrapped,
                               action=leave.action, requeued_by=leave.requeued_by or None,
                               fault_to_leave_s=None if leave.left_after_s is None else round(leave.left_after_s, 3),
                               reason=self.reason or None)
        if add or last is not None:
            gauges = {("slurmagent_fault_to_leave_seconds", ()): last} if last is not None else {}
            metrics.for_node(self.cfg, self.node).update(set_=gauges, add=add)

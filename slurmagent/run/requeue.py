"""The wrapper's requeue of its own job, asked once the checkpoint is synced.

Three rules on top of `scontrol requeue`:

* a job that Slurm is ending is never requeued: a user's `scancel` (or its time limit, a
  node failure) shows as `JobState=COMPLETING` (measured on 22.05: the CANCELLED base state is
  hidden behind the flag) or a final state, with the restart count unchanged; Slurm would
  otherwise take the requeue of a cancelled job and run it again;
* a job that is already requeued is not requeued twice: its restart count went up (Slurm's own
  preemption requeue, an admin, a framework calling scontrol by its absolute path), Slurm 25.11+
  shows it EXPEDITING (an --requeue=expedite job it requeues itself), or scontrol says "Job is
  pending execution" (an earlier try went through although it timed out here);
* slurmctld down or restarting at that moment does not cost the job: the call is retried with
  backoff until the flush deadline, each wait said in one line; a refusal that cannot change
  (job not requeueable, unknown) is not retried. When the job cannot be read, a flush is a flush.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ..errors import SlurmError
from ..slurm.model import JobInfo
from ..slurm.commands import requeue_already_done, requeue_refused_for_good, retry_with_backoff

REQUEUE_MIN_S = 60.0  # the requeue may retry at least this long, even when the flush used its grace
# Job states (or flags: 24.11 may join them with `+`) that mean Slurm is ending the job or has
# requeued it; any other state (RUNNING, SUSPENDED, SIGNALING, one we do not know) is requeued.
ENDING_STATES = frozenset({
    "COMPLETING", "CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
    "DEADLINE", "OUT_OF_MEMORY", "STAGE_OUT", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "SPECIAL_EXIT",
    "REVOKED", "PENDING",
})


class JobEnding(SlurmError):
    """Slurm is ending the job: it must end, never be requeued."""


@dataclass(frozen=True)
class RequeueVerb:
    """What to ask: `requeue`, or `requeuehold [State=SpecialExit]` when the job's own held
    request asked for that (replayed once, after the final sync)."""

    hold: bool = False
    special_exit: bool = False

    def __str__(self) -> str:
        return ("requeuehold" + (" State=SpecialExit" if self.special_exit else "")) if self.hold else "requeue"


@dataclass(frozen=True)
class RequeueResult:
    requeued: bool
    why: str = ""  # refused: why not; requeued by someone else: by whom
    ending: bool = False  # Slurm is ending the job (scancel): not requeued on purpose


def judge_job(job: JobInfo | None, restart_count: int) -> tuple[str, str]:
    """("requeue" | "already" | "ending", why) from the job's record as Slurm shows it now."""
    if job is None or job.ambiguous or not job.state:
        return "requeue", ""
    if job.restarts > restart_count:
        return "already", (f"Slurm shows restart {job.restarts} (this attempt is {restart_count}): requeued already, "
                           "by Slurm, an admin or a scontrol outside the wrapper's hold")
    flags = set(job.state.replace(",", "+").split("+"))
    if "EXPEDITING" in flags:  # Slurm 25.11+: an --requeue=expedite job Slurm is requeueing itself
        return "already", f"Slurm is requeueing it itself (JobState={job.state}: an expedited requeue)"
    if flags & ENDING_STATES:
        return "ending", (f"Slurm is ending it (JobState={job.state}: cancelled with scancel, its time limit or "
                          "its node failed)")
    return "requeue", ""


def requeue_own_job(job_id: str, restart_count: int, requeue: Callable[[], None],
                    read_job: Callable[[], JobInfo | None] | None, deadline: float, say: Callable[[str], None],
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> RequeueResult:
    """Requeue job `job_id` once, by the rules above; `read_job` None: the state is unknown."""
    unreadable_said = tried = False

    def attempt() -> str:
        nonlocal unreadable_said, tried
        if read_job is not None:
            try:
                verdict, why = judge_job(read_job(), restart_count)
            except Exception as exc:  # noqa: BLE001 - an unreadable state never costs the requeue
                verdict, why = "requeue", ""
                if not unreadable_said:
                    unreadable_said = True
                    say(f"cannot read job {job_id} from Slurm ({exc}): requeueing it (a flush signal is a flush)")
            if verdict == "ending":
                raise JobEnding(why)
            if verdict == "already":
                return "" if tried else why  # after a try of ours that failed late (a timeout): ours took
        tried = True
        requeue()
        return ""

    try:
        how = retry_with_backoff(attempt, deadline, lambda e: isinstance(e, JobEnding) or requeue_refused_for_good(e),
                                 say, what=f"requeue of job {job_id}", clock=clock, sleep=sleep)
    except JobEnding as exc:
        return RequeueResult(False, str(exc), ending=True)
    except SlurmError as exc:
        if requeue_already_done(exc):
            return RequeueResult(True, "scontrol says it is PENDING again: requeued already")
        return RequeueResult(False, f"scontrol requeue failed: {exc}")
    return RequeueResult(True, how)

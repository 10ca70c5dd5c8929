"""One fault response for prolog/epilog, healthcheck and watch; one answer to our own failure.

A fault: the drain reason from the findings, the drain through the circuit breaker, then the
job's fate (the prolog keeps its job off and makes sure Slurm does not hold it; the epilog of a
failed job requeues it when `[hooks] epilog_requeue_failed`), and, when the GPU is unusable
under running jobs and our drain stands, their eviction (`eviction.py`). The callers keep what
is theirs: their decision-log event, their exit code, and when the eviction starts.

An internal error is said as `internal-error`, never as a GPU fault, and handled by `[hooks]
on_internal_error`: fail open (default), or closed: a drain through the breaker, so a bad
rollout cannot drain the cluster.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, TextIO

from ..core.checks import Report
from ..core.reasons import internal_error_reason, reason_for
from ..errors import SlurmagentError
from ..policy import eviction as eviction_policy
from ..slurm.commands import Slurm, valid_node_name
from ..state.config import Config
from ..state.decisionlog import DecisionLog
from .eviction import FaultEviction
from .executor import DrainOutcome, JournalExecutor


@dataclass
class FaultResponse:
    """What `respond_to_fault` did: the reason, the drain, and the actions taken for the job."""

    executor: JournalExecutor
    report: Report
    source: str
    reason: str
    drain: DrainOutcome
    job: str | None = None
    taken: list[str] = dataclasses.field(default_factory=list)  # the drain's outcome first

    @property
    def action(self) -> str:
        return ",".join(self.taken)

    @property
    def requeued(self) -> bool:
        return any(a.startswith("requeued") for a in self.taken)

    @property
    def evicts(self) -> bool:
        """Our drain stands and the GPU is unusable under a running job: the jobs leave now."""
        return self.drain.drained and eviction_policy.evicts_jobs(self.report.findings)

    def eviction(self, fault_at: float, log: DecisionLog | None, *,
                 flush_deadline_s: float | None = None) -> FaultEviction:
        """The eviction of the node's running jobs, not started (`start()` is the caller's)."""
        cfg = self.executor.cfg
        if flush_deadline_s is not None and flush_deadline_s != float(cfg.watch.flush_deadline_s):
            cfg = dataclasses.replace(cfg, watch=dataclasses.replace(cfg.watch, flush_deadline_s=flush_deadline_s))
        return FaultEviction(cfg, self.executor.slurm, self.executor.local_node, fault_at, source=self.source,
                             reason=self.reason, log=log)

    def write_decision(self, log: DecisionLog, **extra: Any) -> None:
        """The `unhealthy` decision line (event: the source)."""
        worst = self.report.worst
        log.write(self.source, node=self.executor.local_node, job=self.job, verdict="unhealthy", rule=worst.rule,
                  gpu=worst.gpu, observed=worst.observed, reason=self.reason, action=self.action, **extra,
                  findings=[f.summary for f in self.report.findings])


def respond_to_fault(executor: JournalExecutor, report: Report, *, source: str, job: str | None = None,
                     prolog: bool = False, failed_job_ended: bool = False,
                     drain_errors_stand: bool = False, verify_in_background: bool = False) -> FaultResponse:
    """Drain the executor's node for the findings of `report` (unhealthy), through the breaker.

    `prolog`: the job has not started; Slurm's "Prolog error" reason may be replaced, and when
    the drain keeps the job off it must end PENDING, not held. `failed_job_ended`: the epilog
    of a job that failed; it is requeued when `[hooks] epilog_requeue_failed`.
    `drain_errors_stand`: a drain that raised is an outcome (`drain-failed: ...`), not an error
    (the hooks: the GPU verdict stands and a failing prolog keeps the job off anyway).
    `verify_in_background`: see `JournalExecutor.drain_fault` (the real prolog sets it)."""
    reason = reason_for(report)
    try:
        drain = executor.drain_fault(reason, report.findings, source=source, job=job, takeover_prolog_error=prolog,
                                     verify_in_background=verify_in_background)
    except SlurmagentError as exc:
        if not drain_errors_stand:
            raise
        drain = DrainOutcome(f"drain-failed: {exc}")
    response = FaultResponse(executor, report, source, reason, drain, job, [drain.action])
    if prolog and drain.blocks_job and job:
        response.taken += executor.release_held(job)
    if failed_job_ended and job and executor.cfg.hooks.epilog_requeue_failed:
        try:
            response.taken.append(executor.requeue_jobs([job]))
        except SlurmagentError as exc:
            response.taken.append(f"requeue-failed: {exc}")
    return response


def internal_error(source: str, node: str, cfg: Config | None, log: DecisionLog, exc: BaseException,
                   slurm_factory: Callable[[Config], Slurm], stderr: TextIO, *, job: str | None = None,
                   may_fail_closed: bool = True) -> int:
    """slurmagent itself failed: say so distinctly, then fail open or closed per config; the exit code.

    Fail closed is an unplanned drain like a fault: through the circuit breaker. When the
    breaker holds it back, the job may run (a failing prolog would make Slurm drain the node
    anyway, and a bad rollout would drain the whole cluster). A node name that is not one is
    never handed to scontrol. `may_fail_closed`: False where failing closed keeps no job off
    (the epilog)."""
    what = str(exc) if isinstance(exc, SlurmagentError) else f"{type(exc).__name__}: {exc}"
    on_error = cfg.hooks.on_internal_error if cfg else "open"
    action, code = "none (fail open)", 0
    if cfg is not None and on_error == "closed" and may_fail_closed:
        if not valid_node_name(node):
            action, code = "no drain: invalid node name (fail closed)", 1
        else:
            blocked, action = _fail_closed(cfg, slurm_factory, node, what, source=source, job=job)
            code = 1 if blocked else 0
    log.write(source, node=node, job=job, verdict="internal-error", error=what, action=action)
    print(f"slurmagent {source}: internal error (not a GPU fault): {what}; {action}", file=stderr)
    return code


def _fail_closed(cfg: Config, slurm_factory: Callable[[Config], Slurm], node: str, what: str, *, source: str,
                 job: str | None = None) -> tuple[bool, str]:
    """`on_internal_error = "closed"`: (the node is kept from running jobs, action)."""
    try:
        drain = JournalExecutor(cfg, slurm_factory(cfg), node).drain_fault(internal_error_reason(what), source=source,
                                                                         job=job)
    except Exception as exc:  # noqa: BLE001 - already on the failure path: say it, keep the job off
        return True, f"drain (fail closed), drain failed: {exc}"
    if drain.suppressed:
        return False, f"drain (fail closed) {drain.action}: the job may run"
    if drain.action.startswith("drain-failed"):
        return True, f"drain (fail closed), {drain.action}"
    return True, "drain (fail closed)"

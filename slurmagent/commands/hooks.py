"""Slurm Prolog/Epilog: check the node, drain it with a precise reason, keep the job PENDING.

Decide first (the health report and the node's state), then act through the one fault
response (`actions/fault.py`, shared with `healthcheck` and `watch`). A failure of slurmagent
itself is logged as `internal-error`, distinct from `unhealthy`, and handled by `[hooks]
on_internal_error` (fail open by default; `closed` drains through the circuit breaker like any
unplanned drain, so a bad rollout cannot drain the cluster).

The healthy prolog path is the hot path: it imports no google library and no click, makes
no slurmctld call, and reads at most the expiry state file and the journal directory. The
modules it does not need are imported where they are used, for start-up speed.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TextIO

from ..state import expiry_state, metrics
from ..core.checks import Report
from ..state.config import Config
from ..state.decisionlog import DecisionLog, path_for as decision_log_path
from ..errors import SlurmagentError
from ..state.host import node_name
from ..slurm import env as slurm_env
from ..slurm.commands import JOB_ID, Slurm, valid_node_name
from ..core.timefmt import fmt_time, human, parse_time_limit

HealthFn = Callable[[Config, str, bool], Report]

@dataclass(frozen=True)
class HookContext:
    """What Slurm tells a hook about itself, from its environment."""
    hook: str  # "prolog" | "epilog" | "healthcheck"
    node: str
    job_id: str | None
    job_exit_code: int | None = None
    ignored: tuple[str, ...] = ()  # environment values refused as malformed (said on stderr)

    @classmethod
    def from_env(cls, hook: str, env: Mapping[str, str]) -> HookContext:
        node = node_name(None, env)
        ignored = []
        job_id = slurm_env.job_id(env, old_name=True)
        if job_id is not None and not JOB_ID.fullmatch(job_id):
            # never handed to scontrol: `42,7` would requeue job 7 too
            ignored.append(f"SLURM_JOB_ID {job_id!r}: not a job id")
            job_id = None
        code = slurm_env.job_exit_code(env)
        exit_code = int(code) if code and re.fullmatch(r"-?[0-9]{1,10}", code) else None
        if code and exit_code is None:
            ignored.append(f"SLURM_JOB_EXIT_CODE {code!r}: not a number")
        return cls(hook=hook, node=node, job_id=job_id, job_exit_code=exit_code, ignored=tuple(ignored))


def run_hook(
    ctx: HookContext,
    cfg_loader: Callable[[], Config],
    health: HealthFn,
    slurm_factory: Callable[[Config], Slurm] = Slurm.from_config,
    stderr: TextIO = sys.stderr,
    verify_in_background: bool = False,
) -> int:
    """Entry point of `slurmagent prolog|epilog`; returns the hook's exit code.
    `verify_in_background`: see `JournalExecutor.drain_fault` (the real prolog sets it)."""
    started = time.monotonic()
    cfg: Config | None = None
    log = DecisionLog(None, use_syslog=True)
    try:
        cfg = cfg_loader()
        log = DecisionLog(None, use_syslog=cfg.hooks.syslog)
        if not valid_node_name(ctx.node):  # before it names a path or reaches scontrol
            raise SlurmagentError(f"SLURMD_NODENAME {ctx.node!r} is not a Slurm node name; refusing to act on it")
        for note in ctx.ignored:
            print(f"slurmagent {ctx.hook}: ignoring {note}", file=stderr)
        log = DecisionLog(decision_log_path(cfg, ctx.node), use_syslog=cfg.hooks.syslog)
        log.started = started
        report = health(cfg, ctx.node, True)
        if report.healthy:
            return _healthy(ctx, cfg, report, slurm_factory, log, stderr)
        return _unhealthy(ctx, cfg, report, slurm_factory, log, stderr, verify_in_background)
    except Exception as exc:  # noqa: BLE001 - a hook must never crash without a decision
        return _internal_error(ctx, cfg, log, exc, slurm_factory, stderr)


def _healthy(ctx: HookContext, cfg: Config, report: Report, slurm_factory: Callable[[Config], Slurm],
             log: DecisionLog, stderr: TextIO) -> int:
    # A job whose time limit ends after the VM's termination is requeued off this node.
    if ctx.hook == "prolog":
        guard = prolog_guard(cfg, ctx, slurm_factory, log, stderr)
        if guard is not None:
            return guard
    warnings = [f.summary for f in report.findings]
    log.write(ctx.hook, node=ctx.node, job=ctx.job_id, verdict="healthy", action="none", warnings=warnings or None)
    metrics.for_node(cfg, ctx.node).record_check(report, drop=_ended_job_series(ctx), component=ctx.hook)
    from ..state.journal import needs_attention  # stdlib only; imported here for start-up speed

    if needs_attention(cfg.state_path(ctx.node)):  # replay a non-empty journal, clear a breaker mark
        from ..actions.executor import after_healthy_hook  # the replay path only, for start-up speed

        after_healthy_hook(cfg, ctx.node, slurm_factory)
    return 0


def _unhealthy(ctx: HookContext, cfg: Config, report: Report, slurm_factory: Callable[[Config], Slurm],
               log: DecisionLog, stderr: TextIO, verify_in_background: bool = False) -> int:
    from ..actions.executor import JournalExecutor  # the unhealthy path only, for start-up speed
    from ..actions.fault import respond_to_fault  # the unhealthy path only, for start-up speed

    # The GPU verdict stands when the drain fails: a failing prolog still makes Slurm drain the
    # node and requeue the job; failing open here would run the job on a known-bad GPU.
    response = respond_to_fault(JournalExecutor(cfg, slurm_factory(cfg), ctx.node), report, source=ctx.hook,
                                job=ctx.job_id, prolog=ctx.hook == "prolog",
                                failed_job_ended=ctx.hook == "epilog" and bool(ctx.job_exit_code),
                                drain_errors_stand=True,
                                verify_in_background=verify_in_background and ctx.hook == "prolog")
    # the prolog with the breaker open and the GPUs still usable: not drained, the job may run (logged loudly);
    # else Slurm requeues the job (PENDING with nohold_on_prolog_fail) and keeps our reason
    code = 1 if ctx.hook == "prolog" and response.drain.blocks_job else 0
    response.write_decision(log)
    metrics.for_node(cfg, ctx.node).record_check(
        report, drained_rule=report.worst.rule if response.drain.drained else None, requeued=response.requeued,
        drop=_ended_job_series(ctx), component=ctx.hook)
    print(f"slurmagent {ctx.hook}: node {ctx.node} unhealthy: {response.reason}", file=stderr)
    return code


def _ended_job_series(ctx: HookContext) -> tuple[str, ...]:
    """The epilog (root, every node of the job, however it ended: cancelled, killed, requeued)
    removes the job's own series from the node's textfile, in the check's own write: a wrapper
    killed before it cleared them leaves no stale `{job_id="N"}` gauge (nor an old `{job="N"}`). A requeued job's next
    attempt sets them again."""
    if ctx.hook != "epilog" or not ctx.job_id:
        return ()
    from ..policy.job_requests import PER_JOB, job_series  # the epilog only: start-up speed

    return job_series(PER_JOB, ctx.job_id)


def _internal_error(ctx: HookContext, cfg: Config | None, log: DecisionLog, exc: BaseException,
                    slurm_factory: Callable[[Config], Slurm], stderr: TextIO) -> int:
    from ..actions.fault import internal_error  # the failure path only, for start-up speed

    return internal_error(ctx.hook, ctx.node, cfg, log, exc, slurm_factory, stderr, job=ctx.job_id,
                          may_fail_closed=ctx.hook == "prolog")


# --- the expiry prolog guard ---------------------------------------------------------------


def prolog_guard(cfg: Config, ctx: HookContext, slurm_factory: Callable[[Config], Slurm], log: Any,
                 stderr: TextIO) -> int | None:
    """Keep a job that would outlive the VM off this node. None: let the job run; 1: requeue it.

    When the expiry state has a termination time, a job whose time limit would end after
    `termination - flush_lead_s` is kept off: the node is drained with the expiry reason
    (planned: the breaker has no say) and the prolog exits 1, Slurm requeues the job PENDING
    and it starts elsewhere. `requeue` does this for jobs that cannot flush (their batch script
    does not exec the wrapper); `requeue-all` for every job; `warn` only logs; `off`.
    Without a termination time this is one read of the state file: no scontrol, no google."""
    mode = cfg.expiry.prolog_guard
    if mode == "off" or not ctx.job_id:
        return None
    data = expiry_state.load(cfg, ctx.node)
    if not data or not data.get("termination_time"):
        return None
    end = expiry_state.termination(data)  # None: left over from an earlier life of this VM
    if end is None:
        return None
    # the guard's slow path only, for start-up speed
    from ..actions.executor import JournalExecutor
    from ..core import reasons

    now = time.time()
    slurm = slurm_factory(cfg)
    try:
        job = slurm.job(ctx.job_id)
        limit_s = parse_time_limit(job.time_limit) if job is not None else None
    except (SlurmagentError, ValueError) as exc:
        log.write(ctx.hook, node=ctx.node, job=ctx.job_id, verdict="healthy", rule="expiry",
                  action="expiry-guard-skipped", error=str(exc))
        return None
    if job is None:
        return None
    latest = end.timestamp() - float(cfg.expiry.flush_lead_s)
    if limit_s is not None and now + limit_s <= latest:
        return None
    # a record whose own text imitates its fields has no time limit we may believe: the long case
    limit = "unknown (the job's text imitates Slurm's fields)" if job.ambiguous else job.time_limit or "UNLIMITED"
    detail = (f"job {ctx.job_id}: time limit {limit} ends after the VM's termination at {fmt_time(end)} "
              f"(in {human(end.timestamp() - now)}, flush lead {float(cfg.expiry.flush_lead_s):g} s)")
    if mode == "requeue" and _wrapped(slurm, ctx.job_id):
        # it flushes at the lead and resumes elsewhere: cheaper than idling the node
        log.write(ctx.hook, node=ctx.node, job=ctx.job_id, verdict="healthy", rule="expiry",
                  action="none (wrapped: flushes at the lead)", detail=detail)
        return None
    if mode == "warn":
        log.write(ctx.hook, node=ctx.node, job=ctx.job_id, verdict="healthy", rule="expiry", action="warned",
                  detail=detail)
        print(f"slurmagent {ctx.hook}: warning: {detail}", file=stderr)
        return None
    drain_reason = str(data.get("drain_reason", ""))
    reason = drain_reason if reasons.is_planned(drain_reason) else reasons.expiry_reason(
        end, "expiry", str((data.get("scheduling") or {}).get("provisioning_model", "")))
    executor = JournalExecutor(cfg, slurm, ctx.node)
    try:
        action = executor.drain_planned(reason, source="prolog-guard")
    except SlurmagentError as exc:
        action = f"drain-failed: {exc}"  # exit 1 all the same: Slurm drains ("Prolog error") and requeues
    taken = [action, "requeue", *executor.release_held(ctx.job_id)]
    log.write(ctx.hook, node=ctx.node, job=ctx.job_id, verdict="expiry", rule="expiry", reason=reason,
              action=",".join(taken), detail=detail)
    print(f"slurmagent {ctx.hook}: {detail}: requeued off {ctx.node} ({reason})", file=stderr)
    return 1


def _wrapped(slurm: Slurm, job_id: str) -> bool:
    try:
        return slurm.job_is_wrapped(job_id)
    except SlurmagentError:
        return False

"""Slurm Prolog/Epilog: check the node, drain it with a precise reason, keep the job PENDING.

Decide first (a pure `HookDecision` from the report and the node's state), then act. A
failure of slurmagent itself is logged as `internal-error`, distinct from `unhealthy`,
and handled by `[hooks] on_internal_error` (fail open by default).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from . import metrics
from .checks import Report
from .config import Config
from .decisionlog import DecisionLog
from .errors import SlurmagentError
from .slurm import JOB_ID, Slurm, conf_value, make_reason, read_conf_lines, slurm_conf_path, valid_node_name

HealthFn = Callable[[Config, str, bool], Report]


@dataclass(frozen=True)
class HookContext:
    hook: str  # "prolog" | "epilog" | "healthcheck"
    node: str
    job_id: str | None
    job_exit_code: int | None = None
    ignored: tuple[str, ...] = ()  # environment values refused as malformed (said on stderr)

    @classmethod
    def from_env(cls, hook: str, env: Mapping[str, str]) -> HookContext:
        node = env.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]
        ignored = []
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if job_id is not None and not JOB_ID.fullmatch(job_id):
            # never handed to scontrol: `42,7` would requeue job 7 too
            ignored.append(f"SLURM_JOB_ID {job_id!r}: not a job id")
            job_id = None
        code = env.get("SLURM_JOB_EXIT_CODE")
        exit_code = int(code) if code and re.fullmatch(r"-?[0-9]{1,10}", code) else None
        if code and exit_code is None:
            ignored.append(f"SLURM_JOB_EXIT_CODE {code!r}: not a number")
        return cls(hook=hook, node=node, job_id=job_id, job_exit_code=exit_code, ignored=tuple(ignored))


def reason_for(report: Report) -> str:
    worst = report.worst
    assert worst is not None
    return make_reason_from_summary(worst.summary)


def make_reason_from_summary(summary: str) -> str:
    rule, sep, detail = summary.partition(": ")
    return make_reason(rule, detail) if sep else make_reason(summary, "")


def drain_unless_other(slurm: Slurm, node: str, reason: str) -> str:
    """Drain with our reason unless an admin (or Slurm) already holds the node: their reason wins."""
    info = slurm.node(node)
    if info.drained_by_other:
        return "kept-admin-drain"
    if info.drained_by_slurmagent and info.reason == reason:
        return "already-drained"
    slurm.drain([node], reason)
    return "drained"


def run_hook(
    ctx: HookContext,
    cfg_loader: Callable[[], Config],
    health: HealthFn,
    slurm_factory: Callable[[Config], Slurm] = Slurm.from_config,
    stderr=sys.stderr,
) -> int:
    """Entry point of `slurmagent prolog|epilog`; returns the hook's exit code."""
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
            # --- issue 5: expiry prolog guard (slurmagent/expiry.py) ---------------------------
            # A job whose time limit ends after the VM's termination is requeued off this node.
            # No termination time: one read of <state_dir>/expiry.json, no scontrol, no google.
            if ctx.hook == "prolog":
                from .expiry import prolog_guard

                guard = prolog_guard(cfg, ctx, slurm_factory, log, stderr)
                if guard is not None:
                    return guard
            # --- end issue 5 -------------------------------------------------------------------
            warnings = [f.summary for f in report.findings]
            log.write(ctx.hook, node=ctx.node, job=ctx.job_id, verdict="healthy", action="none",
                      warnings=warnings or None)
            metrics.for_node(cfg, ctx.node).record_check(report)
            from .journal import needs_attention  # replay a non-empty journal (issue 4)

            if needs_attention(cfg.state_path(ctx.node)):
                from .repair import after_healthy_hook

                after_healthy_hook(cfg, ctx.node, slurm_factory)
            return 0
        reason = reason_for(report)
        slurm = slurm_factory(cfg)
        from . import repair  # journaled drain through the circuit breaker (issue 4)

        try:
            drain = repair.hook_drain(cfg, slurm, ctx, reason, report)
        except SlurmagentError as exc:
            # The GPU verdict stands: a failing prolog still makes Slurm drain the node and requeue
            # the job; failing open here would run the job on a known-bad GPU.
            drain = repair.DrainOutcome(f"drain-failed: {exc}")
        actions = [drain.action]
        if ctx.hook == "prolog" and not drain.blocks_job:
            code = 0  # breaker open, GPUs still usable: not drained, the job may run (logged loudly)
        elif ctx.hook == "prolog":
            if ctx.job_id and not _nohold_configured(cfg):
                _spawn_release_watch(ctx.job_id, cfg)
                repair.journal_release(cfg, ctx.node, ctx.job_id)
                actions.append("release-watch")
            code = 1  # Slurm requeues the job (PENDING with nohold_on_prolog_fail) and keeps our reason
        else:
            code = 0
            if ctx.hook == "epilog" and ctx.job_id and cfg.hooks.epilog_requeue_failed and ctx.job_exit_code:
                try:
                    actions.append(repair.journaled_requeue(cfg, slurm, ctx.node, [ctx.job_id]))
                except SlurmagentError as exc:
                    actions.append(f"requeue-failed: {exc}")
        worst = report.worst
        log.write(ctx.hook, node=ctx.node, job=ctx.job_id, verdict="unhealthy", rule=worst.rule, gpu=worst.gpu,
                  observed=worst.observed, reason=reason, action=",".join(actions),
                  findings=[f.summary for f in report.findings])
        metrics.for_node(cfg, ctx.node).record_check(
            report, drained_rule=worst.rule if drain.drained else None,
            requeued=any(a.startswith("requeued") for a in actions))
        print(f"slurmagent {ctx.hook}: node {ctx.node} unhealthy: {reason}", file=stderr)
        return code
    except Exception as exc:  # noqa: BLE001 - a hook must never crash without a decision
        return _internal_error(ctx, cfg, log, exc, slurm_factory, stderr)


def _internal_error(ctx, cfg, log, exc, slurm_factory, stderr) -> int:
    """slurmagent itself failed: say so distinctly, then fail open or closed per config."""
    what = str(exc) if isinstance(exc, SlurmagentError) else f"{type(exc).__name__}: {exc}"
    policy = cfg.hooks.on_internal_error if cfg else "open"
    action = "none (fail open)"
    code = 0
    if policy == "closed" and ctx.hook == "prolog" and not valid_node_name(ctx.node):
        code = 1
        action = "no drain: invalid node name (fail closed)"
    elif policy == "closed" and ctx.hook == "prolog":
        code = 1
        action = "drain (fail closed)"
        try:
            drain_unless_other(slurm_factory(cfg), ctx.node, make_reason("internal error", what))
        except Exception as drain_exc:  # noqa: BLE001
            action += f", drain failed: {drain_exc}"
    log.write(ctx.hook, node=ctx.node, job=ctx.job_id, verdict="internal-error", error=what, action=action)
    print(f"slurmagent {ctx.hook}: internal error (not a GPU fault): {what}; {action}", file=stderr)
    return code


def decision_log_path(cfg: Config, node: str):
    if cfg.hooks.log_file:
        from pathlib import Path

        return Path(cfg.node_path(cfg.hooks.log_file, node))
    return cfg.state_path(node) / "hooks.log"


def _nohold_configured(cfg: Config) -> bool:
    params = conf_value(read_conf_lines(slurm_conf_path(cfg.slurm.conf)), "SchedulerParameters") or ""
    return "nohold_on_prolog_fail" in params.split(",")


def _spawn_release_watch(job_id: str, cfg: Config) -> None:
    """Without nohold_on_prolog_fail Slurm requeues the job held: release it once it is."""
    argv = [sys.executable, "-m", "slurmagent.cli", "release-held", job_id]
    env = dict(os.environ)
    subprocess.Popen(argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


def release_when_held(slurm: Slurm, job_id: str, deadline_s: float = 60.0, interval_s: float = 0.5) -> bool:
    """Poll until the job shows up requeued-held, then release it; give up at the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        job = slurm.job(job_id)
        if job is None:
            return False
        if job.held:
            slurm.release([job_id])
            return True
        if job.state in ("RUNNING", "COMPLETED", "CANCELLED", "FAILED"):
            if job.state != "RUNNING" or job.restarts > 0:
                return False
        time.sleep(interval_s)
    return False

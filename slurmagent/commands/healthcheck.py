"""`slurmagent healthcheck`: Slurm's HealthCheckProgram, the check between jobs.

slurmd runs it every HealthCheckInterval seconds (as root, with SLURMD_NODENAME set). It
runs the same checks as the Prolog and drains the node on failure; it never resumes a node
(resuming is `resume-if-healthy` and repair's business). When a Prolog/Epilog decision for
this node was logged within the last `skip_recent_s` seconds and found it healthy, the node
was just checked: it exits 0 at once, without touching NVML. After an unhealthy verdict
(of any check, the watch's too) it checks again: an admin may have resumed the node at once.

When the verdict leaves a GPU unusable under a running job (``eviction_policy.evicts_jobs``: GPU lost or
missing, NVML down, an XID asking for a GPU reset or a node reboot) and our drain stands, the
jobs running on the node leave it at once, as with `watch` (``eviction.FaultEviction``); the
check then follows the flushed ones for at most `FOLLOW_MAX_S` (slurmd gives a health check
a minute) before it requeues those still on the node.

Exit status: 0 healthy (or skipped, or slurmagent itself failed: fail open, said loudly),
1 unhealthy.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, TextIO

from ..actions.executor import JournalExecutor
from ..actions.fault import FaultResponse, internal_error, respond_to_fault
from ..state import metrics
from ..core.checks import Report
from ..state.config import Config
from ..state.decisionlog import DecisionLog, path_for as decision_log_path
from ..errors import SlurmagentError
from ..state.fsutil import UntrustedFile, open_state_file
from ..slurm.commands import Slurm
from ..core.timefmt import parse_log_time

TAIL_BYTES = 64 * 1024
RECENT_EVENTS = ("prolog", "epilog")
FOLLOW_MAX_S = 30.0  # the flushed jobs' deadline here: slurmd kills a health check after 60 s (check + drain first)

HealthFn = Callable[[Config, str, bool], Report]


def skip_recent_s(cfg: Config) -> float:
    return cfg.health.healthcheck_skip_s


def recent_decision(log_path: Path, node: str, within_s: float, now: float | None = None) -> dict | None:
    """The newest healthy prolog/epilog decision for `node` logged within `within_s`, if any and
    if no unhealthy verdict for the node came after it (a node resumed by an admin right after
    an unhealthy verdict is checked again, not skipped).

    Reads only the file's tail, and nothing at all when the file is older than the window."""
    if within_s <= 0:
        return None
    now = time.time() if now is None else now
    try:
        fd = open_state_file(log_path)  # as root: a log a user could have forged never skips a check
    except UntrustedFile as exc:
        print(f"slurmagent healthcheck: not skipping on {log_path}: {exc.why()}", file=sys.stderr)
        return None
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if now - st.st_mtime > within_s:
            return None
        tail = os.pread(fd, TAIL_BYTES, max(0, st.st_size - TAIL_BYTES))
    except OSError:
        return None
    finally:
        os.close(fd)
    for raw in reversed(tail.splitlines()):
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        when = parse_log_time(record.get("time"))
        if when is None:
            continue
        if now - when > within_s:
            return None  # lines are in time order: nothing newer further up
        if record.get("node") != node:
            continue
        if record.get("verdict") not in (None, "healthy"):
            return None  # the newest verdict is a fault or checked nothing (an internal error): look
        if record.get("event") in RECENT_EVENTS and record.get("verdict") == "healthy":
            return record
    return None


def run_healthcheck(
    node: str,
    cfg_loader: Callable[[], Config],
    health: HealthFn | None = None,
    slurm_factory: Callable[[Config], Slurm] = Slurm.from_config,
    *,
    skip_recent: float | None = None,
    stderr: TextIO = sys.stderr,
) -> int:
    started = time.monotonic()
    cfg: Config | None = None
    log = DecisionLog(None, use_syslog=True)
    try:
        cfg = cfg_loader()
        log_path = decision_log_path(cfg, node)
        log = DecisionLog(log_path, use_syslog=cfg.hooks.syslog)
        log.started = started
        window = skip_recent_s(cfg) if skip_recent is None else skip_recent
        recent = recent_decision(log_path, node, window)
        if recent is not None:
            metrics.for_node(cfg, node).heartbeat("healthcheck")  # it ran: its heartbeat stays fresh on a busy node
            return 0  # checked moments ago by a Prolog/Epilog: no NVML read, no log line
        if health is None:
            from .health import evaluator  # NVML and the checks: only past the skip, for start-up speed

            health = evaluator("healthcheck")
        report = health(cfg, node, True)
        if report.healthy:
            warnings = [f.summary for f in report.findings]
            log.write("healthcheck", node=node, verdict="healthy", action="none", warnings=warnings or None)
            metrics.for_node(cfg, node).record_check(report, component="healthcheck")
            return 0
        response = respond_to_fault(JournalExecutor(cfg, slurm_factory(cfg), node), report, source="healthcheck")
        moved = _evict(response, log, started, stderr) if response.evicts else None
        action = response.drain.action
        metrics.for_node(cfg, node).record_check(report, drained_rule=report.worst.rule if action.startswith("drained") else None,
                                                 component="healthcheck")
        response.write_decision(log, running_jobs=moved)
        print(f"slurmagent healthcheck: node {node} unhealthy: {response.reason} ({action})", file=stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - say "slurmagent failed", never "GPU unhealthy"
        return internal_error("healthcheck", node, cfg, log, exc, slurm_factory, stderr)


def _evict(response: FaultResponse, log: DecisionLog, fault_at: float, stderr: TextIO) -> str:
    """The running jobs leave the node (flushed ones followed for at most FOLLOW_MAX_S)."""
    follow = min(float(response.executor.cfg.watch.flush_deadline_s), FOLLOW_MAX_S)
    eviction = response.eviction(fault_at, log, flush_deadline_s=follow)
    node = response.executor.local_node
    try:
        leaves = eviction.wait() if eviction.start() else []
    except SlurmagentError as exc:
        print(f"slurmagent healthcheck: cannot make the running jobs leave {node}: {exc}", file=stderr)
        return f"running jobs not moved: {exc}"
    for leave in leaves:
        print(f"slurmagent healthcheck: job {leave.job.job_id} on a failed GPU: {leave.action}", file=stderr)
    return f"{len(leaves)} running job(s) off the node" if leaves else "no running jobs"

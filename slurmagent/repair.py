"""`slurmagent repair` and `slurmagent resume-if-healthy`: the repair loop's commands.

* `repair`: replay the journal, read the nodes once, plan (`policy.plan_repair`: what to
  repair, skip or refuse; the breaker holds repairs back while it is open), then one
  `instances.get` per node not yet in the MIG cache and ONE `recreateInstances` per MIG (or
  `reportHostAsFaulty` per node), with the nodes' reasons switched to
  `slurmagent: repairing: ...` first so a second run does not ask twice. What is sent and
  how it is undone on failure is `actions.py`'s.
* `resume-if-healthy`: at boot, once slurmd of this boot has registered, resume the node if
  it is healthy and drained by slurmagent; drain it (through the breaker) if it is not.

No google module is imported here at start-up: the repair path imports `gcp/compute.py`.
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

from . import actions, hostlist, policy, reasons
from .actions import Actions
from .config import Config
from .decisionlog import warn
from .errors import SlurmagentError, SlurmError
from .host import boot_time, node_name
from .journal import Entry
from .nodes import NodeInfo
from .repair_state import load_state, remember_drained_at, save_state
from .slurm import Slurm

RESUME_POLL_S = 2.0  # resume-if-healthy: how often to ask whether slurmd has registered
BOOT_SLACK_S = 60.0  # slurmd registered this long before our boot time still counts as this boot


@dataclass
class RepairResult:
    ok: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    compute_calls: int = 0

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


def entry_target(entry: Entry) -> str:
    """What a journal entry acts on, for a one-line report."""
    p = entry.payload
    if "node" in p:
        return p["node"]
    if "nodes" in p:
        return hostlist.compress(list(p["nodes"]))
    if "job_ids" in p:
        return "job " + ",".join(map(str, p["job_ids"]))
    if "job_id" in p:
        return f"job {p['job_id']}"
    return ""


def run_repair(cfg: Config, names: list[str], *, dry_run: bool = False, force: bool = False,
               out: TextIO = sys.stdout, err: TextIO = sys.stderr, slurm: Slurm | None = None,
               compute_factory: Callable[[str], Any] | None = None, local_node: str | None = None,
               clock: Callable[[], float] = time.time) -> RepairResult:
    slurm = slurm or Slurm.from_config(cfg)
    rt = Actions(cfg, slurm, local_node, clock=clock, compute_factory=compute_factory)
    res = RepairResult()
    if not dry_run:
        for entry, outcome in rt.replay():
            print(f"journal: replayed {entry.kind} {entry_target(entry)}: {outcome}", file=out)
    nodes = slurm.nodes()
    now = clock()
    b = policy.breaker(nodes, rt.fraction, now, float(cfg.repair.suppressed_ttl_s))
    state = load_state(rt.state_dir)
    plan = policy.plan_repair(nodes, names, force=force, breaker_state=b, now=now,
                              retry_after_s=float(cfg.repair.retry_after_s),
                              history=state.get("history", {}), max_per_day=int(cfg.repair.max_repairs_per_day))
    for name, why in plan.refused.items():
        print(f"{name}: refused: {why}", file=err)
        res.failed[name] = f"refused: {why}"
    for name, why in plan.skipped.items():
        print(f"{name}: skipped: {why}", file=out)
        res.skipped[name] = why
    if plan.suppressed:
        warn(f"CIRCUIT BREAKER {b.describe()}: repair of {hostlist.compress(plan.suppressed)} suppressed "
             "(`slurmagent repair --force` overrides)")
        for name in plan.suppressed:
            res.skipped[name] = "suppressed by the circuit breaker"
        return res
    if not plan.todo:
        if not names and not plan.skipped:
            print("nothing to repair: no node is drained by slurmagent", file=out)
        return res
    strategy = cfg.repair.strategy
    by_name = {n.name: n for n in nodes}
    reason_of = {n: by_name[n].reason for n in plan.todo}
    if not dry_run:
        _force_drains(rt, plan, by_name, reason_of, res, out)
    if strategy == "none":
        for name in plan.todo:
            print(f"{name}: drained only ([repair] strategy = none): {reason_of[name]}", file=out)
            res.skipped[name] = "strategy none"
        return res
    migs = state.get("migs", {})
    if dry_run:
        for name in plan.todo:
            print(policy.dry_run_line(name, strategy, migs.get(name), name in plan.needs_drain, by_name[name].reason),
                  file=out)
            res.ok[name] = "dry-run"
        return res
    _send_repairs(cfg, rt, plan.todo, by_name, reason_of, migs, res, out, err)
    return res


def _force_drains(rt: Actions, plan: policy.RepairPlan, by_name: dict[str, NodeInfo], reason_of: dict[str, str],
                  res: RepairResult, out: TextIO) -> None:
    """--force on a node the breaker kept from draining: drain it now, with its fault."""
    for name in list(plan.needs_drain):
        fault = by_name[name].marks.suppressed_summary or "unhealthy (breaker override)"
        reason_of[name] = reasons.clean_reason(f"{reasons.PREFIX} {fault}")
        outcome = actions.drain_fault(rt.cfg, rt.slurm, name, reason_of[name], source="repair --force", force=True,
                                      takeover_prolog_error=True, lock_wait_s=actions.REPLAY_DEADLINE_S, runner=rt)
        print(f"{name}: {outcome.action} (--force)", file=out)
        if not outcome.action.startswith("drained"):
            plan.todo.remove(name)
            res.failed[name] = f"could not drain it: {outcome.action}"


def _send_repairs(cfg: Config, rt: Actions, todo: list[str], by_name: dict[str, NodeInfo], reason_of: dict[str, str],
                  migs: dict[str, Any], res: RepairResult, out: TextIO, err: TextIO) -> None:
    from .gcp import metadata  # google-free; imported on the repair path only, for start-up speed
    from .gcp.compute import ComputeError  # google is imported on the repair path only

    strategy = cfg.repair.strategy
    try:
        project, zone = metadata.project_and_zone(cfg)
    except SlurmagentError as exc:
        for name in todo:
            res.failed[name] = str(exc)
        print(f"repair: {exc}", file=err)
        return
    compute = rt.compute(project)
    calls_before = getattr(compute, "total_calls", 0)

    # Which MIG holds each node (cache, else instances.get).
    targets: dict[str, dict[str, Any]] = {}
    for name in todo:
        known = policy.known_target(strategy, migs.get(name), zone)
        if known is not None:
            targets[name] = known
            continue
        try:
            mig = compute.instance_mig(zone, name)
        except ComputeError as exc:
            res.failed[name] = f"instances.get: {exc}"
            print(f"{name}: FAILED: cannot find its VM: {exc}", file=err)
            continue
        if mig is None:
            res.failed[name] = "not created by a managed instance group: cannot recreate it"
            print(f"{name}: FAILED: VM {name} in {zone} has no created-by MIG: cannot recreate it", file=err)
            continue
        targets[name] = migs[name] = {"zone": zone, "mig": mig.to_dict()}
    _save_migs(rt, migs)

    payloads = policy.repair_requests(targets, strategy, reason_of, project, float(cfg.repair.operation_timeout_s),
                                      lambda: str(uuid.uuid4()))
    # the reason's own time is about to change: keep when each node was drained, for `status`
    drained_at = {n: t for n, t in load_state(rt.state_dir).get("drained_at", {}).items()
                  if n in by_name and by_name[n].ours}
    for p in payloads:
        for n in p["nodes"]:
            if by_name[n].reason_time and not by_name[n].repairing:
                drained_at.setdefault(n, by_name[n].reason_time)
    remember_drained_at(rt.state_dir, drained_at)
    try:
        entries = actions.begin_repairs(rt, payloads)
    except SlurmError as exc:
        for p in payloads:
            for n in p["nodes"]:
                res.failed[n] = f"cannot mark it repairing: {exc}"
                print(f"{n}: FAILED: cannot mark it repairing: {exc}", file=err)
        entries = []
    for entry in entries:
        p = entry.payload
        members = sorted(p["nodes"])
        try:
            ops = actions.finish_repair(rt, entry, compute)
        except ComputeError as exc:
            if exc.status in (400, 404):
                for n in members:
                    migs.pop(n, None)  # the VM or MIG moved: look it up afresh next time
            for n in members:
                res.failed[n] = str(exc)
                print(f"{n}: FAILED: {exc}", file=err)
            continue
        what = (f"recreate requested via MIG {policy.mig_short(p['mig'])}" if strategy == "recreate"
                else "reported host as faulty")
        for n in members:
            res.ok[n] = what
            print(f"{n}: {what} (operation {', '.join(o.name for o in ops)})", file=out)
    _save_migs(rt, migs)
    res.compute_calls = getattr(compute, "total_calls", 0) - calls_before


def _save_migs(rt: Actions, migs: dict[str, Any]) -> None:
    state = load_state(rt.state_dir)
    state["migs"] = migs
    save_state(rt.state_dir, state)


# --- `slurmagent resume-if-healthy` -------------------------------------------------------


def wait_registered(slurm: Slurm, node: str, deadline_s: float, poll_s: float = RESUME_POLL_S,
                    booted: float | None = None) -> NodeInfo:
    """Until slurmctld knows the node as up (not DOWN/NOT_RESPONDING/UNKNOWN) and, when we
    know this machine's boot time, registered by a slurmd of this boot."""
    end = time.monotonic() + deadline_s
    last: NodeInfo | None = None
    last_err = ""
    while True:
        try:
            found = [n for n in slurm.nodes([node]) if n.name == node]
            if not found:
                raise SlurmagentError(f"{node}: no such node in Slurm")
            last = found[0]
            slurm_boot = last.boot_time
            boot_ok = booted is None or slurm_boot is None or slurm_boot >= booted - BOOT_SLACK_S
            if last.registered and boot_ok:
                return last
        except SlurmError as exc:
            last_err = str(exc)
        if time.monotonic() + poll_s > end:
            state = last.state if last else f"unknown ({last_err})"
            raise SlurmError(f"{node}: slurmd has not registered with slurmctld within {deadline_s:g} s "
                             f"(state {state})")
        time.sleep(poll_s)


def run_resume_if_healthy(cfg: Config, node: str | None = None, *, out: TextIO = sys.stdout,
                          slurm: Slurm | None = None, health: Callable | None = None,
                          wait_s: float | None = None) -> int:
    node = node_name(node)
    slurm = slurm or Slurm.from_config(cfg)
    rt = Actions(cfg, slurm, node)
    rt.replay()
    view = wait_registered(slurm, node, float(wait_s if wait_s is not None else cfg.repair.resume_wait_s),
                           RESUME_POLL_S, boot_time())
    if health is None:
        from .health import evaluate as health  # the checks only when this command runs: start-up speed
    report = health(cfg, node, True)
    if report.healthy:
        if view.ours:
            outcome = actions.resume(cfg, slurm, node, view.reason)
            print(f"{node}: healthy; {outcome} (was: {view.reason})", file=out)
            return 0 if not outcome.startswith("pending") else 1
        if view.held_by_other:
            print(f"{node}: healthy; drained by someone else ({view.reason or view.state}): left alone", file=out)
            return 0
        if view.marks.suppressed_at is not None:
            rt.clear_suppressed_mark(node)
        print(f"{node}: healthy; nothing to do ({view.state})", file=out)
        return 0
    reason = reasons.reason_for(report)
    if view.held_by_other:
        print(f"{node}: UNHEALTHY ({reason}); drained by someone else ({view.reason}): left alone", file=out)
        return 1
    outcome = actions.drain_fault(cfg, slurm, node, reason, report.findings, source="resume-if-healthy",
                                  lock_wait_s=actions.REPLAY_DEADLINE_S, runner=rt)
    print(f"{node}: UNHEALTHY: {reason}; {outcome.action}", file=out)
    return 1

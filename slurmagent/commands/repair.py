"""`slurmagent repair` and `slurmagent resume-if-healthy`: the repair loop's commands.

* `repair`: replay the journal, read the nodes once, follow up what it asked before (an
  admin's resume cancels our pending repair, journaled; a dynamic node is not left DOWN),
  plan (`repair_policy.plan_repair`: what to repair, skip or refuse; the breaker holds repairs back
  while it is open; opted-out nodes are left alone), then per node the VM's facts (cache,
  else one `instances.get` in the home zone, then ONE list/aggregatedList for VMs in other
  zones) and the choice (`repair_policy.choose_repair`, by `[repair] strategy`; a lemon node,
  policy/lemon.py, may be escalated), and the requests: dynamic nodes powered down
  (POWER_DOWN_ASAP), `reportHostAsFaulty` per node where Google takes it (a refusal falls back
  to recreate, journaled), ONE `recreateInstances` per MIG. The nodes' reasons switch to
  `slurmagent: repairing: ...` first so a second run does not ask twice. What is sent and how
  it is undone on failure is `actions/`'s.
* `resume-if-healthy`: at boot, once slurmd of this boot has registered, resume the node if it
  is healthy and drained by slurmagent (a fault, or a planned drain ahead of the VM's end: a
  static node recreated after its flex expiry comes back by itself); drain it (through the
  breaker) if it is not. No google module is imported here at start-up (the repair path
  imports `gcp/compute.py`).
"""

from __future__ import annotations

import re
import sys
import time
import uuid
from typing import Any, Callable, TextIO

from ..core import hostlist, reasons
from ..policy import breaker as breaker_policy, lemon, repair as repair_policy
from ..policy.repair_report import REFUSED, RepairResult, plan_entry
from ..actions.executor import REPLAY_DEADLINE_S, JournalExecutor
from ..state import metrics
from ..state.config import Config
from ..state.decisionlog import warn
from ..errors import SlurmagentError, SlurmError, SlurmUnreachable
from ..state.host import boot_time, node_name
from ..state.journal import Entry
from ..slurm.model import NodeInfo
from ..state.repair_state import (forget_requested, load_state, remember_drained_at, remember_requested, requested,
                                   save_state)
from ..core.timefmt import fmt_time, from_epoch
from ..core.vm import VmFacts
from ..slurm.commands import Slurm

# reportHostAsFaulty refusals that hold for the VM's life: remembered, the next fault goes to recreate
LASTING_REFUSALS = frozenset({"INSTANCES_WITHOUT_RESERVATION_NOT_SUPPORTED", "MACHINE_TYPE_NOT_SUPPORTED"})
RESUME_POLL_S = 2.0  # resume-if-healthy: how often to ask whether slurmd has registered
BOOT_SLACK_S = 60.0  # slurmd registered this long before our boot time still counts as this boot


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
    executor = JournalExecutor(cfg, slurm, local_node, clock=clock, compute_factory=compute_factory)
    res = RepairResult()
    if not dry_run:
        for entry, outcome in executor.replay():
            print(f"journal: replayed {entry.kind} {entry_target(entry)}: {outcome}", file=out)
    try:
        nodes = slurm.nodes()
    except SlurmError as exc:  # its own exit code: an outage, not a verdict on the nodes
        raise SlurmUnreachable(f"repair: cannot read the nodes from Slurm: {exc}", str(exc)) from None
    now = clock()
    state = load_state(executor.state_dir)
    cleanup = repair_policy.dynamic_cleanup(nodes)
    if not dry_run:
        _follow_admin_resumes(executor, nodes, out)
        _dynamic_cleanup(executor, cleanup, {n.name: n for n in nodes}, res, out)
    b = breaker_policy.breaker(nodes, executor.fraction, now, float(cfg.repair.suppressed_ttl_s))
    plan = repair_policy.plan_repair(nodes, names, force=force, breaker_state=b, now=now,
                              retry_after_s=float(cfg.repair.retry_after_s),
                              history=state.get("history", {}), max_per_day=int(cfg.repair.max_repairs_per_day),
                              strategy=cfg.repair.strategy, adopt_reasons=tuple(cfg.repair.adopt_reasons))
    fault_gauges, lemons = lemon.judge(state.get("history"), now, plan.todo, cfg.repair, hangs=state.get("hangs"),
                                       whys=state.get("hang_why"))
    if not dry_run:
        metrics.for_node(cfg, executor.local_node).update(set_=fault_gauges, replace_prefix="slurmagent_node_faults{", component="repair")
    by_name = {n.name: n for n in nodes}
    for name in [n for n in plan.todo if executor.opted_out(by_name[n], n)]:
        plan.todo.remove(name)
        plan.skipped[name] = f"opted out ({executor.opted_out(by_name[name], name)}): slurmagent leaves it alone"
    for name, why in plan.refused.items():
        print(f"{name}: refused: {why}", file=err)
        res.failed[name] = f"{REFUSED}{why}"
    for name, why in plan.skipped.items():
        if name in cleanup[0] and not dry_run:
            continue  # powered down just now (said above)
        print(f"{name}: skipped: {why}", file=out)
        res.skipped[name] = why
    if plan.suppressed:
        warn(f"CIRCUIT BREAKER {b.describe()}: repair of {hostlist.compress(plan.suppressed)} suppressed "
             "(`slurmagent repair --force` overrides)")
        for name in plan.suppressed:
            res.skipped[name] = "suppressed by the circuit breaker"
        return res
    if not plan.todo:
        if not names and not plan.skipped and not res.ok:
            print("nothing to repair: no node is drained by slurmagent", file=out)
        return res
    strategy = cfg.repair.strategy
    reason_of = {n: by_name[n].reason for n in plan.todo}
    if not dry_run:
        _take_over(executor, plan, by_name, reason_of, res, out, force)
    if strategy == "none":
        for name in plan.todo:
            print(f"{name}: drained only ([repair] strategy = none): {reason_of[name]}", file=out)
            res.skipped[name] = "strategy none"
        return res
    run = RepairRun(cfg, executor, res, out, err, state.get("migs", {}), dry_run, lemons)
    choices = run.choose(plan.todo, by_name)
    if dry_run:
        for name, (choice, target) in choices.items():
            facts = (name, choice.action, target, name in plan.needs_drain or name in plan.adopt,
                     by_name[name].reason, choice.why)
            print(repair_policy.dry_run_line(*facts), file=out)
            res.ok[name], res.plan[name] = f"dry-run: {choice.action}", plan_entry(*facts)
        return res
    run.carry_out(choices, by_name, reason_of)
    return res


def _follow_admin_resumes(executor: JournalExecutor, nodes: list[NodeInfo], out: TextIO) -> None:
    """A node whose repair we asked for and that an admin resumed by hand: our repair is
    cancelled (no further request; an operation already sent is left to finish), journaled.
    Nodes that came back on their own (new slurmd) or are ours again leave the list too."""
    asked = requested(executor.state_dir)
    if not asked:
        return
    cancelled = repair_policy.cancelled_repairs(nodes, asked)
    for name in cancelled:
        outcome = executor.note_cancelled_repair(
            name, f"{name} resumed by hand since our request of {fmt_time(from_epoch(asked[name]))}; "
                      "no further request (an operation already sent finishes on its own)")
        print(f"{name}: {outcome}", file=out)
    by_name = {n.name: n for n in nodes}
    done = [n for n in asked if n not in cancelled and not (n in by_name and by_name[n].ours)]
    forget_requested(executor.state_dir, cancelled + done)


def _dynamic_cleanup(executor: JournalExecutor, cleanup: tuple[list[str], list[str]], by_name: dict[str, NodeInfo],
                     res: RepairResult, out: TextIO) -> None:
    """Dynamic nodes are not left DOWN: power down those whose VM went away after our planned
    drain; resume those we powered down that Slurm still holds DOWN (Slurm may power them up)."""
    gone, down = cleanup
    if gone:
        outcome = executor.power_down({n: by_name[n].reason for n in gone})
        for n in gone:
            print(f"{n}: dynamic node down after {reasons.rule_of(by_name[n].reason)}: {outcome}", file=out)
            res.ok[n] = "powered down"
    for n in down:
        outcome = executor.resume(by_name[n].reason, node=n, powered_down=True)
        print(f"{n}: powered down but DOWN in Slurm: {outcome}", file=out)
        res.ok[n] = outcome


def _take_over(executor: JournalExecutor, plan: repair_policy.RepairPlan, by_name: dict[str, NodeInfo],
               reason_of: dict[str, str], res: RepairResult, out: TextIO, force: bool) -> None:
    """Nodes to repair that are not drained as ours yet: --force on a node the breaker kept from
    draining (drained now, with its fault), and `[repair] adopt_reasons` nodes (another tool's
    drain becomes `slurmagent: adopted: <its reason>`, through the breaker unless --force)."""
    for name in [*plan.needs_drain, *plan.adopt]:
        adopt, theirs = name in plan.adopt, by_name[name].reason
        fault = by_name[name].marks.suppressed_summary or "unhealthy (breaker override)"
        reason_of[name] = reasons.adopted_reason(theirs) if adopt else reasons.clean_reason(f"{reasons.PREFIX} {fault}")
        outcome = executor.drain_fault(reason_of[name], node=name, source="repair (adopt_reasons)" if adopt else
                                       "repair --force", force=force or not adopt, takeover_prolog_error=not adopt,
                                       takeover_reason=theirs if adopt else "", lock_wait_s=REPLAY_DEADLINE_S)
        print(f"{name}: {outcome.action}" + (f": adopted {theirs!r}" if adopt else " (--force)"), file=out)
        if not outcome.action.startswith("drained"):
            plan.todo.remove(name)
            if outcome.action.startswith("suppressed"):
                res.skipped[name] = "suppressed by the circuit breaker"
            else:
                res.failed[name] = f"could not drain it: {outcome.action}"


Choice = tuple[repair_policy.RepairChoice, dict[str, Any]]  # what to do, and where (zone, mig)


class RepairRun:
    """One `repair` run past planning: each node's VM facts (cache, else the API), the choice
    (`repair_policy.choose_repair`), then the requests: power-downs (one scontrol per reason),
    reportHostAsFaulty per node (a refusal falls back to recreate, journaled), then ONE
    recreateInstances per MIG for the planned and the fallen-back nodes together."""

    def __init__(self, cfg: Config, executor: JournalExecutor, res: RepairResult, out: TextIO, err: TextIO,
                 migs: dict[str, Any], dry_run: bool, lemons: dict[str, str] | None = None):
        self.cfg, self.executor, self.res, self.out, self.err = cfg, executor, res, out, err
        self.migs = migs  # the cache: node -> {zone, mig, vm, report_refused}
        self.dry_run = dry_run
        self.strategy = cfg.repair.strategy
        self._where: tuple[str, str] | None = None
        self._compute: Any = None
        self.calls_before = 0
        self.lemons = lemons or {}  # node -> why it is a lemon to escalate ([repair] lemon_action)

    # --- where and how to ask --------------------------------------------------------------

    def where(self) -> tuple[str, str]:
        """(project, home zone): config, else the metadata server. Raises SlurmagentError."""
        if self._where is None:
            from ..gcp import metadata  # google-free; imported on the repair path only, for start-up speed

            self._where = metadata.project_and_zone(self.cfg)
        return self._where

    def compute(self) -> Any:
        if self._compute is None:
            self._compute = self.executor.compute(self.where()[0])
            self.calls_before = getattr(self._compute, "total_calls", 0)
        return self._compute

    def fail(self, name: str, why: str, exc: Exception | None = None) -> None:
        """`exc`: the ComputeError behind it; one that got no answer makes the exit code 3."""
        if getattr(exc, "no_answer", False) and not self.res.unreachable:
            self.res.unreachable = str(exc)
        self.res.failed[name] = why
        print(f"{name}: FAILED: {why}", file=self.err)

    def fail_all(self, names: list[str], exc: Exception) -> None:
        """One cause for every node (no project/zone, no credentials): said once."""
        for name in names:
            self.res.failed[name] = str(exc)
        print(f"repair: {exc}", file=self.err)

    # --- choose -------------------------------------------------------------------------

    def choose(self, todo: list[str], by_name: dict[str, NodeInfo]) -> dict[str, Choice]:
        choices: dict[str, Choice] = {}
        lookup: list[str] = []
        for name in todo:
            node, cached = by_name[name], self.migs.get(name) or {}
            refused = str(cached.get("report_refused", ""))
            refused_report = bool(refused) and self.strategy == "report-faulty"  # then its MIG is needed
            if not repair_policy.needs_vm(self.strategy, node) and not refused_report:
                target = {"zone": cached.get("zone", ""), "mig": cached.get("mig")}
                choices[name] = (repair_policy.choose_repair(self.strategy, node, None), target)
                continue
            lemony = self.lemons.get(name, "")  # its VM's facts are needed: does it take reportHostAsFaulty?
            target_strategy = "recreate" if refused_report else "auto" if lemony else self.strategy
            known = repair_policy.known_target(target_strategy, cached, "")
            if known is not None:
                vm = VmFacts.from_dict(known["vm"]) if known.get("vm") else VmFacts(
                    known["zone"], mig=known.get("mig"))
                choices[name] = (repair_policy.choose_repair(self.strategy, node, vm, refused, lemony), known)
            elif self.dry_run and self.strategy != "auto":
                choices[name] = (repair_policy.RepairChoice("recreate"), {})  # looked up at run time
            else:
                lookup.append(name)
        if lookup:
            for name, vm in self.lookup(lookup).items():
                refused = str((self.migs.get(name) or {}).get("report_refused", ""))
                target = {"zone": vm.zone, "mig": vm.mig, "vm": vm.to_dict(),
                          **({"report_refused": refused} if refused else {})}
                if not self.dry_run:
                    self.migs[name] = target
                choices[name] = (repair_policy.choose_repair(self.strategy, by_name[name], vm, refused,
                                                             self.lemons.get(name, "")), target)
        for name, (choice, _) in list(choices.items()):
            if choice.action == "fail":
                self.fail(name, f"VM {name}: {choice.why}")
                del choices[name]
        return {n: choices[n] for n in todo if n in choices}

    def lookup(self, names: list[str]) -> dict[str, VmFacts]:
        """VM facts: instances.get in the home zone; the rest with ONE list per `[gcp] zones`
        zone, or ONE aggregatedList (regional MIGs put VMs in several zones)."""
        from ..gcp.compute import ComputeError  # google is imported on the repair path only, for start-up speed

        try:
            _, zone = self.where()
            compute = self.compute()
        except SlurmagentError as exc:
            self.fail_all(names, exc)
            return {}
        found: dict[str, VmFacts] = {}
        missing: dict[str, str] = {}
        for name in names:
            try:
                found[name] = compute.vm(zone, name)
            except ComputeError as exc:
                if exc.status == 404:
                    missing[name] = str(exc)
                else:
                    self.fail(name, f"cannot find its VM: {exc}", exc)
        if missing:
            zones = [z for z in self.cfg.gcp.zones if z != zone]
            where = f"zones {', '.join(zones)}" if zones else "any zone of the project (instances.aggregatedList)"
            lost: ComputeError | None = None
            try:
                more = compute.find_vms(list(missing), zones or None)
            except ComputeError as exc:
                more, where, lost = {}, f"{where}: {exc}", exc
            for name, why in missing.items():
                if name in more:
                    found[name] = more[name]
                else:
                    self.fail(name, f"cannot find its VM: {why}; nor in {where}", lost)
        return found

    # --- carry out ------------------------------------------------------------------------

    def carry_out(self, choices: dict[str, Choice], by_name: dict[str, NodeInfo], reason_of: dict[str, str]) -> None:
        from ..gcp.compute import ComputeError  # google is imported on the repair path only, for start-up speed

        by_action: dict[str, list[str]] = {}
        for name, (choice, _) in choices.items():
            by_action.setdefault(choice.action, []).append(name)
        for name in by_action.get("leave", []):
            why = choices[name][0].why
            print(f"{name}: left drained: {why}", file=self.out)
            self.res.skipped[name] = why
        sent: list[str] = []
        if by_action.get("power-down"):
            names = by_action["power-down"]
            outcome = self.executor.power_down({n: reason_of[n] for n in names})
            for n in names:
                print(f"{n}: {outcome} ({choices[n][0].why})", file=self.out)
                self.res.ok[n] = "powered down"
            sent += names
        recreate = {n: choices[n][1] for n in by_action.get("recreate", [])}
        fallback: dict[str, str] = {}
        reports = {n: choices[n][1] for n in by_action.get("report-faulty", [])}
        if reports or recreate:
            try:
                project, zone = self.where()
                compute = self.compute()
            except SlurmagentError as exc:
                self.fail_all([*reports, *recreate], exc)
                return
            deadline = float(self.cfg.repair.operation_timeout_s)
            targets = {n: {"zone": t.get("zone") or zone} for n, t in reports.items()}
            for entry in self._begin(repair_policy.repair_requests(targets, "report-faulty", reason_of, project, deadline,
                                                            _new_id), by_name):
                sent += self._report(entry, compute, choices, recreate, fallback)
            if recreate:
                payloads = repair_policy.repair_requests(recreate, "recreate", reason_of, project, deadline, _new_id)
                for p in payloads:
                    why = {n: fallback[n] for n in p["nodes"] if n in fallback}
                    if why:
                        p["fallback"] = why
                for entry in self._begin(payloads, by_name):
                    sent += self._recreate(entry, compute, ComputeError)
        _save_migs(self.executor, self.migs)
        remember_requested(self.executor.state_dir, sent, self.executor.clock())
        if self._compute is not None:
            self.res.compute_calls = getattr(self._compute, "total_calls", 0) - self.calls_before

    def _begin(self, payloads: list[dict[str, Any]], by_name: dict[str, NodeInfo]) -> list[Entry]:
        if not payloads:
            return []
        # the reason's own time is about to change: keep when each node was drained, for `status`
        drained_at = {n: t for n, t in load_state(self.executor.state_dir).get("drained_at", {}).items()
                      if n in by_name and by_name[n].ours}
        for p in payloads:
            for n in p["nodes"]:
                if by_name[n].reason_time and not by_name[n].repairing:
                    drained_at.setdefault(n, by_name[n].reason_time)
        remember_drained_at(self.executor.state_dir, drained_at)
        try:
            return self.executor.begin_repairs(payloads, list(by_name.values()))
        except SlurmError as exc:
            for p in payloads:
                for n in p["nodes"]:
                    self.fail(n, f"cannot mark it repairing: {exc}")
            return []

    def _report(self, entry: Entry, compute: Any, choices: dict[str, Choice], recreate: dict[str, dict[str, Any]],
                fallback: dict[str, str]) -> list[str]:
        """One reportHostAsFaulty; refused: the node goes to the recreates (its MIG known or
        looked up), remembered so the next run does not ask Google again."""
        from ..gcp.compute import ComputeError  # google is imported on the repair path only, for start-up speed

        [name] = list(entry.payload["nodes"])

        def instead(exc: Any) -> str:
            cached = self.migs.setdefault(name, {"zone": entry.payload["nodes"][name]["zone"]})
            code = _refusal_code(exc)
            if code in LASTING_REFUSALS or exc.status == 403:  # not e.g. INSTANCE_SHOULD_BE_RUNNING
                cached["report_refused"] = code
            mig = choices[name][1].get("mig") or cached.get("mig")
            if not mig and self.strategy == "report-faulty":
                vm = self.lookup([name]).get(name)
                mig = vm.mig if vm else None
                if vm:
                    cached.update(zone=vm.zone, mig=vm.mig, vm=vm.to_dict())
            if not mig:
                return ""
            recreate[name] = {"zone": cached.get("zone") or entry.payload["nodes"][name]["zone"], "mig": mig}
            fallback[name] = f"reportHostAsFaulty refused: {exc}"
            return f"falling back to recreate via MIG {repair_policy.mig_short(mig)}"

        try:
            ops = self.executor.finish_repair(entry, compute, fallback=instead)
        except ComputeError as exc:
            if name in recreate:
                print(f"{name}: reportHostAsFaulty refused ({exc}): recreate via its MIG instead", file=self.out)
            else:
                self.fail(name, f"{exc}" + ("; in no MIG: left drained (never deleted)" if exc.refused else ""), exc)
            return []
        behavior = repair_policy.fault_behavior(reasons.rule_of(entry.payload["nodes"][name]["reason"]))
        what = f"reported host as faulty ({behavior})"
        self.res.ok[name] = what
        print(f"{name}: {what} (operation {', '.join(o.name for o in ops)}; {choices[name][0].why})", file=self.out)
        return [name]

    def _recreate(self, entry: Entry, compute: Any, compute_error: type) -> list[str]:
        p = entry.payload
        members = sorted(p["nodes"])
        try:
            ops = self.executor.finish_repair(entry, compute)
        except compute_error as exc:
            if exc.status in (400, 404):
                for n in members:
                    self.migs.pop(n, None)  # the VM or MIG moved: look it up afresh next time
            for n in members:
                self.fail(n, str(exc), exc)
            return []
        what = f"recreate requested via MIG {repair_policy.mig_short(p['mig'])}"
        for n in members:
            self.res.ok[n] = what
            print(f"{n}: {what} (operation {', '.join(o.name for o in ops)})", file=self.out)
        return members


def _new_id() -> str:
    return str(uuid.uuid4())


def _refusal_code(exc: Any) -> str:
    """The error code of a refusal (INSTANCES_WITHOUT_RESERVATION_NOT_SUPPORTED, ...), else its text."""
    m = re.search(r"\b[A-Z][A-Z_]{6,}\b", str(exc))
    return m[0] if m else str(exc)[:200]


def _save_migs(executor: JournalExecutor, migs: dict[str, Any]) -> None:
    state = load_state(executor.state_dir)
    state["migs"] = migs
    save_state(executor.state_dir, state)


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
    executor = JournalExecutor(cfg, slurm, node)
    executor.replay()
    view = wait_registered(slurm, node, float(wait_s if wait_s is not None else cfg.repair.resume_wait_s),
                           RESUME_POLL_S, boot_time())
    if health is None:
        from .health import evaluator  # the checks only when this command runs: start-up speed
        health = evaluator("resume")  # the node still drained: DCGM's longer diagnostics run here
    report = health(cfg, node, True)
    if report.healthy:
        if view.ours:
            outcome = executor.resume(view.reason)
            print(f"{node}: healthy; {outcome} (was: {view.reason})", file=out)
            return 0 if not outcome.startswith("pending") else 1
        if view.held_by_other:
            print(f"{node}: healthy; drained by someone else ({view.reason or view.state}): left alone", file=out)
            return 0
        if view.marks.suppressed_at is not None:
            executor.clear_suppressed_mark(node)
        print(f"{node}: healthy; nothing to do ({view.state})", file=out)
        return 0
    reason = reasons.reason_for(report)
    if view.held_by_other:
        print(f"{node}: UNHEALTHY ({reason}); drained by someone else ({view.reason}): left alone", file=out)
        return 1
    outcome = executor.drain_fault(reason, report.findings, source="resume-if-healthy",
                                   lock_wait_s=REPLAY_DEADLINE_S)
    print(f"{node}: UNHEALTHY: {reason}; {outcome.action}", file=out)
    return 1

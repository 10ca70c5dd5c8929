"""Runtime of the repair loop: journaled actions, the drain circuit breaker, MIG repair,
resume at boot and `status`.

* Every action (drain, requeue, release, repair request, resume) goes through the node's
  journal (`journal.py`): written before it is tried, marked done after, replayed by the
  next hook/timer/command when slurmctld or the API was down.
* Drains go through the breaker (`policy.py`): one `scontrol -o show node` to count, the
  drain (with our `Comment` stamp), and, when the breaker is on, a second read to verify
  against concurrent drains on other machines.
* `repair`: one `instances.get` per node not yet in the MIG cache, then ONE
  `recreateInstances` per MIG (or `reportHostAsFaulty` per node), with the nodes' reasons
  switched to `slurmagent: repairing: ...` first so a second run does not ask twice.

No google module is imported here: `gcp/compute.py` is imported on the repair path only.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from . import hostlist, metrics, policy
from .config import Config
from .errors import SlurmagentError, SlurmError
from .journal import SUPPRESSED_MARKER, Entry, Journal, Retry, StopReplay, _write_atomic
from .policy import NodeView
from .slurm import Slurm, clean_reason, parse_kv

# Slurm's own reason after our prolog exited non-zero: a pending drain from that prolog may
# replace it with the precise reason (it is the echo of our own failure, not an admin's).
PROLOG_FAILURE_REASONS = ("Prolog error", "Prolog failed")
HOOK_LOCK_WAIT_S = 10.0  # a hook waits at most this long for another replayer of its journal
REQUEUE_STATES = frozenset({"FAILED", "NODE_FAIL", "COMPLETING", "BOOT_FAIL", "TIMEOUT", "OUT_OF_MEMORY"})


def _r(cfg: Config, key: str, default: Any) -> Any:
    """New `[repair]` keys, read tolerantly until config.py declares them."""
    return getattr(cfg.repair, key, default)


def local_node_name(node: str | None = None) -> str:
    return node or os.environ.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]


def warn(msg: str) -> None:
    """Loud: stderr and syslog/journald at warning level."""
    print(f"slurmagent: {msg}", file=sys.stderr)
    try:
        import syslog

        syslog.openlog("slurmagent", 0, syslog.LOG_DAEMON)
        syslog.syslog(syslog.LOG_WARNING, msg)
    except OSError:
        pass


def unreachable(exc: BaseException) -> bool:
    """slurmctld (or scontrol itself) cannot be reached: stop, retry later."""
    text = str(exc).lower()
    return any(s in text for s in ("unable to contact", "timed out", "connect failure", "connection refused",
                                   "cannot run", "socket timed out", "zero bytes"))


# --- Slurm reads and writes (one call each, hostlists batched) ---------------------------


def show_nodes(slurm: Slurm, names: list[str] | None = None) -> list[NodeView]:
    args = ["-o", "show", "node"] + ([hostlist.compress(names)] if names else [])
    out = slurm._scontrol(*args).stdout
    return [policy.node_view(parse_kv(line)) for line in out.splitlines() if line.startswith("NodeName=")]


def update_nodes(slurm: Slurm, nodes: list[str], **fields: str) -> None:
    """`scontrol update NodeName=<hostlist> K=V ...` in one call."""
    if not nodes:
        return
    args = ["update", f"NodeName={hostlist.compress(nodes)}"]
    for key, value in fields.items():
        args.append(f"{key}={clean_reason(value) if key == 'Reason' else value}")
    slurm._scontrol(*args)


def set_reasons(slurm: Slurm, reasons: dict[str, str], **extra: str) -> int:
    """Set each node's reason, one call per distinct reason. Returns the calls made."""
    groups: dict[str, list[str]] = {}
    for node, reason in reasons.items():
        groups.setdefault(reason, []).append(node)
    for reason, nodes in groups.items():
        update_nodes(slurm, nodes, Reason=reason, **extra)
    return len(groups)


def boot_time() -> float | None:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return None


# --- the runtime: journal handlers ------------------------------------------------------


@dataclass
class DrainOutcome:
    action: str
    blocks_job: bool = True  # the prolog exits non-zero: the job must not run here

    @property
    def drained(self) -> bool:
        return self.action.startswith("drained") or self.action == "already-drained"

    @property
    def suppressed(self) -> bool:
        return self.action.startswith("suppressed")

    @property
    def pending(self) -> bool:
        return self.action.startswith("pending")


class Runtime:
    """Executes journal entries against Slurm (and Compute for repair requests)."""

    def __init__(self, cfg: Config, slurm: Slurm, local_node: str | None = None, *,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] | None = None,
                 compute_factory: Callable[[str], Any] | None = None):
        self.cfg = cfg
        self.slurm = slurm
        self.local_node = local_node_name(local_node)
        self.state_dir = cfg.state_path(self.local_node)
        self.journal = Journal.for_config(cfg, self.local_node)
        self.clock = clock
        self.sleep = sleep or time.sleep  # looked up now, so a test can patch time.sleep
        self.compute_factory = compute_factory
        self.fraction = float(cfg.repair.max_drained_fraction)

    def handlers(self) -> dict[str, Callable[[Entry], str]]:
        return {"drain": self._do_drain, "requeue": self._do_requeue, "release": self._do_release,
                "resume": self._do_resume, "repair": self._do_repair}

    def replay(self, deadline_s: float | None = None, lock_wait_s: float = 0.0) -> list[tuple[Entry, str]]:
        deadline = deadline_s if deadline_s is not None else float(_r(self.cfg, "replay_deadline_s", 30.0))
        return self.journal.replay(self.handlers(), deadline, lock_wait_s)

    def run(self, kind: str, *, lock_wait_s: float | None = None, **payload: Any) -> tuple[Entry, str]:
        """Journal one action, then replay (older pending entries first, then this one).
        When the journal cannot be written (state dir full or read-only) the action is still
        tried once, unjournaled: a broken state dir must not let a job onto a bad GPU."""
        try:
            entry = self.journal.add(kind, **payload)
        except OSError as exc:
            warn(f"cannot journal {kind} in {self.journal.dir}: {exc.strerror or exc}; trying it unjournaled")
            entry = Entry(id="unjournaled", kind=kind, created=self.clock(), payload=payload)
            try:
                return entry, self.handlers()[kind](entry)
            except (Retry, StopReplay) as why:
                return entry, f"pending: {why} (NOT journaled)"
        deadline = float(_r(self.cfg, "replay_deadline_s", 30.0))
        try:
            results = self.replay(deadline, lock_wait_s=deadline if lock_wait_s is None else lock_wait_s)
        except OSError as exc:  # the journal broke half-way (disk full?): the action may or may not be done
            warn(f"journal {self.journal.dir}: {exc.strerror or exc} while replaying")
            return entry, f"pending: journal I/O error: {exc.strerror or exc}"
        for done, outcome in results:
            if done.id == entry.id:
                return entry, outcome
        return entry, "pending: not tried yet (journal busy or replay deadline)"

    # --- slurm calls mapped to replay semantics ---

    def _slurm(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except SlurmError as exc:
            if unreachable(exc):
                raise StopReplay(f"slurmctld unreachable: {exc}") from None
            raise Retry(str(exc)) from None

    def _nodes(self, names: list[str] | None = None) -> list[NodeView]:
        return self._slurm(lambda: show_nodes(self.slurm, names))

    def _update(self, nodes: list[str], **fields: str) -> None:
        self._slurm(lambda: update_nodes(self.slurm, nodes, **fields))

    # --- drain (with the breaker) ---

    def _do_drain(self, entry: Entry) -> str:
        p = entry.payload
        node, reason = p["node"], clean_reason(p["reason"])
        nodes = self._nodes()
        takeover = PROLOG_FAILURE_REASONS if p.get("takeover_prolog_error") else ()
        decision = policy.decide_drain(nodes, node, reason, self.fraction, takeover_reasons=takeover)
        me = next((n for n in nodes if n.name == node), None)
        if decision in ("no-such-node", "kept-admin-drain", "already-drained"):
            return decision
        if decision == "update-reason":
            self._update([node], State="DRAIN", Reason=reason)
            return "drained (reason updated)"
        b = policy.breaker(nodes, self.fraction, self.clock(), float(_r(self.cfg, "suppressed_ttl_s", 86400.0)))
        if decision == "suppress" and not p.get("force"):
            self._suppress(me, p, b)
            metrics.for_node(self.cfg, self.local_node).update(set_={("slurmagent_breaker_open", ()): 1})
            return "suppressed-by-breaker"
        fields = {"State": "DRAIN", "Reason": reason}
        if me is not None and me.marks.suppressed_at is not None:
            fields["Comment"] = ""  # no longer held back by the breaker: drained now
        self._update([node], **fields)
        self._drop_marker(node)
        metrics.for_node(self.cfg, self.local_node).update(set_={("slurmagent_breaker_open", ()): 0})
        if p.get("force") or policy.allowed_drained(len(nodes), self.fraction) >= len(nodes):
            return "drained" + (" (breaker overridden)" if decision == "suppress" else "")
        # Optimistic drain: verify against drains other machines made in the same burst.
        now = time.time()
        self.sleep(max(0.0, math.floor(now) + 1.25 - now))
        after = self._nodes()
        if policy.keeps_drain(after, node, self.fraction):
            return "drained"
        me_after = next((n for n in after if n.name == node), None)
        if me_after is not None and me_after.ours and me_after.reason == reason:
            undo = {"State": "RESUME"}
            if me_after.comment_free:
                undo["Comment"] = policy.suppressed_comment(self.clock(), policy.fault_text(reason))
            self._update([node], **undo)
        self._write_marker(node)
        warn(f"CIRCUIT BREAKER: {node} not drained (lost the race for the last of "
             f"{policy.allowed_drained(len(after), self.fraction)} drain slots): {reason}")
        return "suppressed-by-breaker (lost the race)"

    def _suppress(self, me: NodeView | None, p: dict[str, Any], b: policy.Breaker) -> None:
        node = p["node"]
        if me is not None and me.comment_free:
            self._update([node], Comment=policy.suppressed_comment(self.clock(), policy.fault_text(p["reason"])))
        self._write_marker(node)
        warn(f"CIRCUIT BREAKER: {node} is unhealthy ({policy.fault_text(p['reason'])}) but NOT drained: "
             f"{b.describe()}. Check for a cluster-wide cause; `slurmagent repair --force {node}` overrides")

    def _marker(self, node: str) -> Path:
        return self.cfg.state_path(node) / SUPPRESSED_MARKER

    def _write_marker(self, node: str) -> None:
        if node != self.local_node and "%n" not in self.cfg.state_dir:
            return
        try:
            path = self._marker(node)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{self.clock():.3f}\n")
        except OSError:
            pass

    def _drop_marker(self, node: str) -> None:
        try:
            self._marker(node).unlink()
        except OSError:
            pass

    # --- requeue / release / resume ---

    def _do_requeue(self, entry: Entry) -> str:
        job_ids = [str(j) for j in entry.payload["job_ids"]]
        if entry.attempts == 0 and entry.payload.get("fresh"):
            self._slurm(lambda: self.slurm.requeue(job_ids))
            return "requeued"
        todo = []
        for jid in job_ids:
            job = self._slurm(lambda jid=jid: self.slurm.job(jid))
            if job is not None and job.state in REQUEUE_STATES:
                todo.append(jid)
        if not todo:
            return "nothing to do (jobs already requeued, running or gone)"
        self._slurm(lambda: self.slurm.requeue(todo))
        return f"requeued {','.join(todo)}"

    def _do_release(self, entry: Entry) -> str:
        jid = str(entry.payload["job_id"])
        job = self._slurm(lambda: self.slurm.job(jid))
        if job is None:
            return "nothing to do (job gone)"
        if job.held:
            self._slurm(lambda: self.slurm.release([jid]))
            return "released"
        if job.restarts == 0 and job.state in ("RUNNING", "CONFIGURING", "PENDING") and \
                self.clock() - entry.created < float(_r(self.cfg, "release_wait_s", 300.0)):
            raise Retry("job not requeued yet")
        return f"nothing to do (job {job.state}, not held)"

    def _do_resume(self, entry: Entry) -> str:
        node = entry.payload["node"]
        found = [n for n in self._nodes() if n.name == node]
        if not found or not found[0].ours:
            return "nothing to do (not drained by slurmagent)"
        fields = {"State": "RESUME"}
        if found[0].comment.startswith(policy.COMMENT_TAG + " "):
            fields["Comment"] = ""
        self._update([node], **fields)
        self._drop_marker(node)
        return "resumed"

    # --- repair request (replayed with the same requestId) ---

    def _do_repair(self, entry: Entry) -> str:
        p = entry.payload
        nodes = {n.name: n for n in self._nodes()}
        live = {name: info for name, info in p["nodes"].items() if name in nodes and nodes[name].ours}
        if not live:
            return "moot: nodes no longer drained by slurmagent"
        marking = {n: policy.repairing_reason(i["reason"]) for n, i in live.items() if not nodes[n].repairing}
        if marking:
            self._slurm(lambda: set_reasons(self.slurm, marking))
        factory = self.compute_factory or (lambda project: _compute(self.cfg, project))
        compute = factory(p["project"])
        from .gcp.compute import ComputeError

        try:
            ops = request_repair(compute, p, live)
        except ComputeError as exc:
            if exc.retriable:
                raise Retry(str(exc)) from None
            self._revert(live)
            return f"failed: {exc}"
        record_history(self.state_dir, list(live), self.clock())
        metrics.for_node(self.cfg, self.local_node).update(add={("slurmagent_repairs_total", ()): len(live)})
        return "requested: " + ", ".join(str(o) for o in ops)

    def _revert(self, live: dict[str, dict[str, Any]]) -> None:
        try:
            set_reasons(self.slurm, {n: policy.fault_reason(i["reason"]) for n, i in live.items()})
        except SlurmError as exc:
            warn(f"could not put back the reasons of {hostlist.compress(list(live))} after a failed repair: {exc}")


def _compute(cfg: Config, project: str):
    from .gcp.compute import Compute

    return Compute.from_config(cfg, project)


def request_repair(compute, p: dict[str, Any], live: dict[str, dict[str, Any]]) -> list:
    """Send one repair request (a MIG's recreate, or report-faulty for each node) and wait."""
    from .gcp.metadata import MigRef

    deadline = float(p.get("deadline_s", 120.0))
    if p["strategy"] == "recreate":
        mig = MigRef.from_dict(p["mig"])
        ops = compute.recreate(mig, [(info["zone"], name) for name, info in sorted(live.items())], p["request_id"],
                               deadline_s=deadline)
    else:
        ops = []
        for name, info in sorted(live.items()):
            rid = str(uuid.uuid5(uuid.UUID(p["request_id"]), name))
            rule = policy.rule_of(info["reason"])
            ops.append(compute.report_faulty(info["zone"], name, policy.fault_behavior(rule),
                                             f"slurmagent: {policy.fault_text(info['reason'])}", rid,
                                             deadline_s=deadline))
    for op in ops:
        compute.wait(op, deadline_s=deadline)
    return ops


# --- repair state: MIG cache and repair history -----------------------------------------


def _state_file(state_dir: Path) -> Path:
    return state_dir / "repair-state.json"


def load_state(state_dir: Path) -> dict[str, Any]:
    from .fsutil import unsafe_for_root

    why = unsafe_for_root(_state_file(state_dir))
    if why:  # its MIG cache decides which VMs get recreated: never trust a user-written one
        warn(f"ignoring {_state_file(state_dir)}: {why}")
        return {}
    try:
        data = json.loads(_state_file(state_dir).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def save_state(state_dir: Path, data: dict[str, Any]) -> None:
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(_state_file(state_dir), json.dumps(data, sort_keys=True).encode())
    except OSError as exc:
        warn(f"cannot save {_state_file(state_dir)}: {exc.strerror}")


def record_history(state_dir: Path, nodes: list[str], now: float) -> None:
    data = load_state(state_dir)
    hist = data.setdefault("history", {})
    for n in nodes:
        hist[n] = [t for t in hist.get(n, []) if now - t < 7 * 86400][-20:] + [now]
    save_state(state_dir, data)


# --- hooks -----------------------------------------------------------------------------


def hook_drain(cfg: Config, slurm: Slurm, ctx, reason: str, report) -> DrainOutcome:
    """Prolog/epilog on an unhealthy node: journaled drain through the breaker."""
    blocking = policy.blocks_job(report.findings)
    rt = Runtime(cfg, slurm, ctx.node)
    _, outcome = rt.run("drain", node=ctx.node, reason=reason, job=ctx.job_id, source=ctx.hook,
                        takeover_prolog_error=ctx.hook == "prolog", lock_wait_s=HOOK_LOCK_WAIT_S)
    if outcome.startswith("pending"):  # e.g. slurmctld unreachable: the journal retries it
        return DrainOutcome(f"drain-failed: {outcome.replace('pending: ', 'pending in the journal: ', 1)}", True)
    if outcome.startswith("suppressed"):
        # Breaker open: no drain. The job still may not run where the GPU is gone.
        return DrainOutcome(outcome, blocking)
    return DrainOutcome(outcome, True)


def drain_node(cfg: Config, slurm: Slurm, node: str, reason: str, findings=(), source: str = "") -> DrainOutcome:
    """For the other runtimes (healthcheck, watch, expiry): a journaled drain through the
    breaker. `blocks_job` tells whether the GPUs are unusable even when the breaker held it back."""
    _, outcome = Runtime(cfg, slurm, node).run("drain", node=node, reason=reason, source=source,
                                               lock_wait_s=HOOK_LOCK_WAIT_S)
    if outcome.startswith("pending"):
        return DrainOutcome(f"drain-failed: {outcome.replace('pending: ', 'pending in the journal: ', 1)}", True)
    return DrainOutcome(outcome, policy.blocks_job(findings) if outcome.startswith("suppressed") else True)


def journaled_requeue(cfg: Config, slurm: Slurm, node: str, job_ids: list[str]) -> str:
    _, outcome = Runtime(cfg, slurm, node).run("requeue", job_ids=job_ids, fresh=True, lock_wait_s=HOOK_LOCK_WAIT_S)
    if outcome.startswith("pending"):
        return f"requeue-failed: {outcome.replace('pending: ', 'pending in the journal: ', 1)}"
    return outcome


def journal_release(cfg: Config, node: str, job_id: str) -> None:
    """Record the release the prolog's release watch will do; a later replay confirms it."""
    try:
        Journal.for_config(cfg, node).add("release", job_id=job_id, node=node)
    except OSError as exc:
        warn(f"cannot journal the release of job {job_id}: {exc}")


def replay_local(cfg: Config, node: str | None = None, slurm: Slurm | None = None) -> list[tuple[Entry, str]]:
    """Replay this machine's journal (for healthcheck, watch, timers): cheap when it is empty."""
    node = local_node_name(node)
    if not Journal.for_config(cfg, node).has_pending():
        return []
    return Runtime(cfg, slurm or Slurm.from_config(cfg), node).replay()


def after_healthy_hook(cfg: Config, node: str, slurm_factory: Callable[[Config], Slurm]) -> None:
    """The healthy path: replay a non-empty journal; clear our breaker mark if we set one.
    Costs one directory listing and one stat when there is nothing to do."""
    journal = Journal.for_config(cfg, node)
    marker = cfg.state_path(node) / SUPPRESSED_MARKER
    has_marker = marker.exists()
    if not journal.has_pending() and not has_marker:
        return
    try:
        slurm = slurm_factory(cfg)
        rt = Runtime(cfg, slurm, node)
        rt.replay()
        if has_marker:
            found = [n for n in show_nodes(slurm, [node]) if n.name == node]
            if found and found[0].marks.suppressed_at is not None:
                update_nodes(slurm, [node], Comment="")
            marker.unlink(missing_ok=True)
    except (SlurmagentError, OSError) as exc:
        print(f"slurmagent: journal replay deferred: {exc}", file=sys.stderr)


# --- `slurmagent repair` -----------------------------------------------------------------


@dataclass
class RepairResult:
    ok: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    compute_calls: int = 0

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


def run_repair(cfg: Config, names: list[str], *, dry_run: bool = False, force: bool = False,
               out: TextIO = sys.stdout, err: TextIO = sys.stderr, slurm: Slurm | None = None,
               compute_factory: Callable[[str], Any] | None = None, local_node: str | None = None,
               clock: Callable[[], float] = time.time) -> RepairResult:
    slurm = slurm or Slurm.from_config(cfg)
    rt = Runtime(cfg, slurm, local_node, clock=clock, compute_factory=compute_factory)
    res = RepairResult()
    if not dry_run:
        for entry, outcome in rt.replay():
            print(f"journal: replayed {entry.kind} {_entry_target(entry)}: {outcome}", file=out)
    nodes = show_nodes(slurm)
    now = clock()
    b = policy.breaker(nodes, rt.fraction, now, float(_r(cfg, "suppressed_ttl_s", 86400.0)))
    state = load_state(rt.state_dir)
    plan = policy.plan_repair(nodes, names, force=force, breaker_state=b, now=now,
                              retry_after_s=float(_r(cfg, "retry_after_s", 3600.0)),
                              history=state.get("history", {}), max_per_day=int(_r(cfg, "max_repairs_per_day", 3)))
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
    reasons = {n: by_name[n].reason for n in plan.todo}
    if not dry_run:
        # --force on a node the breaker kept from draining: drain it now, with its fault.
        for name in list(plan.needs_drain):
            fault = by_name[name].marks.suppressed_summary or "unhealthy (breaker override)"
            reasons[name] = clean_reason(f"{policy.PREFIX} {fault}")
            _, outcome = rt.run("drain", node=name, reason=reasons[name], source="repair --force", force=True,
                                takeover_prolog_error=True)
            print(f"{name}: {outcome} (--force)", file=out)
            if not outcome.startswith("drained"):
                plan.todo.remove(name)
                res.failed[name] = f"could not drain it: {outcome}"
    if strategy == "none":
        for name in plan.todo:
            print(f"{name}: drained only ([repair] strategy = none): {reasons[name]}", file=out)
            res.skipped[name] = "strategy none"
        return res
    migs = state.get("migs", {})
    if dry_run:
        verb = "recreate via" if strategy == "recreate" else "report host as faulty"
        for name in plan.todo:
            where = migs.get(name, {}).get("mig")
            target = (f"MIG {_mig_short(where)}" if where else "its MIG (looked up at run time)") if strategy == "recreate" else ""
            print(f"{name}: would {'drain and ' if name in plan.needs_drain else ''}{verb} {target}".rstrip()
                  + f" ({policy.fault_text(by_name[name].reason) or 'suppressed fault'})", file=out)
            res.ok[name] = "dry-run"
        return res

    from .gcp import metadata
    from .gcp.compute import ComputeError

    try:
        project, zone = metadata.project_and_zone(cfg)
    except SlurmagentError as exc:
        for name in plan.todo:
            res.failed[name] = str(exc)
        print(f"repair: {exc}", file=err)
        return res
    factory = compute_factory or (lambda p: _compute(cfg, p))
    compute = factory(project)
    calls_before = getattr(compute, "total_calls", 0)

    # Which MIG holds each node (cache, else instances.get).
    targets: dict[str, dict[str, Any]] = {}
    for name in plan.todo:
        cached = migs.get(name)
        if strategy == "recreate" and cached and cached.get("mig"):
            targets[name] = cached
            continue
        if strategy == "report-faulty":
            targets[name] = {"zone": cached.get("zone", zone) if cached else zone}
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
    state["migs"] = migs
    save_state(rt.state_dir, state)

    groups: dict[str, list[str]] = {}
    for name, t in targets.items():
        key = json.dumps(t.get("mig"), sort_keys=True) if strategy == "recreate" else name
        groups.setdefault(key, []).append(name)
    deadline = float(_r(cfg, "operation_timeout_s", 120.0))
    batch = []
    for key, members in groups.items():
        live = {n: {"zone": targets[n]["zone"], "reason": reasons[n]} for n in sorted(members)}
        payload = {"strategy": strategy, "project": project, "mig": targets[members[0]].get("mig"),
                   "nodes": live, "request_id": str(uuid.uuid4()), "deadline_s": deadline}
        batch.append((members, live, payload, rt.journal.add("repair", **payload)))
    # Say so in Slurm first (one call per distinct reason, all MIGs together): a second run,
    # or another machine, does not ask twice.
    try:
        # the reason's own time is about to change: keep when each node was drained, for `status`
        st = load_state(rt.state_dir)
        drained_at = {n: t for n, t in st.get("drained_at", {}).items() if n in by_name and by_name[n].ours}
        for _, live, _, _ in batch:
            for n in live:
                if by_name[n].reason_time and not by_name[n].repairing:
                    drained_at.setdefault(n, by_name[n].reason_time)
        st["drained_at"] = drained_at
        save_state(rt.state_dir, st)
        set_reasons(slurm, {n: policy.repairing_reason(i["reason"]) for _, live, _, _ in batch for n, i in live.items()})
    except SlurmError as exc:
        for members, _, _, entry in batch:
            rt.journal.mark_done(entry, f"not sent: {exc}")
            for n in members:
                res.failed[n] = f"cannot mark it repairing: {exc}"
                print(f"{n}: FAILED: cannot mark it repairing: {exc}", file=err)
        batch = []
    for members, live, payload, entry in batch:
        try:
            ops = request_repair(compute, payload, live)
        except ComputeError as exc:
            if exc.status in (400, 404):
                for n in members:
                    migs.pop(n, None)  # the VM or MIG moved: look it up afresh next time
            rt._revert(live)
            rt.journal.mark_done(entry, f"failed: {exc}")
            for n in members:
                res.failed[n] = str(exc)
                print(f"{n}: FAILED: {exc}", file=err)
            continue
        rt.journal.mark_done(entry, "requested: " + ", ".join(str(o) for o in ops))
        record_history(rt.state_dir, members, now)
        metrics.for_node(rt.cfg, rt.local_node).update(add={("slurmagent_repairs_total", ()): len(members)})
        what = (f"recreate requested via MIG {_mig_short(payload['mig'])}" if strategy == "recreate"
                else "reported host as faulty")
        for n in members:
            res.ok[n] = what
            print(f"{n}: {what} (operation {', '.join(o.name for o in ops)})", file=out)
    state = load_state(rt.state_dir)
    state["migs"] = migs
    save_state(rt.state_dir, state)
    res.compute_calls = getattr(compute, "total_calls", 0) - calls_before
    return res


def _mig_short(mig: dict[str, str] | None) -> str:
    if not mig:
        return "?"
    return f"{mig['scope']}/{mig['location']}/instanceGroupManagers/{mig['name']}"


def _entry_target(entry: Entry) -> str:
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


# --- `slurmagent resume-if-healthy` -------------------------------------------------------


def wait_registered(slurm: Slurm, node: str, deadline_s: float, poll_s: float = 2.0,
                    booted: float | None = None) -> NodeView:
    """Until slurmctld knows the node as up (not DOWN/NOT_RESPONDING/UNKNOWN) and, when we
    know this machine's boot time, registered by a slurmd of this boot."""
    end = time.monotonic() + deadline_s
    last: NodeView | None = None
    last_err = ""
    while True:
        try:
            found = [n for n in show_nodes(slurm, [node]) if n.name == node]
            if not found:
                raise SlurmagentError(f"{node}: no such node in Slurm")
            last = found[0]
            boot_ok = True
            raw_boot = policy.parse_slurm_time(last.raw.get("BootTime", ""))
            if booted is not None and raw_boot is not None:
                boot_ok = raw_boot >= booted - 60
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
    from .hooks import reason_for

    node = local_node_name(node)
    slurm = slurm or Slurm.from_config(cfg)
    rt = Runtime(cfg, slurm, node)
    rt.replay()
    view = wait_registered(slurm, node, float(wait_s if wait_s is not None else _r(cfg, "resume_wait_s", 300.0)),
                           float(_r(cfg, "resume_poll_s", 2.0)), boot_time())
    if health is None:
        from .health import evaluate as health
    report = health(cfg, node, True)
    if report.healthy:
        if view.ours:
            _, outcome = rt.run("resume", node=node, reason=view.reason)
            print(f"{node}: healthy; {outcome} (was: {view.reason})", file=out)
            return 0 if not outcome.startswith("pending") else 1
        if view.held_by_other:
            print(f"{node}: healthy; drained by someone else ({view.reason or view.state}): left alone", file=out)
            return 0
        if view.marks.suppressed_at is not None:
            update_nodes(slurm, [node], Comment="")
            rt._drop_marker(node)
        print(f"{node}: healthy; nothing to do ({view.state})", file=out)
        return 0
    reason = reason_for(report)
    if view.held_by_other:
        print(f"{node}: UNHEALTHY ({reason}); drained by someone else ({view.reason}): left alone", file=out)
        return 1
    _, outcome = rt.run("drain", node=node, reason=reason, source="resume-if-healthy")
    print(f"{node}: UNHEALTHY: {reason}; {outcome}", file=out)
    return 1


# --- `slurmagent status` -----------------------------------------------------------------


def _expiry(cfg: Config, node: str, local: str, now: float) -> dict[str, Any] | None:
    if "%n" not in cfg.state_dir and node != local:
        return None
    path = cfg.state_path(node) / "expiry.json"
    try:
        data = json.loads(path.read_text())
        text = str(data["termination_time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    from datetime import datetime

    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return {"termination_time": text, "in_s": None}
    return {"termination_time": text, "in_s": round(when - now)}


def collect_status(cfg: Config, slurm: Slurm | None = None, local_node: str | None = None,
                   clock: Callable[[], float] = time.time) -> dict[str, Any]:
    slurm = slurm or Slurm.from_config(cfg)
    local = local_node_name(local_node)
    slurm_error = None
    try:
        nodes = show_nodes(slurm)
    except SlurmError as exc:  # still worth showing: the journal backlog is what piles up then
        nodes, slurm_error = [], str(exc)
    now = clock()
    fraction = float(cfg.repair.max_drained_fraction)
    b = policy.breaker(nodes, fraction, now, float(_r(cfg, "suppressed_ttl_s", 86400.0)))
    rows = []
    drained_at = load_state(cfg.state_path(local)).get("drained_at", {})
    for n in nodes:
        suppressed = n.name in b.suppressed
        if not n.ours and not suppressed:
            continue
        if n.ours:
            repair = "repairing" if n.repairing else ("waiting for jobs to end" if n.busy else "drained")
            if not policy.repairable(n.reason):
                repair = "drained (not repaired)"
            rule = policy.rule_of(n.reason)
            since = drained_at.get(n.name) if n.repairing and drained_at.get(n.name) else n.reason_time
            detail = policy.fault_text(n.reason)
        else:
            m = n.marks
            # Slurm's reason only while it holds the node: 24.11 keeps it after a resume.
            held = n.reason and (n.drained or n.down)
            repair = "suppressed by breaker" + (f" (Slurm: {n.reason})" if held else "")
            rule = policy.rule_of(m.suppressed_summary)
            since = m.suppressed_at
            detail = m.suppressed_summary
        rows.append({"node": n.name, "state": n.state, "rule": rule, "detail": detail, "since": since,
                     "for_s": round(now - since) if since else None, "repair": repair,
                     "repair_requested_s_ago": round(now - n.reason_time) if n.repairing and n.reason_time else None,
                     "expiry": _expiry(cfg, n.name, local, now)})
    journals = []
    names = sorted({n.name for n in nodes} | {local}) if "%n" in cfg.state_dir else [local]
    for name in names:
        s = Journal.for_config(cfg, name).summary()
        if s["pending"] or name == local:
            journals.append({"node": name, **s})
    expiries = {}
    for name in names:
        e = _expiry(cfg, name, local, now)
        if e:
            expiries[name] = e
    return {"time": now, "slurm_error": slurm_error, "nodes": rows,
            "breaker": {**b.to_dict(), "summary": b.describe() if not slurm_error else "unknown (Slurm unreachable)"},
            "journal": {"pending": sum(j["pending"] for j in journals), "journals": journals},
            "expiry": expiries}


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 0:
        return "in " + _ago(-s)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600}h"


def format_status(st: dict[str, Any]) -> str:
    lines = []
    rows = st["nodes"]
    if st.get("slurm_error"):
        lines.append(f"slurm: cannot read the nodes: {st['slurm_error']}")
    elif rows:
        header = ("NODE", "STATE", "RULE", "SINCE", "REPAIR", "EXPIRY", "DETAIL")
        table = [header]
        for r in rows:
            exp = r["expiry"]
            table.append((r["node"], r["state"], r["rule"], _ago(r["for_s"]) + (" ago" if r["for_s"] is not None else ""),
                          r["repair"] + (f" ({_ago(r['repair_requested_s_ago'])} ago)" if r["repair_requested_s_ago"] is not None else ""),
                          ("in " + _ago(exp["in_s"]) if exp and exp["in_s"] is not None and exp["in_s"] >= 0
                           else ("passed" if exp and exp["in_s"] is not None else "-")),
                          r["detail"]))
        widths = [max(len(str(row[i])) for row in table) for i in range(len(header) - 1)]
        for row in table:
            lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) + "  " + str(row[-1]))
    else:
        lines.append("no node is drained by slurmagent")  # (or held back by the breaker)
    lines.append(f"breaker: {st['breaker']['summary']}")
    j = st["journal"]
    if j["pending"]:
        per = ", ".join(f"{x['node']}: {x['pending']} ({', '.join(x['pending_kinds'])}, oldest "
                        f"{_ago(x['oldest_pending_age_s'])})" for x in j["journals"] if x["pending"])
        lines.append(f"journal: {j['pending']} pending action(s) not yet applied: {per}")
    else:
        lines.append("journal: no pending actions")
    for node, e in sorted(st["expiry"].items()):
        when = e["in_s"]
        lines.append(f"expiry: {node} terminates {e['termination_time']}"
                     + (f" (in {_ago(when)})" if when is not None and when >= 0 else " (passed)" if when is not None else ""))
    return "\n".join(lines)

"""Flex-start expiry watch: learn when this VM dies, drain it ahead, flush its jobs in time.

`slurmagent expiry-watch --once` (systemd/slurmagent-expiry.timer, every 30 s) or
`slurmagent expiry-watch` (a loop that long-polls the metadata server) does, per check:

1. **Termination time**: `[expiry] termination_time` when set, else the Compute API
   (`instances.get` on the instance named like the node: `resourceStatus.scheduling.terminationTimestamp`,
   else `scheduling.terminationTime`, else `lastStartTimestamp + scheduling.maxRunDuration`),
   with `scheduling.provisioningModel` and `instanceTerminationAction` kept for `status`.
   The answer (also "no termination time") is cached in `<state_dir>/expiry.json` with the
   boot id and asked again after `[expiry] refresh_s`, or when the time passed and the VM is
   still alive; a state file of an earlier boot is discarded. No termination time and no
   notice: nothing to do (a standard VM costs one API call per boot and per `refresh_s`).
2. **Short-notice events** from the metadata server: `instance/maintenance-event`
   `TERMINATE_ON_HOST_MAINTENANCE` (set 60 s before a GPU VM is stopped for host maintenance)
   and `instance/preempted` `TRUE` (30 s before a Spot VM stops) count as a termination in
   60 s / 30 s. `--once` reads both keys once; the loop long-polls them
   (`?wait_for_change=true&last_etag=...&timeout_sec=...`), so it reacts within a second.
   `MIGRATE_ON_HOST_MAINTENANCE` is only logged (the VM survives).
3. **Drain** when the remaining lifetime is below `drain_lead_s` (with
   `drain_at_max_time`, also below the longest time limit a job may ask for on this node:
   the largest MaxTime of its partitions, only when all are finite) with
   `slurmagent: expiry: flex expiry at <UTC>` (`maintenance:` / `preempt:` for notices).
   An admin's (or Slurm's) drain is never overridden, nor a slurmagent hardware drain (the
   repair loop owns that one). The rule `expiry` is one `repair` never recreates; a static
   node comes back through `resume-if-healthy` on the recreated VM, a dynamic node leaves
   nothing behind (its state lives on the VM's disk and in /run).
   Why not drain at MaxTime by default: on a 7-day VM with a 24-72 h MaxTime that would idle
   the node for a day or more while short jobs could still use it; the prolog guard below
   keeps each job that cannot finish off the node instead.
4. **Flush** at `flush_lead_s` before the end, or at once on a notice: the jobs running on
   the node (`squeue -h -w NODE -t RUNNING -o %A`) whose batch script execs the wrapper
   (`slurmagent sbatch`, or `exec slurmagent run -- ...`) get `scancel --batch
   --signal=USR1` (one call for all): the wrapper checkpoints, syncs, requeues, exits 143.
   Other jobs are handled per `[expiry] unwrapped_jobs`: `requeue` (default: `scontrol
   requeue`, what Slurm would do after the node dies, but before and without the
   SlurmdTimeout wait), `signal` (USR1 too: a batch script that does not trap USR1 is
   killed by it and ends FAILED, NOT requeued), `leave`.
   Every job is flushed once; a later check only handles jobs not seen before.
5. **State**: `<state_dir>/expiry.json` (and, with `publish_run_file`, a world-readable
   copy in `/run/slurmagent/expiry.json` for wrappers that run as the job's user) holds
   `termination_time` (absent when unknown), `source`, `boot_id`, the drain and flush
   flags; `slurmagent run` flushes on its own at `flush_lead_s` from it, `status` shows it.

Prolog guard (`[expiry] prolog_guard`): when the state file has a termination time, a job
whose time limit would end after `termination - flush_lead_s` is kept off the node: the
prolog drains it with the expiry reason and exits 1, Slurm requeues the job PENDING
(nohold_on_prolog_fail) and it starts elsewhere. `requeue` (default) does this for jobs that
cannot flush (their batch script does not exec the wrapper: one `scontrol write batch_script`,
only for such a job); a wrapped job runs and is flushed at the lead, which loses minutes where
draining the node idles it for the rest of its life (`bench/expiry_sim.py`). `requeue-all`
does it for every job, `warn` only logs, `off`. Without a termination time the prolog reads
the state file once and makes no scontrol call.

Cadence: the timer fires every 30 s (AccuracySec 5 s), so a flush starts up to ~35 s after
`flush_lead_s` is reached: keep `flush_lead_s` >= 35 s + the jobs' flush time (the wrapper
also checks the state file every 5 s on its own). A check costs one local file read and
two metadata reads; the API is asked once per boot and `refresh_s`.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, TextIO

from .config import Config
from .errors import SlurmagentError
from .fsutil import atomic_write_text
from .slurm import REASON_PREFIX, Slurm, make_reason, parse_kv

STATE_NAME = "expiry.json"
RUN_FILE = Path("/run/slurmagent/expiry.json")
BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")
SCHEMA = 1

MAINTENANCE_KEY = "instance/maintenance-event"
PREEMPTED_KEY = "instance/preempted"
EVENT_KEYS = (MAINTENANCE_KEY, PREEMPTED_KEY)
TERMINATE = "TERMINATE_ON_HOST_MAINTENANCE"
MAINTENANCE_NOTICE_S = 60.0  # maintenance-event changes 60 s before the maintenance
PREEMPT_NOTICE_S = 30.0  # Spot/preemptible VMs get 30 s
STALE_RECHECK_S = 300.0  # the time passed but we live: ask the API again at most this often
UNDRAIN_MARGIN_S = 60.0
NOTICE_GRACE_S = 300.0  # alive this long after a notice's stop time, and no notice now: it is over

RULES = ("expiry", "maintenance", "preempt")
# `exec [ENV=.. python -m] .../slurmagent[.entry] [--opts] run ...` on one line, outside a comment
WRAPPED_RE = re.compile(
    r"^[ \t]*exec[ \t]+(?:[^\s#]\S*[ \t]+)*?[^\s#]*slurmagent(?:\.entry|\.cli)?[ \t]+(?:[^\s#]\S*[ \t]+)*?run(?:\s|$)",
    re.M)


class ExpiryError(SlurmagentError):
    exit_code = 1


# --- time ----------------------------------------------------------------------------------


def parse_time(text: str) -> datetime:
    """RFC 3339 (`Z` or an offset, optional fractions) -> an aware UTC datetime."""
    t = str(text).strip()
    if t.endswith(("Z", "z")):
        t = t[:-1] + "+00:00"
    dt = datetime.fromisoformat(t)
    if dt.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone")
    return dt.astimezone(timezone.utc)


def fmt_time(dt: datetime) -> str:
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_epoch(t: float) -> datetime:
    return datetime.fromtimestamp(t, timezone.utc)


def parse_time_limit(text: str) -> float | None:
    """scontrol's TimeLimit (`[D-]HH:MM:SS`, also `MM`, `MM:SS`, `D-HH`) in seconds; None = unlimited."""
    t = (text or "").strip()
    if not t or t.upper() in ("UNLIMITED", "INFINITE", "PARTITION_LIMIT", "NONE", "N/A"):
        return None
    days = 0
    if "-" in t:
        d, t = t.split("-", 1)
        days = int(d)
        parts = [int(p) for p in t.split(":")]
        parts += [0] * (3 - len(parts))  # D-HH, D-HH:MM, D-HH:MM:SS
        h, m, s = parts[:3]
    else:
        parts = [int(p) for p in t.split(":")]
        if len(parts) == 1:
            h, m, s = 0, parts[0], 0  # minutes
        elif len(parts) == 2:
            h, m, s = 0, parts[0], parts[1]  # MM:SS
        else:
            h, m, s = parts[:3]
    return float(((days * 24 + h) * 60 + m) * 60 + s)


def human(seconds: float) -> str:
    s = int(round(seconds))
    sign = "-" if s < 0 else ""
    s = abs(s)
    if s < 120:
        return f"{sign}{s}s"
    if s < 7200:
        return f"{sign}{s // 60}m{s % 60:02d}s"
    if s < 172800:
        return f"{sign}{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{sign}{s // 86400}d{(s % 86400) // 3600}h"


# --- reasons -------------------------------------------------------------------------------


def expiry_reason(when: datetime, kind: str = "expiry", provisioning_model: str = "") -> str:
    """The drain reason, `slurmagent: <rule>: <detail>` with rule expiry|maintenance|preempt."""
    at = fmt_time(when)
    if kind == "maintenance":
        return make_reason("maintenance", f"{TERMINATE} (VM stops at about {at})")
    if kind == "preempt":
        return make_reason("preempt", f"VM preempted (stops at about {at})")
    label = "flex" if provisioning_model in ("", "FLEX_START") else "VM"
    return make_reason("expiry", f"{label} expiry at {at}")


def is_expiry_reason(reason: str) -> bool:
    return any(reason.startswith(f"{REASON_PREFIX} {rule}:") for rule in RULES)


# --- state file ------------------------------------------------------------------------------


def current_boot_id() -> str:
    try:
        return BOOT_ID_FILE.read_text().strip()
    except OSError:
        return ""


def state_file(cfg: Config, node: str) -> Path:
    return cfg.state_path(node) / STATE_NAME


def read_state(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_state(cfg: Config, node: str, state: dict[str, Any]) -> None:
    text = json.dumps(state, indent=1, sort_keys=True) + "\n"
    atomic_write_text(state_file(cfg, node), text, 0o644)
    if cfg.expiry.publish_run_file:
        try:
            RUN_FILE.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            atomic_write_text(RUN_FILE, text, 0o644)
        except OSError as exc:
            raise ExpiryError(f"cannot write {RUN_FILE}: {exc.strerror or exc}") from None


# --- what the Compute API says --------------------------------------------------------------


@dataclass(frozen=True)
class SchedulingInfo:
    termination_time: datetime | None
    provisioning_model: str = ""
    instance_termination_action: str = ""
    max_run_duration_s: float | None = None
    field: str = ""  # the API field the time came from

    def to_dict(self) -> dict[str, Any]:
        return {
            "termination_time": fmt_time(self.termination_time) if self.termination_time else None,
            "provisioning_model": self.provisioning_model,
            "instance_termination_action": self.instance_termination_action,
            "max_run_duration_s": self.max_run_duration_s,
            "field": self.field,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SchedulingInfo:
        t = d.get("termination_time")
        return cls(parse_time(t) if t else None, d.get("provisioning_model", ""),
                   d.get("instance_termination_action", ""), d.get("max_run_duration_s"), d.get("field", ""))


def _has(msg: Any, name: str) -> bool:
    try:
        return name in msg
    except TypeError:
        return bool(getattr(msg, name, None))


def scheduling_from_instance(inst: Any) -> SchedulingInfo:
    """A compute_v1.Instance -> the termination time and the scheduling facts around it."""
    sched = inst.scheduling if _has(inst, "scheduling") else None
    model = str(sched.provisioning_model) if sched is not None and _has(sched, "provisioning_model") else ""
    action = (str(sched.instance_termination_action)
              if sched is not None and _has(sched, "instance_termination_action") else "")
    mrd = None
    if sched is not None and _has(sched, "max_run_duration"):
        mrd = float(sched.max_run_duration.seconds) + sched.max_run_duration.nanos / 1e9
    when, src = None, ""
    rs = inst.resource_status if _has(inst, "resource_status") else None
    if rs is not None and _has(rs, "scheduling") and _has(rs.scheduling, "termination_timestamp"):
        when, src = parse_time(rs.scheduling.termination_timestamp), "resourceStatus.scheduling.terminationTimestamp"
    elif sched is not None and _has(sched, "termination_time") and sched.termination_time:
        when, src = parse_time(sched.termination_time), "scheduling.terminationTime"
    elif mrd and _has(inst, "last_start_timestamp") and inst.last_start_timestamp:
        start = parse_time(inst.last_start_timestamp).timestamp()
        when, src = from_epoch(start + mrd), "lastStartTimestamp+scheduling.maxRunDuration"
    return SchedulingInfo(when, model, action, mrd, src)


def read_scheduling(cfg: Config, node: str) -> SchedulingInfo:
    """`instances.get` for the instance named like this node (the slurm-gcp convention)."""
    from .gcp import metadata
    from .gcp.compute import Compute, ComputeError

    project, zone = metadata.project_and_zone(cfg, cfg.expiry.metadata_timeout_s)
    budget = float(cfg.expiry.api_timeout_s)
    compute = Compute(project, cfg.gcp.compute_endpoint, call_timeout_s=max(1.0, min(budget, 15.0)),
                      deadline_s=budget, retries=2, backoff_s=0.5)
    try:
        inst = compute.instance(zone, node, budget)
    except ComputeError as exc:
        if exc.status == 404:
            raise ExpiryError(f"instances.get: no instance {node!r} in {project}/{zone} "
                              "(slurmagent takes the node name as the instance name)") from None
        raise
    return scheduling_from_instance(inst)


# --- the metadata server: one read, or a long poll --------------------------------------------


def metadata_read(path: str, timeout_s: float, *, wait_s: float = 0.0, last_etag: str = "") -> tuple[str, str]:
    """GET computeMetadata/v1/<path> -> (value, ETag), no cache (these keys change).

    With `wait_s` > 0: `wait_for_change=true&timeout_sec=wait_s` (and `last_etag`): the
    server answers on a change or after wait_s; the socket deadline is wait_s + timeout_s."""
    import urllib.error
    import urllib.parse
    import urllib.request

    from .gcp.metadata import FLAVOR, MetadataError, metadata_host

    host = metadata_host()
    query = ""
    if wait_s > 0:
        q = {"wait_for_change": "true", "timeout_sec": str(max(1, int(wait_s)))}
        if last_etag:
            q["last_etag"] = last_etag
        query = "?" + urllib.parse.urlencode(q)
    req = urllib.request.Request(f"http://{host}/computeMetadata/v1/{path}{query}", headers={FLAVOR[0]: FLAVOR[1]})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
    try:
        with opener.open(req, timeout=timeout_s + wait_s) as resp:
            if resp.headers.get(FLAVOR[0]) != FLAVOR[1]:
                raise MetadataError(f"{host} answered without 'Metadata-Flavor: Google': not a metadata server")
            return resp.read(4096).decode("utf-8", "replace").strip(), resp.headers.get("ETag", "")
    except urllib.error.HTTPError as exc:
        raise MetadataError(f"metadata server {host}: HTTP {exc.code} for {path!r}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        why = getattr(exc, "reason", exc)
        raise MetadataError(f"metadata server {host} did not answer ({why}; deadline {timeout_s + wait_s:g} s)") from None


@dataclass
class Events:
    """What the metadata server says about short-notice terminations."""

    maintenance: str = "NONE"
    preempted: str = "FALSE"
    error: str = ""  # the metadata server could not be read

    @property
    def notice(self) -> tuple[str, float] | None:
        if self.preempted.upper() == "TRUE":
            return "preempt", PREEMPT_NOTICE_S
        if self.maintenance.upper().startswith(TERMINATE):
            return "maintenance", MAINTENANCE_NOTICE_S
        return None


def probe_events(timeout_s: float) -> Events:
    """One plain read of both keys (for --once); a dead server costs one deadline, not two."""
    from .gcp.metadata import MetadataError

    ev = Events()
    try:
        ev.maintenance = metadata_read(MAINTENANCE_KEY, timeout_s)[0] or "NONE"
        ev.preempted = metadata_read(PREEMPTED_KEY, timeout_s)[0] or "FALSE"
    except MetadataError as exc:
        ev.error = str(exc)
    return ev


class EventWatcher:
    """One thread per key long-polls it; `wake` is set on every change. Errors are reported
    once per outage (`report`), and retried with backoff."""

    def __init__(self, timeout_s: float, wait_s: float, wake: threading.Event, stop: threading.Event,
                 report: Callable[[str], None]):
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        self.wake = wake
        self.stop = stop
        self.report = report
        self.values: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.lock = threading.Lock()
        self.down_reported = False
        self.threads = [threading.Thread(target=self._poll, args=(k,), name=f"md-{k}", daemon=True) for k in EVENT_KEYS]

    def start(self) -> EventWatcher:
        for t in self.threads:
            t.start()
        return self

    def snapshot(self) -> Events:
        with self.lock:
            err = next(iter(self.errors.values()), "")
            return Events(self.values.get(MAINTENANCE_KEY, "NONE") or "NONE",
                          self.values.get(PREEMPTED_KEY, "FALSE") or "FALSE", err)

    def _set_error(self, key: str, msg: str | None) -> None:
        with self.lock:
            if msg:
                self.errors[key] = msg
                first = not self.down_reported
                self.down_reported = True
            else:
                self.errors.pop(key, None)
                first = self.down_reported and not self.errors
                if first:
                    self.down_reported = False
        if first:
            self.report(f"{msg}: maintenance/preemption notices not watched; retrying" if msg
                        else "metadata server answers again: watching maintenance/preemption notices")

    def _poll(self, key: str) -> None:
        from .gcp.metadata import MetadataError

        etag, backoff = "", 1.0
        while not self.stop.is_set():
            try:
                value, new_etag = metadata_read(key, self.timeout_s, wait_s=self.wait_s if etag else 0.0, last_etag=etag)
            except MetadataError as exc:
                self._set_error(key, str(exc))
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            backoff = 1.0
            self._set_error(key, None)
            with self.lock:
                changed = self.values.get(key) != value
                self.values[key] = value
            if changed:
                self.wake.set()
            if new_etag:
                etag = new_etag
            else:  # a server without ETags: plain polling
                self.stop.wait(min(self.wait_s, 5.0))


# --- the watch -------------------------------------------------------------------------------


@dataclass
class CheckResult:
    node: str
    termination: datetime | None = None
    source: str = ""
    remaining_s: float | None = None
    actions: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    next_check_s: float | None = None  # when the next threshold is crossed (loop mode)

    def summary(self) -> str:
        if self.termination is None:
            head = f"{self.node}: no termination time"
        else:
            head = (f"{self.node}: terminates {fmt_time(self.termination)} (in {human(self.remaining_s or 0)}, "
                    f"{self.source})")
        return head + (": " + "; ".join(self.actions) if self.actions else "")


def _sibling(binary: str, name: str) -> str:
    """squeue/scancel next to the configured scontrol (same installation)."""
    return str(Path(binary).with_name(name)) if "/" in binary else name


class ExpiryWatch:
    def __init__(self, cfg: Config, node: str, slurm: Slurm | None = None, *,
                 clock: Callable[[], float] = time.time, boot_id: str | None = None,
                 scheduling_reader: Callable[[Config, str], SchedulingInfo] = read_scheduling):
        self.cfg = cfg
        self.node = node
        self.slurm = slurm or Slurm.from_config(cfg)
        self.clock = clock
        self.boot_id = current_boot_id() if boot_id is None else boot_id
        self.read_scheduling = scheduling_reader
        self.path = state_file(cfg, node)

    # --- termination time ---

    def _load_state(self, res: CheckResult) -> dict[str, Any]:
        state = read_state(self.path) or {}
        if state and state.get("boot_id") != self.boot_id:
            res.actions.append(f"discarded the expiry state of an earlier boot ({state.get('boot_id') or 'unknown'})")
            state = {}
        return state

    def _api(self, now: float, state: dict[str, Any], res: CheckResult, metadata_down: str) -> dict[str, Any] | None:
        """The cached Compute API answer, refreshed when old or when the VM outlived it."""
        cached = state.get("api")
        if cached:
            age = now - float(cached.get("checked_at_epoch", 0))
            t = cached.get("scheduling", {}).get("termination_time")
            outlived = t is not None and now > parse_time(t).timestamp() + UNDRAIN_MARGIN_S
            if age < float(self.cfg.expiry.refresh_s) * _jitter(self.node) and not (outlived and age > STALE_RECHECK_S):
                return cached
        if metadata_down and not (self.cfg.gcp.project and self.cfg.gcp.zone):
            # the same outage: one line says both
            res.errors[0] += ("; termination time unknown without it (set [gcp] project and zone, or "
                              "[expiry] termination_time)" + ("; using the cached answer" if cached else ""))
            return cached
        try:
            info = self.read_scheduling(self.cfg, self.node)
        except SlurmagentError as exc:
            res.errors.append(f"cannot read the termination time from the Compute API: {exc}"
                              + ("; using the cached answer" if cached else ""))
            return cached
        return {"checked_at": fmt_time(from_epoch(now)), "checked_at_epoch": now, "scheduling": info.to_dict()}

    # --- one check ---

    def check(self, events: Events | None = None) -> CheckResult:
        ex = self.cfg.expiry
        now = self.clock()
        res = CheckResult(self.node)
        old = self._load_state(res)
        state: dict[str, Any] = {"schema": SCHEMA, "node": self.node, "boot_id": self.boot_id,
                                 "checked_at": fmt_time(from_epoch(now))}
        metadata_down = events.error if events else ""
        if metadata_down:
            res.errors.append(f"{metadata_down}: no maintenance/preemption notices")

        # 1. termination time: config, else the (cached) Compute API
        termination: datetime | None = None
        model = ""
        if ex.termination_time:
            try:
                termination = parse_time(ex.termination_time)
            except ValueError:
                raise ExpiryError(f"[expiry] termination_time {ex.termination_time!r} is not an RFC 3339 time") from None
            source = "config"
        else:
            api = self._api(now, old, res, metadata_down)
            source = "compute-api"
            if api:
                state["api"] = api
                sched = SchedulingInfo.from_dict(api["scheduling"])
                termination, model = sched.termination_time, sched.provisioning_model
                state["scheduling"] = api["scheduling"]

        # 2. a short notice wins when it is sooner; it is remembered until the VM outlives it
        notice = old.get("notice")
        if notice and events is not None and not events.error and events.notice is None and \
                now > parse_time(notice["termination_time"]).timestamp() + NOTICE_GRACE_S:
            self._release(old, res, f"the {notice['kind']} notice of {notice['seen_at']} passed and the VM lives on")
            old.pop("notice", None)
            notice = None
        if events is not None and events.notice and not notice:
            kind, lead = events.notice
            notice = {"kind": kind, "seen_at": fmt_time(from_epoch(now)),
                      "termination_time": fmt_time(from_epoch(now + lead)),
                      "value": events.maintenance if kind == "maintenance" else events.preempted}
            res.actions.append(f"{'preemption' if kind == 'preempt' else events.maintenance} notice")
        elif events is not None and events.maintenance.upper().startswith("MIGRATE") and \
                old.get("last_maintenance_event") != events.maintenance:
            res.actions.append(f"{events.maintenance}: live migration, nothing to do")
        if events is not None and not events.error:
            state["last_maintenance_event"] = events.maintenance
        kind = "expiry"
        if notice:
            state["notice"] = notice
            t_notice = parse_time(notice["termination_time"])
            if termination is None or t_notice < termination:
                kind = notice["kind"]
                termination, source = t_notice, "maintenance-event" if kind == "maintenance" else "preempted"

        # carry the drain/flush flags of this boot
        for key in ("drained", "drain", "drain_reason", "drained_at", "flushed", "flushed_at", "flush_cause",
                    "flushed_jobs", "requeued_jobs", "left_jobs"):
            if key in old:
                state[key] = old[key]

        res.termination, res.source = termination, source
        if termination is None:
            if not res.errors:  # a failed lookup never undoes a drain
                self._maybe_undrain(old, state, res, None)
            return self._finish(state, res)
        remaining = termination.timestamp() - now
        res.remaining_s = remaining
        state.update(termination_time=fmt_time(termination), source=source, remaining_s=round(remaining))
        reason = expiry_reason(termination, kind, model)

        # 3. drain ahead
        drain_at = max(float(ex.drain_lead_s), self._max_time_s() if ex.drain_at_max_time else 0.0)
        if notice or remaining <= drain_at:
            self._drain(reason, state, res, now)
        else:
            self._maybe_undrain(old, state, res, remaining)

        # 4. flush at the lead (or at once on a notice)
        if notice or remaining <= float(ex.flush_lead_s):
            cause = (f"{notice['value']} notice" if notice and kind != "expiry"
                     else f"VM expiry in {max(remaining, 0):.0f} s")
            self._flush(cause, state, res, now)
        res.next_check_s = _next_threshold(remaining, drain_at, float(ex.flush_lead_s))
        return self._finish(state, res)

    def _finish(self, state: dict[str, Any], res: CheckResult) -> CheckResult:
        try:
            write_state(self.cfg, self.node, state)
        except (OSError, SlurmagentError) as exc:
            res.errors.append(f"cannot write {self.path}: {getattr(exc, 'strerror', None) or exc}")
        res.state = state
        return res

    def _max_time_s(self) -> float:
        """Largest MaxTime of the node's partitions; 0 when any is INFINITE or unknown."""
        try:
            parts = [p for p in self.slurm.node(self.node).partitions.split(",") if p]
            proc = self.slurm.runner([self.slurm.scontrol, "-o", "show", "partition"], self.slurm.timeout_s)
        except SlurmagentError:
            return 0.0
        limits = []
        for line in proc.stdout.splitlines():
            kv = parse_kv(line)
            if kv.get("PartitionName") in parts:
                limits.append(parse_time_limit(kv.get("MaxTime", "UNLIMITED")))
        if not limits or any(x is None for x in limits):
            return 0.0
        return max(x for x in limits if x is not None)

    def _drain(self, reason: str, state: dict[str, Any], res: CheckResult, now: float) -> None:
        try:
            outcome = drain_for_expiry(self.slurm, self.node, reason)
        except SlurmagentError as exc:
            res.errors.append(f"drain failed: {exc}")
            return
        if outcome == "drained":
            res.actions.append(f"drained ({reason})")
            state["drained_at"] = fmt_time(from_epoch(now))
        elif outcome != state.get("drain"):
            res.actions.append(outcome)
        state.update(drained=True, drain=outcome, drain_reason=reason)

    def _maybe_undrain(self, old: dict[str, Any], state: dict[str, Any], res: CheckResult,
                       remaining: float | None) -> None:
        """The termination moved out of the drain window (or went away): undo our own drain."""
        if old.get("notice"):
            return
        if remaining is not None and remaining <= float(self.cfg.expiry.drain_lead_s) + UNDRAIN_MARGIN_S:
            return
        if self._release(old, res, "the termination time moved"):
            for key in ("drained", "drain", "drain_reason", "drained_at"):
                state.pop(key, None)

    def _release(self, old: dict[str, Any], res: CheckResult, why: str) -> bool:
        """Resume the node if it still carries exactly the drain we set; True when our drain is gone."""
        reason = old.get("drain_reason")
        if not old.get("drained") or old.get("drain") not in ("drained", "already-drained") or not reason:
            return False
        try:
            info = self.slurm.node(self.node)
            if info.drained and info.reason == reason:
                self.slurm.resume([self.node])
                res.actions.append(f"resumed: {why} ({reason!r} no longer holds)")
        except SlurmagentError as exc:
            res.errors.append(f"resume failed: {exc}")
            return False
        for key in ("drained", "drain", "drain_reason", "drained_at"):
            old.pop(key, None)
        return True

    def _flush(self, cause: str, state: dict[str, Any], res: CheckResult, now: float) -> None:
        done = set(state.get("flushed_jobs", [])) | set(state.get("requeued_jobs", [])) | set(state.get("left_jobs", []))
        try:
            out = flush_jobs(self.slurm, self.node, done, self.cfg.expiry.unwrapped_jobs,
                             classify_budget_s=max(5.0, float(self.cfg.expiry.flush_lead_s) / 4))
        except SlurmagentError as exc:
            res.errors.append(f"flush failed: {exc}")
            return
        if not state.get("flushed"):
            state.update(flushed=True, flushed_at=fmt_time(from_epoch(now)), flush_cause=cause)
        for key, jobs in (("flushed_jobs", out.signaled), ("requeued_jobs", out.requeued), ("left_jobs", out.left)):
            if jobs:
                state[key] = sorted(set(state.get(key, [])) | set(jobs), key=_job_key)
        if out.signaled:
            res.actions.append(f"flush ({cause}): USR1 to job(s) {','.join(out.signaled)}")
        if out.requeued:
            res.actions.append(f"requeued unwrapped job(s) {','.join(out.requeued)}")
        if out.left:
            res.actions.append(f"left job(s) {','.join(out.left)} alone")
        res.errors.extend(out.errors)


def _job_key(job: str) -> tuple[int, str]:
    head = job.split("_")[0]
    return (int(head) if head.isdigit() else 0, job)


def _jitter(node: str) -> float:
    """0.9..1.1, stable per node: a fleet booted together does not refresh in one burst."""
    import zlib

    return 0.9 + (zlib.crc32(node.encode()) % 2001) / 10000.0


def _next_threshold(remaining: float, drain_at: float, flush_at: float) -> float | None:
    ahead = [remaining - x for x in (drain_at, flush_at) if remaining - x > 0]
    return min(ahead) if ahead else None


def drain_for_expiry(slurm: Slurm, node: str, reason: str) -> str:
    """Drain with the expiry reason; an admin's drain and a slurmagent hardware drain stay."""
    from .hooks import drain_unless_other

    info = slurm.node(node)
    if info.drained_by_slurmagent and not is_expiry_reason(info.reason):
        return "kept-slurmagent-drain"
    if info.drained_by_other:
        return "kept-admin-drain"
    if info.drained_by_slurmagent and info.reason == reason:
        return "already-drained"  # every check in the window: one scontrol call, not two
    return drain_unless_other(slurm, node, reason)


@dataclass
class FlushOutcome:
    signaled: list[str] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def is_wrapped(slurm: Slurm, job_id: str) -> bool:
    """Does the job's batch script exec the slurmagent wrapper (so USR1 means 'flush')?"""
    slurm.calls += 1
    proc = slurm.runner([slurm.scontrol, "write", "batch_script", job_id, "-"], slurm.timeout_s)
    return proc.returncode == 0 and bool(WRAPPED_RE.search(proc.stdout))


def flush_jobs(slurm: Slurm, node: str, done: set[str], unwrapped: str = "requeue",
               classify_budget_s: float = 30.0) -> FlushOutcome:
    """USR1 to the wrapped batch steps running on the node (one scancel), the others per policy.

    Telling wrapped from unwrapped costs one `scontrol write batch_script` per job; past
    `classify_budget_s` (a slow slurmctld) the rest count as unwrapped, so the flush is not late."""
    slurm.calls += 1
    proc = slurm.runner([_sibling(slurm.scontrol, "squeue"), "-h", "-w", node, "-t", "RUNNING", "-o", "%A"],
                        slurm.timeout_s)
    if proc.returncode != 0:
        raise ExpiryError(f"squeue -w {node}: {(proc.stderr or proc.stdout).strip() or 'failed'}")
    jobs = [j for j in dict.fromkeys(proc.stdout.split()) if j not in done]
    out = FlushOutcome()
    signal_ids, requeue_ids = [], []
    budget_end = time.monotonic() + classify_budget_s
    for job in jobs:
        try:
            wrapped = unwrapped == "signal" or (time.monotonic() < budget_end and is_wrapped(slurm, job))
        except SlurmagentError:
            wrapped = False
        if wrapped:
            signal_ids.append(job)
        elif unwrapped == "requeue":
            requeue_ids.append(job)
        else:
            out.left.append(job)
    if signal_ids:
        slurm.calls += 1
        proc = slurm.runner([_sibling(slurm.scontrol, "scancel"), "--batch", "--signal=USR1", *signal_ids],
                            slurm.timeout_s)
        if proc.returncode == 0:
            out.signaled = signal_ids
        else:
            out.errors.append(f"scancel --signal=USR1 {' '.join(signal_ids)}: {(proc.stderr or '').strip() or 'failed'}")
    if requeue_ids:
        try:
            slurm.requeue(requeue_ids)
            out.requeued = requeue_ids
        except SlurmagentError:
            for job in requeue_ids:  # one that cannot be requeued (Requeue=0) must not hide the others
                try:
                    slurm.requeue([job])
                    out.requeued.append(job)
                except SlurmagentError as exc:
                    out.left.append(job)
                    out.errors.append(f"requeue {job}: {exc}")
    return out


# --- the command ------------------------------------------------------------------------------


def _log(cfg: Config, node: str, res: CheckResult, mode: str) -> None:
    from .decisionlog import DecisionLog

    path = Path(cfg.node_path(cfg.hooks.log_file, node)) if cfg.hooks.log_file else cfg.state_path(node) / "hooks.log"
    DecisionLog(path, use_syslog=cfg.hooks.syslog).write(
        "expiry-watch", node=node, mode=mode,
        termination_time=fmt_time(res.termination) if res.termination else None, source=res.source or None,
        remaining_s=round(res.remaining_s) if res.remaining_s is not None else None,
        action="; ".join(res.actions) or "none", errors=res.errors or None)


def run_expiry_watch(cfg: Config, node: str, *, once: bool = False, interval_s: float = 30.0,
                     out: TextIO | None = None, err: TextIO | None = None, slurm: Slurm | None = None,
                     stop: threading.Event | None = None) -> int:
    """`slurmagent expiry-watch [--once]`: exit 0 (errors are logged, the timer runs again)."""
    out, err = out or sys.stdout, err or sys.stderr
    watch = ExpiryWatch(cfg, node, slurm)
    timeout = float(cfg.expiry.metadata_timeout_s)
    said: set[str] = set()

    def report(res: CheckResult) -> None:
        if res.actions:
            print(f"slurmagent expiry-watch: {res.summary()}", file=out, flush=True)
        for e in res.errors:
            if once or e not in said:  # the loop says a lasting error once
                print(f"slurmagent expiry-watch: {node}: {e}", file=err, flush=True)
        if res.actions or (set(res.errors) - said):
            _log(cfg, node, res, "once" if once else "loop")
        said.clear()
        said.update(res.errors)

    if once:
        report(watch.check(probe_events(timeout)))
        return 0

    import signal

    stop = stop or threading.Event()
    wake = threading.Event()

    def on_signal(_s, _f) -> None:
        stop.set()
        wake.set()

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, on_signal)
    events = EventWatcher(timeout, max(5.0, min(60.0, interval_s * 2)), wake, stop,
                          lambda msg: print(f"slurmagent expiry-watch: {node}: {msg}", file=err, flush=True))
    events.start()
    threading.Thread(target=lambda: (stop.wait(), wake.set()), name="expiry-stop", daemon=True).start()
    wake.wait(timeout + 0.5)  # let the first plain reads land
    while not stop.is_set():
        wake.clear()
        snap = events.snapshot()
        snap.error = ""  # outages are reported by the watcher itself, once
        try:
            res = watch.check(snap)
        except SlurmagentError as exc:
            print(f"slurmagent expiry-watch: {node}: {exc}", file=err, flush=True)
            res = None
        if res is not None:
            report(res)
        delay = interval_s
        if res is not None and res.next_check_s is not None:
            delay = min(delay, max(res.next_check_s + 0.05, 0.05))
        wake.wait(delay)
    return 0


# --- the prolog guard (called from hooks.run_hook on the healthy prolog path) ------------------


def prolog_guard(cfg: Config, ctx: Any, slurm_factory: Callable[[Config], Slurm], log: Any, stderr: TextIO) -> int | None:
    """Keep a job that would outlive the VM off this node. None: let the job run; 1: requeue it.

    Without a termination time this is one read of the state file: no scontrol, no google."""
    mode = cfg.expiry.prolog_guard
    if mode == "off" or not ctx.job_id:
        return None
    try:
        data = json.loads(state_file(cfg, ctx.node).read_bytes())
        text = data.get("termination_time")
    except (OSError, ValueError, AttributeError):
        return None
    if not text:
        return None
    if data.get("boot_id") and data["boot_id"] != current_boot_id():
        return None  # left over from an earlier life of this VM
    try:
        end = parse_time(text)
    except ValueError:
        return None
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
    limit = job.time_limit or "UNLIMITED"
    detail = (f"job {ctx.job_id}: time limit {limit} ends after the VM's termination at {fmt_time(end)} "
              f"(in {human(end.timestamp() - now)}, flush lead {float(cfg.expiry.flush_lead_s):g} s)")
    if mode == "requeue":
        try:
            wrapped = is_wrapped(slurm, ctx.job_id)
        except SlurmagentError:
            wrapped = False
        if wrapped:  # it flushes at the lead and resumes elsewhere: cheaper than idling the node
            log.write(ctx.hook, node=ctx.node, job=ctx.job_id, verdict="healthy", rule="expiry",
                      action="none (wrapped: flushes at the lead)", detail=detail)
            return None
    if mode == "warn":
        log.write(ctx.hook, node=ctx.node, job=ctx.job_id, verdict="healthy", rule="expiry", action="warned",
                  detail=detail)
        print(f"slurmagent {ctx.hook}: warning: {detail}", file=stderr)
        return None
    reason = data.get("drain_reason") if is_expiry_reason(str(data.get("drain_reason", ""))) else None
    reason = reason or expiry_reason(end, "expiry", str((data.get("scheduling") or {}).get("provisioning_model", "")))
    try:
        action = drain_for_expiry(slurm, ctx.node, reason)
    except SlurmagentError as exc:
        action = f"drain-failed: {exc}"  # exit 1 all the same: Slurm drains ("Prolog error") and requeues
    actions = [action, "requeue"]
    from .hooks import _nohold_configured, _spawn_release_watch

    if not _nohold_configured(cfg):
        _spawn_release_watch(ctx.job_id, cfg)
        actions.append("release-watch")
    log.write(ctx.hook, node=ctx.node, job=ctx.job_id, verdict="expiry", rule="expiry", reason=reason,
              action=",".join(actions), detail=detail)
    print(f"slurmagent {ctx.hook}: {detail}: requeued off {ctx.node} ({reason})", file=stderr)
    return 1

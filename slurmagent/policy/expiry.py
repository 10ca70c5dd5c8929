"""Pure expiry decisions: drain ahead of the VM's end, flush its jobs in time."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable
from ..core import reasons
from ..core.timefmt import fmt_time, from_epoch, parse_time


EXPIRY_SCHEMA = 1
STALE_RECHECK_S = 300.0  # the time passed but we live: ask the API again at most this often
UNDRAIN_MARGIN_S = 60.0  # the end moved out of the drain window by more than this: undo our drain
NOTICE_GRACE_S = 300.0  # alive this long after a notice's stop time, and no notice now: it is over
GPU_MAINTENANCE_NOTICE_S = 3600.0  # a GPU VM's TERMINATE_ON_HOST_MAINTENANCE comes about an hour ahead
EXPIRY_DRAIN_KEYS = ("drained", "drain", "drain_reason", "drained_at")
EXPIRY_CARRIED_KEYS = (*EXPIRY_DRAIN_KEYS, "flushed", "flushed_at", "flush_cause", "flushed_jobs", "requeued_jobs",
                       "left_jobs")


def refresh_jitter(node: str) -> float:
    """0.9..1.1, stable per node: a fleet booted together does not refresh in one burst."""
    return 0.9 + (zlib.crc32(node.encode()) % 2001) / 10000.0


def api_answer_fresh(cached: dict[str, Any] | None, now: float, refresh_s: float, node: str, *,
                     event_changed: bool = False, window_soon_s: float = 0.0) -> bool:
    """Is the cached Compute API answer still good? Not when old, nor when the VM outlived it,
    nor when the metadata `maintenance-event` changed since (the window is read again), nor
    older than STALE_RECHECK_S while a maintenance window is within `window_soon_s` (it may move)."""
    if not cached or event_changed:
        return False
    age = now - float(cached.get("checked_at_epoch", 0))
    t = cached.get("scheduling", {}).get("termination_time")
    outlived = t is not None and now > parse_time(t).timestamp() + UNDRAIN_MARGIN_S
    w = cached.get("scheduling", {}).get("maintenance_window_start")
    window_near = w is not None and parse_time(w).timestamp() - now < window_soon_s
    return age < refresh_s * refresh_jitter(node) and not ((outlived or window_near) and age > STALE_RECHECK_S)


@dataclass
class ExpiryDecision:
    """One check's decision; `commands/expiry.py` carries out the steps and records their results in `state`."""

    state: dict[str, Any]  # the state to write, before the steps' own results
    termination: datetime | None = None
    source: str = ""
    remaining_s: float | None = None
    notes: list[str] = field(default_factory=list)  # what the check saw (notices, live migration, old state)
    release: str | None = None  # undo our own drain, for this reason (then drop EXPIRY_DRAIN_KEYS)
    drain_reason: str | None = None  # drain now with this reason
    flush_cause: str | None = None  # flush the running jobs now
    next_check_s: float | None = None  # when the next threshold is crossed (loop mode)


def _our_drain_stands(old: dict[str, Any]) -> bool:
    return bool(old.get("drained") and old.get("drain_reason")
                and str(old.get("drain", "")).startswith(("drained", "already-drained", "pending")))


def _remembered_notice(withdrawn: dict[str, Any] | None, now: float, drain_lead_s: float) -> dict[str, Any] | None:
    """A withdrawn maintenance notice, while a re-issue should keep its stop time (a notice
    withdrawn and re-issued every few minutes must not push T an hour away each time). It is
    cancelled for real, and forgotten, once withdrawn for longer than `drain_lead_s` or once its
    stop time is NOTICE_GRACE_S past (the VM lived through it). A known API window wins over it."""
    if not withdrawn:
        return None
    try:
        t = parse_time(withdrawn["termination_time"]).timestamp()
        since = parse_time(withdrawn["withdrawn_at"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return None
    if now - since > drain_lead_s or now > t + NOTICE_GRACE_S:
        return None
    return withdrawn


def decide_expiry(*, now: float, node: str, boot_id: str, old: dict[str, Any], override: datetime | None,
                  api: dict[str, Any] | None, events: Any, lookup_failed: bool, drain_lead_s: float,
                  flush_lead_s: float, max_time_s: Callable[[], float] | None = None) -> ExpiryDecision:
    """The expiry watch's decision for one check, from what it knows now.

    `old`: the state file; `override`: `[expiry] termination_time`; `api`: the (cached) Compute
    API answer; `events`: the metadata notices (gcp.events.Events) or None; `lookup_failed`:
    the metadata server or the API failed this time (a failed lookup never undoes a drain);
    `max_time_s`: the node's largest partition MaxTime, asked only when a time is known."""
    d = ExpiryDecision({"schema": EXPIRY_SCHEMA, "node": node, "boot_id": boot_id, "checked_at": fmt_time(from_epoch(now))})
    if old and old.get("boot_id") != boot_id:
        d.notes.append(f"discarded the expiry state of an earlier boot ({old.get('boot_id') or 'unknown'})")
        old = {}
    old = dict(old)
    state = d.state

    # 1. termination time: config, else the (cached) Compute API
    termination, model, source = override, "", "config"
    if override is None:
        source = "compute-api"
        if api:
            state["api"], state["scheduling"] = api, api["scheduling"]
            t = api["scheduling"].get("termination_time")
            termination = parse_time(t) if t else None
            model = str(api["scheduling"].get("provisioning_model") or "")

    # 2. host maintenance and preemption. T for a maintenance notice: the API's
    # upcomingMaintenance.windowStartTime when known, else about an hour ahead on a GPU VM, else
    # 60 s; a preemption: 30 s. A notice is remembered until the VM outlives it, or dropped when
    # withdrawn well before its T (the window was rescheduled or cancelled).
    sched = api["scheduling"] if api and override is None else {}
    window_text = sched.get("maintenance_window_start")
    window = parse_time(window_text) if window_text else None
    terminates = sched.get("on_host_maintenance") == "TERMINATE"
    notice = old.get("notice")
    remembered = _remembered_notice(old.get("withdrawn_notice"), now, drain_lead_s)
    withdrawn = events is not None and not events.error and events.notice is None
    if notice and withdrawn:
        t_old = parse_time(notice["termination_time"]).timestamp()
        if now < t_old - UNDRAIN_MARGIN_S:
            d.notes.append(f"the {notice['kind']} notice of {notice['seen_at']} was withdrawn (rescheduled or cancelled)")
            if notice["kind"] == "maintenance":  # its T is kept for a re-issue (see _remembered_notice)
                remembered = {**notice, "withdrawn_at": fmt_time(from_epoch(now))}
            notice = None
        elif now > t_old + NOTICE_GRACE_S:
            if _our_drain_stands(old):
                d.release = f"the {notice['kind']} notice of {notice['seen_at']} passed and the VM lives on"
            notice = None
    if events is not None and events.notice and not notice:
        kind, lead = events.notice
        when = now + lead
        if kind == "maintenance":
            when = window.timestamp() if window is not None else now + (
                GPU_MAINTENANCE_NOTICE_S if sched.get("gpu_vm") else lead)
        notice = {"kind": kind, "seen_at": fmt_time(from_epoch(now)), "termination_time": fmt_time(from_epoch(when)),
                  "value": events.maintenance if kind == "maintenance" else events.preempted}
        d.notes.append(f"{'preemption' if kind == 'preempt' else events.maintenance} notice")
        if kind == "maintenance" and window is None and remembered is not None:
            if parse_time(remembered["termination_time"]).timestamp() < when:
                notice.update(termination_time=remembered["termination_time"], seen_at=remembered["seen_at"])
                d.notes.append(f"re-issued after its withdrawal at {remembered['withdrawn_at']}: it keeps the stop "
                               f"time it first announced, {remembered['termination_time']}")
            remembered = None
    elif notice and notice["kind"] == "maintenance" and window is not None and \
            fmt_time(window) != notice["termination_time"]:
        d.notes.append(f"maintenance window moved to {fmt_time(window)}")
        notice = {**notice, "termination_time": fmt_time(window)}
    elif events is not None and events.migrating and old.get("last_maintenance_event") != events.maintenance:
        d.notes.append(f"{events.maintenance}: live migration, nothing to do")
    if events is not None and not events.error:
        state["last_maintenance_event"] = events.maintenance
    if remembered is not None:
        state["withdrawn_notice"] = remembered
    kind = "expiry"
    if notice:
        state["notice"] = notice
        t_notice = parse_time(notice["termination_time"])
        if termination is None or t_notice < termination:
            kind = notice["kind"]
            termination, source = t_notice, "maintenance-event" if kind == "maintenance" else "preempted"
    elif window is not None and terminates and (termination is None or window < termination):
        kind, termination, source = "maintenance", window, "upcoming-maintenance"  # scheduled, no notice yet

    state.update({k: old[k] for k in EXPIRY_CARRIED_KEYS if k in old})  # this boot's drain/flush flags
    d.termination, d.source = termination, source
    if termination is None:
        if not lookup_failed and d.release is None and not notice and _our_drain_stands(old):
            d.release = "the termination time moved"
        return d
    remaining = termination.timestamp() - now
    d.remaining_s = remaining
    state.update(termination_time=fmt_time(termination), source=source, remaining_s=round(remaining))

    # 3. drain at T - drain lead (at once when the notice is shorter), or undo our drain when the
    # end moved out of the window (a later flex end, a rescheduled or cancelled maintenance)
    drain_at = max(drain_lead_s, max_time_s() if max_time_s is not None else 0.0)
    if remaining <= drain_at:
        d.drain_reason = reasons.expiry_reason(termination, kind, model)
    elif d.release is None and not lookup_failed and remaining > drain_lead_s + UNDRAIN_MARGIN_S \
            and _our_drain_stands(old):
        d.release = "the termination time moved"

    # 4. flush at T - flush lead (at once when the notice is shorter)
    if remaining <= flush_lead_s:
        if notice and kind != "expiry":
            d.flush_cause = f"{notice['value']} notice"
        elif kind == "maintenance":
            d.flush_cause = f"host maintenance in {max(remaining, 0):.0f} s"
        else:
            d.flush_cause = f"VM expiry in {max(remaining, 0):.0f} s"
    ahead = [remaining - x for x in (drain_at, flush_lead_s) if remaining - x > 0]
    d.next_check_s = min(ahead) if ahead else None
    return d


# --- when the termination time cannot be learned: passing or lasting --------------------------

READ_FAILURES_KEY = "api_read_failures"  # the state file's record of the reads that failed in a row
MALFORMED_LASTING_AFTER = 3  # malformed answers in a row before expiry protection counts as off
LASTING_AT_ONCE = ("permission", "not-found", "refused")  # asking again will not help


def read_failure_reason(status: int | None, answered: bool, message: str) -> str:
    """Why the Compute API read failed, from the error's HTTP status, whether a reply came, and
    its words: `permission` (401/403), `not-found` (no instance named like the node), `refused`
    (another 4xx), `malformed` (a reply that could not be used), else `unavailable` (network,
    timeout, 429/5xx after the retries: it passes by itself)."""
    if status in (401, 403):
        return "permission"
    if status == 404 or "no instance" in message:
        return "not-found"
    if status is not None and 400 <= status < 500 and status not in (408, 429):
        return "refused"
    if answered or "not a usable time" in message:
        return "malformed"
    return "unavailable"


def read_failure_streak(old: Any, reason: str | None, now: float) -> tuple[dict[str, Any] | None, str | None]:
    """(the record to keep, the reason when expiry protection is off) after one read: a success
    (reason None) clears the record; a passing failure keeps it as it was (it neither confirms
    nor ends a row); a lasting one counts in a row with the same reason. Off: a permission,
    not-found or refused answer at once, a malformed answer MALFORMED_LASTING_AFTER times in a row."""
    if reason is None:
        return None, None
    prev = old if isinstance(old, dict) else {}
    if reason == "unavailable":
        return (prev or None), None
    count = int(prev.get("count", 0)) + 1 if prev.get("reason") == reason else 1
    since = prev.get("since") if prev.get("reason") == reason and prev.get("since") else fmt_time(from_epoch(now))
    record = {"reason": reason, "count": count, "since": since}
    lasting = reason in LASTING_AT_ONCE or count >= MALFORMED_LASTING_AFTER
    return record, (reason if lasting else None)

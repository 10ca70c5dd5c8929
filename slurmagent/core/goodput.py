"""The goodput ledger: one record per attempt of a wrapped job, and where each job's time went.

`run/ledger.py` writes a record per attempt beside the checkpoint (`<prefix>/ledger/<job>-<attempt>.json`,
read back by `checkpoint/gcs/ledger.py`); `slurmagent report` folds them here. Pure: dicts in,
dicts and text out, no clock (the caller passes `now`).

Times are seconds since the epoch. For one attempt, with S `started`, R `restore_s`, P
`first_progress`, C `last_commit` (a commit of this attempt), E `ended`, F = E - `flush_s`:

    restore   = R                      wrapper start -> trainer start (the restore)
    startup   = P - (S + R)            trainer start -> first progress (all of F - S - R without progress)
    progress  = min(C, F) - P          "making progress": first progress -> last commit of the attempt
    recompute = F - max(C, P)          done after the last commit: lost, done again by the next attempt;
                                       where the steps are known, the steps redone at the attempt's pace:
                                       (`last_progress_step` - the step the next attempt restores:
                                       this attempt's `committed_step`, else the last one before) x
                                       `step_s`, and progress = F - P - recompute
    flush     = E - F                  the checkpoint at the end and the final sync
    pending   = next S - E             PENDING until the next attempt started

so the five parts of an attempt add up to E - S, and with the PENDING gaps the job's wall time
(first start -> last end). ETTR = sum of progress / wall time. An attempt with only its
"started" record (killed, or running now) counts from S + R to the next start as `unrecorded`.
"""

from __future__ import annotations

import math

from typing import Any, Iterable

from .timefmt import fmt_time, from_epoch

SCHEMA = 1
LEDGER_DIR = "ledger"
# How an attempt ended (`end`); `why` says it in words.
ENDS = ("completed", "failed", "sigterm", "time-limit", "expiry", "maintenance", "preemption", "gpu-fault",
        "hang", "self-requeue", "restore-failed", "error", "lost", "running-or-lost", "other")
NOT_INTERRUPTIONS = ("completed", "failed", "running-or-lost")
CAUSES = ("startup", "restore", "recompute", "hang_detection", "flush", "pending", "unrecorded")  # where lost time went
FAULT_SIGNAL = "SIGPWR"  # slurm/model.FAULT_FLUSH_SIGNAL by name: a GPU died under the job
SELF_REQUEUE = "the job requeued itself"  # run/supervisor.SELF_REQUEUE_CAUSE
EXPIRY_SOURCES = {"maintenance-event": "maintenance", "upcoming-maintenance": "maintenance",
                  "preempted": "preemption"}  # any other termination source (compute-api, config): expiry


def record_name(job: str, attempt: int) -> str:
    return f"{job}-{attempt}.json"


def end_of(*, flushed: bool, flush_cause: str, child_code: int | None, expiry_source: str = "",
           fault_node: str = "", fault: str = "", summary: str = "") -> tuple[str, str]:
    """(end, why) from what the wrapper knew when it stopped. A SIGTERM or SIGUSR1 while the
    node's expiry state holds a near termination time is that termination (`expiry_source`)."""
    if not flushed:
        if child_code is None:  # the trainer never ran: the restore failed (requeued without a node)
            return "restore-failed", summary or "the job never started"
        if child_code == 0:
            return "completed", "the job exited 0"
        if child_code is not None and child_code < 0:
            return "failed", f"the job died of signal {-child_code}"
        return "failed", f"the job exited {child_code}"
    if flush_cause == FAULT_SIGNAL:
        where = f" on node {fault_node}" if fault_node else ""
        return "gpu-fault", f"GPU fault{where}" + (f" ({fault})" if fault else "") + " (the watch's fault flush)"
    if flush_cause.startswith("hang: "):  # hang/monitor.HANG_CAUSE: the wrapper's stall rule
        return "hang", flush_cause
    if flush_cause == SELF_REQUEUE:
        return "self-requeue", SELF_REQUEUE
    if flush_cause.startswith("VM expiry") or (expiry_source and flush_cause in ("SIGTERM", "SIGUSR1")):
        end = EXPIRY_SOURCES.get(expiry_source, "expiry")
        return end, f"{flush_cause} ({end}: termination source {expiry_source or 'unknown'})"
    if flush_cause == "SIGTERM":
        return "sigterm", "SIGTERM (scancel, scontrol requeue by an admin, Slurm preemption or a node shutdown)"
    if flush_cause == "SIGUSR1":
        return "time-limit", "SIGUSR1 (Slurm's end-of-time signal, or a flush asked by hand)"
    if flush_cause.startswith("restore failed"):
        return "restore-failed", flush_cause
    return "other", flush_cause or "unknown"


UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """`--since`: a number with an optional unit (s, m, h, d, w; seconds when none): "90m", "7d"."""
    raw = text.strip().lower()
    unit = raw[-1:] if raw[-1:] in UNITS else "s"
    number = raw[:-1] if raw[-1:] in UNITS else raw
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a duration (e.g. 90m, 12h, 7d)") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{text!r} is not a duration (e.g. 90m, 12h, 7d)")
    return value * UNITS[unit]


# --- folding records -----------------------------------------------------------------------


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


EPOCH_RANGE = (0.0, 4.1e9)  # up to 2099: a time outside (or not finite) is a lie or a bug
MAX_SECONDS = 1e7  # a restore or a flush of ~115 days at most
MAX_TEXT = 4096
_TIMES = ("started", "first_rank_progress", "last_progress", "ended", "first_progress", "last_commit")
_DURATIONS = ("restore_s", "flush_s", "step_s")
_COUNTS = ("gpus", "node_count")
_STEPS = ("last_progress_step", "committed_step")  # a trainer's step numbers
MAX_STEP = 10**15
_TEXTS = ("end", "why", "nodes", "fault_node", "prefix")


def _finite(value: Any) -> float | None:
    v = _num(value)
    return v if v is not None and math.isfinite(v) else None


def clean_record(record: Any) -> tuple[dict | None, str]:
    """(the record with only the fields the report uses, each of its type and range; or None and
    why it is unusable). Every job's user writes records under their own prefix: nothing in one
    is trusted, and a bad one costs only itself."""
    if not isinstance(record, dict):
        return None, "not a JSON object"
    job, attempt = record.get("job"), record.get("attempt")
    if not isinstance(job, str) or not 0 < len(job) <= 256:  # a Cloud Run task's: "<job name>-task-<i>"
        return None, "job: not a job id"
    if isinstance(attempt, bool) or not isinstance(attempt, int) or not 0 <= attempt <= 1_000_000:
        return None, "attempt: not a whole number in [0, 1000000]"
    out: dict[str, Any] = {"job": job, "attempt": attempt}
    for key in _TIMES:
        if record.get(key) is None and key != "started":
            continue
        t = _finite(record.get(key))
        if t is None or not EPOCH_RANGE[0] <= t <= EPOCH_RANGE[1]:
            return None, f"{key}: not a time between 1970 and 2099"
        out[key] = t
    for key in _DURATIONS:
        if record.get(key) is None:
            continue
        d = _finite(record.get(key))
        if d is None or not 0 <= d <= MAX_SECONDS:
            return None, f"{key}: not a number of seconds in [0, {MAX_SECONDS:g}]"
        out[key] = d
    for key in _COUNTS:
        v = record.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 100_000:
            return None, f"{key}: not a whole number in [0, 100000]"
        out[key] = v
    for key in _STEPS:
        v = record.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_STEP:
            return None, f"{key}: not a whole number in [0, {MAX_STEP:g}]"
        out[key] = v
    for key in _TEXTS:
        v = record.get(key)
        if v is None:
            continue
        if not isinstance(v, str):
            return None, f"{key}: not text"
        out[key] = v[:MAX_TEXT]
    if "requeued" in record:
        out["requeued"] = record["requeued"] is True
    return out, ""


def attempt_parts(rec: dict, next_start: float | None, restored_step: int | None = None) -> dict[str, Any]:
    """One attempt's seconds by part (see the module docstring); `end` the time it counts to.
    `restored_step`: the step an earlier attempt's last commit held (what the next attempt
    restores when this one committed nothing)."""
    s = float(rec["started"])
    r = max(0.0, _num(rec.get("restore_s")) or 0.0)
    e = _num(rec.get("ended"))
    parts = dict.fromkeys(("progress", *CAUSES), 0.0)
    if e is None:  # only the "started" record: killed, or running now
        end = max(s + r, next_start) if next_start is not None else s + r
        parts["restore"] = min(r, end - s)
        parts["unrecorded"] = max(0.0, end - s - r)
        return {"parts": parts, "end": end, "ended": False}
    e = max(e, s)
    r = min(r, e - s)
    f = max(s + r, e - max(0.0, _num(rec.get("flush_s")) or 0.0))
    p, c = _num(rec.get("first_progress")), _num(rec.get("last_commit"))
    ranks_first, last = _num(rec.get("first_rank_progress")), _num(rec.get("last_progress"))
    if ranks_first is not None:  # the ranks' own trainer.progress: training began then, commit or not
        p = ranks_first if p is None else min(p, ranks_first)
    parts["restore"], parts["flush"] = r, e - f
    if p is None:
        parts["startup"] = f - s - r
    else:
        p = min(max(p, s + r), f)
        parts["startup"] = p - s - r
        if c is not None and c > p:
            parts["progress"] = min(c, f) - p
        worked = f  # the work since the last commit, redone by the next attempt, ends here
        if rec.get("end") == "hang" and last is not None:  # then the wait for the hang watch to see it
            worked = min(max(last, p), f)
            parts["hang_detection"] = f - worked
        parts["recompute"] = max(0.0, worked - max(c if c is not None else p, p))
        redone = _redone_s(rec, restored_step)
        if redone is not None:  # the steps redone at the job's pace: a commit lags its save
            parts["recompute"] = min(redone, max(0.0, worked - p))
            parts["progress"] = max(0.0, worked - p - parts["recompute"])
    return {"parts": parts, "end": e, "ended": True}


def _redone_s(rec: dict, restored_step: int | None) -> float | None:
    """The seconds the next attempt redoes, from the steps (None: not known)."""
    last, pace = rec.get("last_progress_step"), _num(rec.get("step_s"))
    if rec.get("committed_step") is None and rec.get("last_commit") is not None:
        return None  # it committed, at a step not known: by the times
    base = rec["committed_step"] if rec.get("committed_step") is not None else restored_step
    if not isinstance(last, int) or not isinstance(base, int) or pace is None or not math.isfinite(pace):
        return None
    return max(0, last - base) * pace


def job_report(records: list[dict]) -> dict[str, Any]:
    """One job's attempts (sorted by attempt), its timeline, ETTR and losses by cause."""
    recs = sorted(records, key=lambda r: (r["attempt"], r["started"]))
    attempts, lost_s = [], dict.fromkeys(CAUSES, 0.0)
    lost_gpu_h = dict.fromkeys(CAUSES, 0.0)
    progress_s = progress_gpu_h = 0.0
    restored: int | None = None  # the step the last commit so far holds
    for i, rec in enumerate(recs):
        nxt = float(recs[i + 1]["started"]) if i + 1 < len(recs) else None
        folded = attempt_parts(rec, nxt, restored)
        restored = rec["committed_step"] if rec.get("committed_step") is not None else restored
        parts, gpus = folded["parts"], int(rec.get("gpus") or 0)
        if nxt is not None:
            parts["pending"] = max(0.0, nxt - folded["end"])
        for cause in CAUSES:
            lost_s[cause] += parts[cause]
            lost_gpu_h[cause] += parts[cause] * gpus / 3600.0
        progress_s += parts["progress"]
        progress_gpu_h += parts["progress"] * gpus / 3600.0
        end = rec.get("end") if folded["ended"] else ("lost" if nxt is not None else "running-or-lost")
        attempts.append({
            "attempt": rec["attempt"], "started": float(rec["started"]), "ended": folded["end"] if folded["ended"] else None,
            "end": end or "other", "why": (rec.get("why") or "") if folded["ended"] else (
                "no end record: the wrapper was killed (SIGKILL, node lost)" if nxt is not None
                else "no end record yet: running now, or the wrapper was killed"),
            "until": folded["end"], "interruption": (end or "other") not in NOT_INTERRUPTIONS, "requeued": bool(rec.get("requeued")),
            "nodes": rec.get("nodes", ""), "node_count": int(rec.get("node_count") or 0), "gpus": gpus,
            "fault_node": rec.get("fault_node", ""), "restore_s": _num(rec.get("restore_s")),
            "first_progress": _num(rec.get("first_progress")), "last_commit": _num(rec.get("last_commit")),
            "flush_s": _num(rec.get("flush_s")), "seconds": {k: round(v, 3) for k, v in parts.items()},
        })
    first = attempts[0]["started"]
    last_end = max(a["until"] for a in attempts)
    wall = max(0.0, last_end - first)
    return {
        "job": recs[0]["job"], "prefix": recs[0].get("prefix", ""), "attempts": attempts,
        "interruptions": [{"attempt": a["attempt"], "at": a["until"], "cause": a["end"], "why": a["why"]}
                          for a in attempts if a["interruption"]],
        "started": first, "ended": last_end, "wall_s": round(wall, 3), "progress_s": round(progress_s, 3),
        "ettr": round(progress_s / wall, 4) if wall > 0 else None,
        "gpus": max(a["gpus"] for a in attempts), "progress_gpu_hours": round(progress_gpu_h, 4),
        "lost": {c: {"seconds": round(lost_s[c], 3), "gpu_hours": round(lost_gpu_h[c], 4)} for c in CAUSES},
    }


def build_report(records: Iterable[Any], *, now: float, job: str | None = None, since_s: float | None = None,
                 errors: Iterable[str] = ()) -> dict[str, Any]:
    """The report over every record read: per job (by prefix and id), and the totals."""
    groups: dict[tuple[str, str], list[dict]] = {}
    skipped, why_skipped = 0, {}
    for raw in records:
        rec, why = clean_record(raw)
        if rec is None:
            skipped += 1
            why_skipped[why] = why_skipped.get(why, 0) + 1
            continue
        if job is not None and rec["job"] != job:
            continue
        groups.setdefault((rec.get("prefix", ""), rec["job"]), []).append(rec)
    jobs = [job_report(recs) for _, recs in sorted(groups.items())]
    if since_s is not None:
        jobs = [j for j in jobs if j["ended"] >= now - since_s]
    jobs.sort(key=lambda j: j["started"])
    wall = sum(j["wall_s"] for j in jobs)
    progress = sum(j["progress_s"] for j in jobs)
    lost = {c: {"seconds": round(sum(j["lost"][c]["seconds"] for j in jobs), 3),
                "gpu_hours": round(sum(j["lost"][c]["gpu_hours"] for j in jobs), 4)} for c in CAUSES}
    return {
        "schema": SCHEMA, "generated": now, "jobs": jobs,
        "totals": {"jobs": len(jobs), "attempts": sum(len(j["attempts"]) for j in jobs),
                   "interruptions": sum(len(j["interruptions"]) for j in jobs), "wall_s": round(wall, 3),
                   "progress_s": round(progress, 3), "ettr": round(progress / wall, 4) if wall > 0 else None,
                   "lost": lost},
        "causes": list(CAUSES), "errors": list(errors), "skipped_records": skipped,
        "skipped_why": dict(sorted(why_skipped.items())),
    }


# --- what the root side logged (decision logs) and the repair loop's per-node faults ----------

EVENT_FIELDS = ("time", "node", "event", "verdict", "rule", "gpu", "xid", "reason", "action", "source")


def root_event(record: Any) -> dict[str, Any] | None:
    """A decision-log line worth a job's attention: anything but a healthy check that did nothing."""
    if not isinstance(record, dict) or not isinstance(record.get("time"), str):
        return None
    if record.get("verdict") == "healthy" and record.get("action") in (None, "none"):
        return None
    return {k: record[k] for k in EVENT_FIELDS if record.get(k) is not None}


def job_ids_of(record: dict) -> list[str]:
    """The job ids a decision-log line names (`job`, or a `jobs` list)."""
    ids = [record.get("job")] + (record.get("jobs") if isinstance(record.get("jobs"), list) else [])
    return [str(i) for i in ids if isinstance(i, (str, int)) and not isinstance(i, bool) and str(i)]


def attach_root_events(report: dict[str, Any], records: Iterable[Any]) -> dict[str, Any]:
    """Per job, the root side's lines that name its id (drains by a prolog, evictions, fault
    requeues, the job's own requests), oldest first, as `root_events`."""
    by_job: dict[str, list[dict]] = {j["job"]: [] for j in report["jobs"]}
    for rec in records:
        if not isinstance(rec, dict):
            continue
        for jid in job_ids_of(rec):
            event = root_event(rec) if jid in by_job else None
            if event is not None:
                by_job[jid].append(event)
    for j in report["jobs"]:
        j["root_events"] = sorted(by_job[j["job"]], key=lambda e: e["time"])
    return report


def format_event(e: dict[str, Any]) -> str:
    what = " ".join(str(e[k]) for k in ("verdict", "rule") if e.get(k))
    gpu = f" gpu {e['gpu']}" if e.get("gpu") is not None else ""
    xid = f" xid {e['xid']}" if e.get("xid") is not None else ""
    said = f"{what}{gpu}{xid}".strip()
    return (f"{e['time']}  {e.get('node', '?')}  {e.get('event', '?')}: {said + ' -> ' if said else ''}"
            f"{e.get('action', '-')}" + (f" ({e['reason']})" if e.get("reason") else ""))


# --- text ------------------------------------------------------------------------------------


def hms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def utc(t: float | None) -> str:
    return "-" if t is None else fmt_time(from_epoch(t))


def format_text(report: dict[str, Any]) -> str:
    """The report as a person reads it: per job its attempts, interruptions, ETTR and losses."""
    lines = []
    tot = report["totals"]
    if not report["jobs"]:
        lines.append("no ledger records found")
    for j in report["jobs"]:
        lines.append(f"job {j['job']}  ({j['prefix']})" if j["prefix"] else f"job {j['job']}")
        lines.append(f"  ETTR {pct(j['ettr'])}: making progress {hms(j['progress_s'])} of {hms(j['wall_s'])} "
                     f"wall ({utc(j['started'])} -> {utc(j['ended'])}), {j['gpus']} GPUs")
        for a in j["attempts"]:
            sec = a["seconds"]
            lines.append(f"  attempt {a['attempt']}: {utc(a['started'])} -> {utc(a['ended'])}  {a['end']}"
                         + (" (requeued)" if a["requeued"] else "") + f": {a['why']}")
            lines.append("    " + "  ".join(f"{k} {hms(sec[k])}" for k in ("restore", "startup", "progress", "recompute",
                                                                           "hang_detection", "flush", "pending", "unrecorded")
                                          if sec[k] or k == "progress"))
        lost = ", ".join(f"{c} {j['lost'][c]['gpu_hours']:.2f} GPU-h ({hms(j['lost'][c]['seconds'])})" if j["gpus"]
                         else f"{c} {hms(j['lost'][c]['seconds'])}" for c in CAUSES if j["lost"][c]["seconds"])
        lines.append(f"  lost: {lost or 'nothing'}")
        if j.get("root_events"):
            lines.append("  root-side events for this job:")
            lines.extend(f"    {format_event(e)}" for e in j["root_events"])
    if len(report["jobs"]) > 1:
        lines.append(f"total: {tot['jobs']} jobs, {tot['attempts']} attempts, {tot['interruptions']} interruptions, "
                     f"ETTR {pct(tot['ettr'])}")
    if report.get("nodes") is not None:
        lem = report.get("lemon", {})
        lines.append(f"nodes (repairs within {lem.get('window_s', 0) / 86400:g} days; a lemon from {lem.get('faults')}):"
                     + ("" if report["nodes"] else " none repaired"))
        lines.extend(f"  {n['node']}: {n['faults']} fault(s)"
                     + (f" ({n['hangs']} of them hangs whose evidence named it"
                        + (f"; the last: {n['hang_evidence']}" if n.get("hang_evidence") else "") + ")"
                        if n.get("hangs") else "")
                     + f", last {utc(n['last_fault'])}" + ("  LEMON" if n["lemon"] else "") for n in report["nodes"])
    for err in report["errors"]:
        lines.append(f"warning: {err}")
    if report.get("skipped_records"):
        why = "; ".join(f"{n} x {w}" for w, n in (report.get("skipped_why") or {}).items())
        lines.append(f"warning: {report['skipped_records']} unreadable record(s) skipped" + (f" ({why})" if why else ""))
    return "\n".join(lines)

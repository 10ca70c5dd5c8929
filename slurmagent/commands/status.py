"""`slurmagent status`: nodes drained by slurmagent (or held back by the breaker), repair
state, the breaker, journal backlog and expiry countdowns, as a table or JSON; and
`slurmagent status --job ID`: a job's checkpoint as its owner sees it.

Reads only: one `scontrol -o show node`, the journals and the expiry state files. For a job,
the bucket's committed manifest is the truth and readable from anywhere (a login node sees no
node-local checkpoint directory); the wrapper's status record (`checkpoint/report.py`), when this
node holds it, adds the running attempt's view: its last sync, the lag, held-back units, and the
remote the wrapper really uses (`--remote`, or the per-job default). The record is the job
owner's file: it is shown and its remote is read, nothing is done on its word.

Exit codes (`status_exit_code`, in the JSON as `exit_code`): 3 when Slurm (for `--job` also
the bucket) could not be read, and then the JSON says `null`/`"unknown"` for what it did not
read; 1 when it found problems (a fault drain, a node held back by the breaker, the breaker
open, journal actions pending); else 0.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Callable, Mapping

from ..checkpoint.report import age_s, human_bytes, manifest_summary, read_record, record_path

from ..state import expiry_state
from ..policy import breaker as breaker_policy
from ..core import hostlist, reasons
from ..state.build import version
from ..state.config import Config
from ..errors import EXIT_OK, EXIT_PROBLEMS, EXIT_UNREACHABLE, SlurmagentError, SlurmError
from ..state.host import node_name
from ..state.journal import Journal
from ..state.repair_state import drained_at as load_drained_at
from ..slurm.commands import Slurm
from ..core.timefmt import human


def collect_status(cfg: Config, slurm: Slurm | None = None, local_node: str | None = None,
                   clock: Callable[[], float] = time.time) -> dict[str, Any]:
    slurm = slurm or Slurm.from_config(cfg)
    local = node_name(local_node)
    slurm_error = None
    try:
        nodes = slurm.nodes()
    except SlurmError as exc:  # still worth showing: the journal backlog is what piles up then
        nodes, slurm_error = [], str(exc)
    now = clock()
    fraction = float(cfg.repair.max_drained_fraction)
    b = breaker_policy.breaker(nodes, fraction, now, float(cfg.repair.suppressed_ttl_s))
    rows = []
    drained_at = load_drained_at(cfg.state_path(local))
    for n in nodes:
        suppressed = n.name in b.suppressed
        if not n.ours and not suppressed:
            continue
        if n.ours:
            repair = "repairing" if n.repairing else ("waiting for jobs to end" if n.busy else "drained")
            if not reasons.repairable(n.reason):
                repair = "drained (not repaired)"
            rule, drain = reasons.rule_of(n.reason), "planned" if n.planned_drain else "fault"
            since = drained_at.get(n.name) if n.repairing and drained_at.get(n.name) else n.reason_time
            detail = reasons.fault_text(n.reason)
        else:
            m = n.marks
            # Slurm's reason only while it holds the node: 24.11 keeps it after a resume.
            held = n.reason and (n.drained or n.down)
            repair = "suppressed by breaker" + (f" (Slurm: {n.reason})" if held else "")
            rule, drain = reasons.rule_of(m.suppressed_summary), "suppressed"
            since = m.suppressed_at
            detail = m.suppressed_summary
        rows.append({"node": n.name, "state": n.state, "drain": drain, "rule": rule, "detail": detail, "since": since,
                     "for_s": round(now - since) if since else None, "repair": repair,
                     "repair_requested_s_ago": round(now - n.reason_time) if n.repairing and n.reason_time else None,
                     "expiry": expiry_state.countdown(cfg, n.name, local, now)})
    journals, unreadable = [], {}
    names = sorted({n.name for n in nodes} | {local}) if "%n" in cfg.state_dir else [local]
    for name in names:
        j = Journal.for_config(cfg, name)
        why = j.unreadable()
        if why:
            unreadable[name] = why
            continue
        s = j.summary()
        if s["pending"] or name == local:
            journals.append({"node": name, **s})
    expiries = {}
    for name in names:
        e = expiry_state.countdown(cfg, name, local, now)
        if e:
            expiries[name] = e
    if slurm_error:  # nothing said about the nodes or the breaker: it was not read
        breaker = {"state": "unknown", "total": None, "allowed": None, "max_drained_fraction": fraction,
                   "drained": None, "suppressed": None, "summary": "unknown (Slurm unreachable)"}
    else:
        breaker = {**b.to_dict(), "summary": b.describe()}
    st = {"version": version(), "time": now, "slurm_error": slurm_error, "nodes": None if slurm_error else rows, "breaker": breaker,
          "journal": {"pending": None if unreadable else sum(j["pending"] for j in journals), "journals": journals,
                      "unreadable": unreadable},
          "expiry": expiries}
    from ..actions.channel_client import probe  # only here: start-up speed

    state, detail = probe(cfg, local)
    st["channel"] = {"state": state, "detail": detail}
    st["problems"] = status_problems(st)
    st["exit_code"] = status_exit_code(st)
    return st


def status_problems(st: dict[str, Any]) -> list[str]:
    """What needs a look, one line each: what `status` exits 1 for. Planned drains (expiry,
    maintenance) are not problems; with Slurm unreachable only the journal is known."""
    rows = st["nodes"] or []
    faults = [r["node"] for r in rows if r["drain"] == "fault"]
    held = [r["node"] for r in rows if r["drain"] == "suppressed"]
    out = []
    if faults:
        out.append(f"{len(faults)} node(s) drained by slurmagent for a fault: {hostlist.compress(faults)}")
    if held:
        out.append(f"{len(held)} unhealthy node(s) held back by the breaker: {hostlist.compress(held)}")
    if st["breaker"]["state"] == "open":
        out.append("the drain circuit breaker is OPEN")
    pending = sum(j["pending"] for j in st["journal"]["journals"])
    if pending:
        out.append(f"{pending} journal action(s) pending")
    out += [f"journal not read: {why}" for why in st["journal"]["unreadable"].values()]
    if (st.get("channel") or {}).get("state") == "silent":
        out.append(f"the job channel: {st['channel']['detail']}")
    return out


def status_exit_code(st: dict[str, Any]) -> int:
    """3 (Slurm not read) wins over 1 (problems): an outage hides what it could not read."""
    return EXIT_UNREACHABLE if st["slurm_error"] else (EXIT_PROBLEMS if st["problems"] else EXIT_OK)


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
            table.append((r["node"], r["state"], r["rule"], human(r["for_s"], column=True) + (" ago" if r["for_s"] is not None else ""),
                          r["repair"] + (f" ({human(r['repair_requested_s_ago'], column=True)} ago)" if r["repair_requested_s_ago"] is not None else ""),
                          ("in " + human(exp["in_s"], column=True) if exp and exp["in_s"] is not None and exp["in_s"] >= 0
                           else ("passed" if exp and exp["in_s"] is not None else "-")),
                          r["detail"]))
        widths = [max(len(str(row[i])) for row in table) for i in range(len(header) - 1)]
        for row in table:
            lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) + "  " + str(row[-1]))
    else:
        lines.append("no node is drained by slurmagent")  # (or held back by the breaker)
    lines.append(f"breaker: {st['breaker']['summary']}")
    j = st["journal"]
    busy = [x for x in j["journals"] if x["pending"]]
    if busy:
        per = ", ".join(f"{x['node']}: {x['pending']} ({', '.join(x['pending_kinds'])}, oldest "
                        f"{human(x['oldest_pending_age_s'], column=True)})" for x in busy)
        lines.append(f"journal: {sum(x['pending'] for x in busy)} pending action(s) not yet applied: {per}")
    elif not j["unreadable"]:
        lines.append("journal: no pending actions")
    lines += [f"journal: {why}" for why in j["unreadable"].values()]
    for node, e in sorted(st["expiry"].items()):
        when = e["in_s"]
        lines.append(f"expiry: {node} terminates {e['termination_time']}"
                     + (f" (in {human(when, column=True)})" if when is not None and when >= 0 else " (passed)" if when is not None else ""))
    if st.get("channel"):
        lines.append(f"channel: {st['channel']['detail']}")
    lines.append(f"version: slurmagent {st['version']} (this node)")
    if st.get("problems"):  # last: what to act on
        lines.append("problems: " + "; ".join(st["problems"]))
    return "\n".join(lines)



UID_RE = re.compile(r"\((\d+)\)$")  # scontrol's UserId=alice(1000)


def job_owner_uid(raw: Mapping[str, str] | None) -> int | None:
    m = UID_RE.search((raw or {}).get("UserId", ""))
    return int(m.group(1)) if m else None


def collect_job_status(cfg: Config, job_id: str, *, remote: str | None = None, slurm: Slurm | None = None,
                       env: Mapping[str, str] | None = None, store_factory: Callable[[str], Any] | None = None,
                       clock: Callable[[], float] = time.time) -> dict[str, Any]:
    env = os.environ if env is None else env
    slurm = slurm or Slurm.from_config(cfg)
    st: dict[str, Any] = {"version": version(), "job": job_id, "time": clock(), "slurm": None, "slurm_error": None, "record": None,
                          "remote": remote, "commit": None, "remote_error": None}
    uid, unreadable = os.geteuid(), False  # Slurm not read ("no job" is an answer)
    try:
        job = slurm.job(job_id)
        if job is None:
            st["slurm_error"] = f"no job {job_id} (finished long ago, or never existed)"
        else:
            st["slurm"] = {"state": job.state, "restarts": job.restarts, "nodes": job.node_list,
                           "user": (job.raw or {}).get("UserId", "")}
            uid = job_owner_uid(job.raw) if job_owner_uid(job.raw) is not None else uid
    except SlurmagentError as exc:
        st["slurm_error"], unreadable = str(exc), True
    record = read_record(record_path(env, uid, job_id))
    if record is not None and str(record.get("job")) == job_id:
        st["record"] = record
    if not st["remote"]:
        if st["record"] and isinstance(st["record"].get("remote"), str) and st["record"]["remote"].startswith("gs://"):
            st["remote"] = st["record"]["remote"]
        elif cfg.checkpoint.remote:
            st["remote"] = cfg.checkpoint.remote.rstrip("/") + "/" + job_id  # the wrapper's default prefix
    if st["remote"]:
        try:
            if store_factory is None:
                from ..checkpoint.gcs.store import GcsCheckpointStore  # google only here: start-up speed

                store_factory = GcsCheckpointStore
            manifest = store_factory(st["remote"]).latest_manifest(deadline_s=30.0)
            if manifest is not None:
                st["commit"] = {**manifest_summary(manifest), "age_s": age_s(manifest.created, clock())}
        except Exception as exc:  # noqa: BLE001 - one line, the rest is still worth showing
            st["remote_error"] = (str(exc).splitlines() or [type(exc).__name__])[0]
    st["exit_code"] = EXIT_UNREACHABLE if unreadable or st["remote_error"] else EXIT_OK
    return st


def format_job_status(st: dict[str, Any]) -> str:
    lines = []
    s = st["slurm"]
    if s:
        lines.append(f"job {st['job']}: {s['state']}, restarts {s['restarts']}, nodes {s['nodes'] or '-'}"
                     + (f", user {s['user']}" if s["user"] else ""))
    else:
        lines.append(f"job {st['job']}: slurm: {st['slurm_error']}")
    c = st["commit"]
    if st["remote_error"]:
        lines.append(f"checkpoint: cannot read {st['remote']}: {st['remote_error']}")
    elif not st["remote"]:
        lines.append("checkpoint: no [checkpoint] remote configured (pass --remote gs://BUCKET/PREFIX)")
    elif c is None:
        lines.append(f"checkpoint: nothing committed yet at {st['remote']}")
    else:
        age = f", {human(c['age_s'], column=True)} ago" if c.get("age_s") is not None else ""
        streak = f", {c['no_progress']} attempt(s) in a row without progress" if c.get("no_progress") else ""
        lines.append(f"checkpoint: {st['remote']}: last commit by attempt {c['attempt']} at {c['created']}{age}, "
                     f"{c['files']} file(s), {human_bytes(c['bytes'])}"
                     + (f" from {c['nodes']} nodes" if c.get("nodes", 1) > 1 else "") + streak)
    r = st["record"]
    if r:
        lines.append(_record_line(r, st["time"]))
    return "\n".join(lines)


def _record_line(r: dict[str, Any], now: float) -> str:
    """The running attempt's view, from its status record (the user's file: shown as text)."""
    def num(v: Any) -> float | None:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    parts = [f"attempt {r.get('attempt')} on {r.get('node') or 'this node'}, {r.get('state')}"]
    updated = num(r.get("updated"))
    if updated is not None:
        parts[0] += f" (updated {human(max(0.0, now - updated), column=True)} ago)"
    restored = r.get("restored")
    if isinstance(restored, dict):
        parts.append(f"restored the commit of attempt {restored.get('attempt')}")
    sync = r.get("last_sync")
    if isinstance(sync, dict) and num(sync.get("seconds")) is not None:
        parts.append(f"last sync took {num(sync['seconds']):.1f} s")
    if num(r.get("lag_s")) is not None:
        parts.append(f"lag {num(r['lag_s']):.0f} s")
    held = r.get("held_back")
    if isinstance(held, list) and held:
        parts.append("held back: " + ", ".join(str(u) or "(top-level files)" for u in held[:10]))
    if r.get("error"):
        parts.append(f"last sync failed: {str(r['error'])[:200]}")
    return "this node: " + "; ".join(parts)

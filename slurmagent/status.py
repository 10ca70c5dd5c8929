"""`slurmagent status`: nodes drained by slurmagent (or held back by the breaker), repair
state, the breaker, journal backlog and expiry countdowns, as a table or JSON.

Reads only: one `scontrol -o show node`, the journals and the expiry state files.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from . import expiry_state, policy, reasons
from .config import Config
from .errors import SlurmError
from .host import node_name
from .journal import Journal
from .repair_state import drained_at as load_drained_at
from .slurm import Slurm
from .timefmt import human_short


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
    b = policy.breaker(nodes, fraction, now, float(cfg.repair.suppressed_ttl_s))
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
            rule = reasons.rule_of(n.reason)
            since = drained_at.get(n.name) if n.repairing and drained_at.get(n.name) else n.reason_time
            detail = reasons.fault_text(n.reason)
        else:
            m = n.marks
            # Slurm's reason only while it holds the node: 24.11 keeps it after a resume.
            held = n.reason and (n.drained or n.down)
            repair = "suppressed by breaker" + (f" (Slurm: {n.reason})" if held else "")
            rule = reasons.rule_of(m.suppressed_summary)
            since = m.suppressed_at
            detail = m.suppressed_summary
        rows.append({"node": n.name, "state": n.state, "rule": rule, "detail": detail, "since": since,
                     "for_s": round(now - since) if since else None, "repair": repair,
                     "repair_requested_s_ago": round(now - n.reason_time) if n.repairing and n.reason_time else None,
                     "expiry": expiry_state.countdown(cfg, n.name, local, now)})
    journals = []
    names = sorted({n.name for n in nodes} | {local}) if "%n" in cfg.state_dir else [local]
    for name in names:
        s = Journal.for_config(cfg, name).summary()
        if s["pending"] or name == local:
            journals.append({"node": name, **s})
    expiries = {}
    for name in names:
        e = expiry_state.countdown(cfg, name, local, now)
        if e:
            expiries[name] = e
    return {"time": now, "slurm_error": slurm_error, "nodes": rows,
            "breaker": {**b.to_dict(), "summary": b.describe() if not slurm_error else "unknown (Slurm unreachable)"},
            "journal": {"pending": sum(j["pending"] for j in journals), "journals": journals},
            "expiry": expiries}


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
            table.append((r["node"], r["state"], r["rule"], human_short(r["for_s"]) + (" ago" if r["for_s"] is not None else ""),
                          r["repair"] + (f" ({human_short(r['repair_requested_s_ago'])} ago)" if r["repair_requested_s_ago"] is not None else ""),
                          ("in " + human_short(exp["in_s"]) if exp and exp["in_s"] is not None and exp["in_s"] >= 0
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
                        f"{human_short(x['oldest_pending_age_s'])})" for x in j["journals"] if x["pending"])
        lines.append(f"journal: {j['pending']} pending action(s) not yet applied: {per}")
    else:
        lines.append("journal: no pending actions")
    for node, e in sorted(st["expiry"].items()):
        when = e["in_s"]
        lines.append(f"expiry: {node} terminates {e['termination_time']}"
                     + (f" (in {human_short(when)})" if when is not None and when >= 0 else " (passed)" if when is not None else ""))
    return "\n".join(lines)

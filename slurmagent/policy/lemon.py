"""Lemon nodes: a node whose repairs keep coming back (`[repair] lemon_faults` within
`lemon_window_s`). The repair loop records every repair it asks for per node
(state/repair_state.record_history); a hung job whose evidence named a node that its root
would not drain is counted against that node (`hangs`, state/repair_state.record_hangs, through
the job's root channel; once per user and node a day): a node that keeps turning up under hangs
becomes a lemon too.
This reads both. Pure: no clock, no files.

A recreate puts the same VM name on whatever host the MIG picks, possibly the same bad one;
`reportHostAsFaulty` makes Google take the host out, so with `lemon_action = "report-faulty"` a
lemon whose VM supports it gets that instead (policy/repair.choose_repair).
"""

from __future__ import annotations

from typing import Any


def recent(times: Any, now: float, window_s: float) -> list[float]:
    """The repair times within the window (anything not a number is ignored)."""
    if not isinstance(times, list):
        return []
    return sorted(float(t) for t in times
                  if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= now - float(t) < window_s)


def merged(history: Any, hangs: Any = None) -> dict[str, list]:
    """node -> the times of its repairs and of the hangs counted against it."""
    out: dict[str, list] = {}
    for source in (history, hangs):
        if isinstance(source, dict):
            for node, times in source.items():
                if isinstance(times, list):
                    out.setdefault(str(node), []).extend(times)
    return out


def node_faults(history: Any, now: float, *, faults: int, window_s: float, hangs: Any = None,
                whys: Any = None) -> list[dict[str, Any]]:
    """Per node with a repair or a counted hang in the window: faults seen (both), the hangs among
    them and the evidence of the last one counted (`whys`: node -> [[time, words]]), the last
    fault, lemon or not (most faults first)."""
    rows = []
    for node, times in merged(history, hangs).items():
        seen = recent(times, now, window_s)
        if seen:
            hung = len(recent(hangs.get(node) if isinstance(hangs, dict) else None, now, window_s))
            said = whys.get(node) if isinstance(whys, dict) and isinstance(whys.get(node), list) else []
            last = [w for w in said if isinstance(w, list) and len(w) == 2 and isinstance(w[1], str)
                    and isinstance(w[0], (int, float)) and now - w[0] <= window_s]
            rows.append({"node": node, "faults": len(seen), "hangs": hung, "last_fault": seen[-1],
                         "lemon": faults > 0 and len(seen) >= faults, "hang_evidence": last[-1][1] if last else ""})
    return sorted(rows, key=lambda r: (-r["faults"], r["node"]))


def escalation(node: str, history: Any, now: float, *, faults: int, window_s: float, hangs: Any = None,
               whys: Any = None) -> str:
    """Why this repair of `node` (the fault being repaired now counts too) is a lemon's, with the
    hangs among its faults and the evidence of the last one counted; "" if not one."""
    seen = recent(merged(history, hangs).get(node), now, window_s)
    if faults <= 0 or len(seen) + 1 < faults:
        return ""
    why = f"lemon: {len(seen) + 1} faults within {window_s / 86400:g} days ([repair] lemon_faults = {faults})"
    row = next((r for r in node_faults(history, now, faults=faults, window_s=window_s, hangs=hangs, whys=whys)
                if r["node"] == node), None)
    if row is not None and row["hangs"]:
        why += f", {row['hangs']} of them hang(s)" + (f", the last: {row['hang_evidence']}" if row["hang_evidence"] else "")
    return why


def gauges(rows: list[dict[str, Any]]) -> dict[tuple, float]:
    """`slurmagent_lemon_nodes` and `slurmagent_node_faults{node}` for Metrics.update (the
    caller replaces the old per-node series: a node whose faults left the window disappears)."""
    out: dict[tuple, float] = {("slurmagent_lemon_nodes", ()): float(sum(r["lemon"] for r in rows))}
    for r in rows:
        out[("slurmagent_node_faults", (("node", r["node"]),))] = float(r["faults"])
    return out


def judge(history: Any, now: float, todo: list[str], repair_cfg: Any,
          hangs: Any = None, whys: Any = None) -> tuple[dict[tuple, float], dict[str, str]]:
    """For one `repair` run: the metrics' gauges, and the nodes to repair now that are lemons to
    escalate (node -> why, with the counted hangs' evidence; none unless `[repair] lemon_action
    = "report-faulty"`)."""
    keys = dict(faults=int(repair_cfg.lemon_faults), window_s=float(repair_cfg.lemon_window_s), hangs=hangs)
    lemons = {n: why for n in todo if (why := escalation(n, history, now, whys=whys, **keys))}
    return gauges(node_faults(history, now, **keys)), lemons if repair_cfg.lemon_action == "report-faulty" else {}


def state_gauges(state: Any, now: float, repair_cfg: Any) -> dict[tuple, float]:
    """The gauges of a repair state (its `history` and `hangs`), as they stand after a repair is
    recorded: the repair just asked counts at once, not at the next `repair` run."""
    state = state if isinstance(state, dict) else {}
    return gauges(node_faults(state.get("history"), now, faults=int(repair_cfg.lemon_faults),
                              window_s=float(repair_cfg.lemon_window_s), hangs=state.get("hangs")))

"""Repair state on this node: the MIG cache, the repair history, when each node was drained
(`<state_dir>/repair-state.json`), and the breaker's local mark (`<state_dir>/breaker-suppressed`).

The ONE reader and writer of both files. The MIG cache decides which VMs get recreated, so a
file a non-root user could have written is never trusted by root.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .decisionlog import warn
from .fsutil import UntrustedFile, atomic_write_text, read_state_file, unsafe_for_root

STATE_NAME = "repair-state.json"
SUPPRESSED_MARKER = "breaker-suppressed"  # in the state dir: the breaker kept this node from draining
HISTORY_KEEP_S = 7 * 86400
HISTORY_KEEP_N = 20


def state_file(state_dir: Path) -> Path:
    return state_dir / STATE_NAME


def load_state(state_dir: Path) -> dict[str, Any]:
    path = state_file(state_dir)
    try:
        data = json.loads(read_state_file(path))
        return data if isinstance(data, dict) else {}
    except UntrustedFile as exc:
        warn(f"ignoring {path}: {exc.why()}")
        return {}
    except (OSError, ValueError):
        return {}


def save_state(state_dir: Path, data: dict[str, Any]) -> None:
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(state_file(state_dir), json.dumps(data, sort_keys=True), 0o600)
    except OSError as exc:
        warn(f"cannot save {state_file(state_dir)}: {exc.strerror}")


def record_history(state_dir: Path, nodes: list[str], now: float, keep_s: float = HISTORY_KEEP_S,
                   keep_n: int = HISTORY_KEEP_N) -> None:
    """One repair of each node, now: what `max_repairs_per_day` and the lemon count read."""
    data = load_state(state_dir)
    hist = data.setdefault("history", {})
    keep_s, keep_n = max(keep_s, HISTORY_KEEP_S), max(keep_n, HISTORY_KEEP_N)
    for n in nodes:
        hist[n] = [t for t in hist.get(n, []) if now - t < keep_s][-keep_n:] + [now]
    save_state(state_dir, data)


HANG_PER_USER_S = 86400.0  # one user's hangs count against one node at most once a day
HANG_WHY_KEPT = 5  # the evidence of a node's last counted hangs


def record_hangs(state_dir: Path, nodes: list[str], now: float, keep_s: float = HISTORY_KEEP_S,
                 keep_n: int = HISTORY_KEEP_N, uid: int | None = None, why: str = "") -> None:
    """A hung job whose evidence named a node root could not drain, counted against that node:
    the lemon count reads it beside the repairs (policy/lemon.py); `max_repairs_per_day` does
    not. `uid`: whose job it was (`hang_counted_today` reads it back, across restarts); `why`:
    the evidence that named the node (`report --state-dir` shows the last ones)."""
    data = load_state(state_dir)
    hangs = data.setdefault("hangs", {})
    for n in nodes:
        hangs[n] = [t for t in hangs.get(n, []) if isinstance(t, (int, float)) and now - t < keep_s][-keep_n:] + [now]
    if why:
        whys = data.setdefault("hang_why", {})
        for n in nodes:
            old = [w for w in whys.get(n, []) if isinstance(w, list) and len(w) == 2][-(HANG_WHY_KEPT - 1):]
            whys[n] = old + [[now, why[:200]]]
    if uid is not None:
        by_uid = data.setdefault("hang_uids", {})
        for n in nodes:
            seen = by_uid.get(n) if isinstance(by_uid.get(n), dict) else {}
            seen = {u: t for u, t in seen.items() if isinstance(t, (int, float)) and now - t < HANG_PER_USER_S}
            by_uid[n] = {**seen, str(uid): now}
    save_state(state_dir, data)


def hang_counted_today(state_dir: Path, node: str, uid: int, now: float) -> bool:
    """Did a job of `uid` count a hang against `node` in the last day (`HANG_PER_USER_S`)?"""
    seen = load_state(state_dir).get("hang_uids", {})
    seen = seen.get(node) if isinstance(seen, dict) else None
    t = seen.get(str(uid)) if isinstance(seen, dict) else None
    return isinstance(t, (int, float)) and 0 <= now - t < HANG_PER_USER_S


def remember_drained_at(state_dir: Path, drained_at: dict[str, float]) -> None:
    """When each node was drained, kept before its reason (and the reason's time) turns `repairing`."""
    data = load_state(state_dir)
    data["drained_at"] = drained_at
    save_state(state_dir, data)


def drained_at(state_dir: Path) -> dict[str, float]:
    return load_state(state_dir).get("drained_at", {})


# --- the breaker's local mark ------------------------------------------------------------


def marker_path(state_dir: Path) -> Path:
    return state_dir / SUPPRESSED_MARKER


def has_marker(state_dir: Path) -> bool:
    """Root believes only its own mark (a user's would make a healthy hook clear a breaker mark)."""
    path = marker_path(state_dir)
    return path.exists() and unsafe_for_root(path) is None


def write_marker(state_dir: Path, now: float) -> None:
    try:
        path = marker_path(state_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{now:.3f}\n")
    except OSError:
        pass


def drop_marker(state_dir: Path) -> None:
    try:
        marker_path(state_dir).unlink()
    except OSError:
        pass


# --- repairs we asked for, until the node is back or an admin took it over -----------------


def requested(state_dir: Path) -> dict[str, float]:
    """Node -> when we last asked for its repair (recreate, report, power-down)."""
    return {n: float(t) for n, t in load_state(state_dir).get("requested", {}).items()}


def remember_requested(state_dir: Path, nodes: list[str], now: float) -> None:
    data = load_state(state_dir)
    data.setdefault("requested", {}).update({n: now for n in nodes})
    save_state(state_dir, data)


def forget_requested(state_dir: Path, nodes: list[str]) -> None:
    data = load_state(state_dir)
    for n in nodes:
        data.get("requested", {}).pop(n, None)
    save_state(state_dir, data)

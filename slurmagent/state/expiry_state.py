"""The expiry state file: the ONE reader and writer of `<state_dir>/expiry.json`.

The expiry watch writes it (and, with `[expiry] publish_run_file`, a world-readable copy at
`[expiry] run_file` for wrappers that run as the job's user); the prolog guard, the wrapper
and `status` read it. It holds `termination_time` (absent when unknown), `source`,
`boot_id` and the watch's drain and flush flags, and (`--once` mode) `said_errors`: the errors the
last run said, so a lasting error is said once per change or per `REPEAT_SAID_S`, and its end
in one line. A file written during an earlier boot of the VM (stopped and started on the same
disk) is ignored by every reader.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from . import host
from .config import Config
from ..errors import ExpiryError
from .decisionlog import warn
from .fsutil import UntrustedFile, atomic_write_text, read_state_file
from ..core.timefmt import fmt_time, from_epoch, human, parse_time

STATE_NAME = "expiry.json"
SCHEMA = 1
# A T this far in the past with the VM alive is stale: the watch's own grace for a stop that
# did not come (policy.NOTICE_GRACE_S, 300 s), so a VM a few minutes late still flushes.
STALE_AFTER_S = 300.0
_said_stale: set[datetime] = set()
SAID_KEY = "said_errors"
REPEAT_SAID_S = 3600.0  # a lasting error is said again once an hour (the timer runs every 30 s)


def state_file(cfg: Config, node: str) -> Path:
    return cfg.state_path(node) / STATE_NAME


def run_file(cfg: Config, node: str | None) -> Path | None:
    """The world-readable copy, when published."""
    if not cfg.expiry.publish_run_file or not cfg.expiry.run_file:
        return None
    return Path(cfg.node_path(cfg.expiry.run_file, node))


def files_for(cfg: Config, node: str | None) -> tuple[Path, ...]:
    """Where a reader finds the state, most trusted first (the wrapper may not read state_dir)."""
    copy = run_file(cfg, node)
    return (state_file(cfg, node or ""), *((copy,) if copy else ()))


def read(path: Path) -> dict[str, Any] | None:
    """The state in one read; None when absent, unreadable or not a JSON object, and, read by
    root, when a user could have written it (a planted termination time would drain the node)."""
    try:
        data = json.loads(read_state_file(path))
    except UntrustedFile as exc:
        warn(f"ignoring {path}: {exc.why()}")
        return None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load(cfg: Config, node: str) -> dict[str, Any] | None:
    return read(state_file(cfg, node))


def write(cfg: Config, node: str, state: dict[str, Any]) -> None:
    """Write the state file, then its published copy. Raises OSError / ExpiryError."""
    text = json.dumps(state, indent=1, sort_keys=True) + "\n"
    atomic_write_text(state_file(cfg, node), text, 0o644)
    copy = run_file(cfg, node)
    if copy is not None:
        try:
            copy.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            atomic_write_text(copy, text, 0o644)
        except OSError as exc:
            raise ExpiryError(f"cannot write {copy}: {exc.strerror or exc}") from None


def of_this_boot(data: dict[str, Any] | None, boot_id: str | None = None) -> bool:
    """The state belongs to this boot (or says nothing about its boot)."""
    if not data:
        return False
    boot_id = host.boot_id() if boot_id is None else boot_id
    return not (data.get("boot_id") and boot_id and data["boot_id"] != boot_id)


def termination(data: dict[str, Any] | None, boot_id: str | None = None) -> datetime | None:
    """The termination time a state of this boot holds, if any."""
    if not of_this_boot(data, boot_id):
        return None
    text = data.get("termination_time") if data else None
    if not text:
        return None
    try:
        return parse_time(str(text))
    except ValueError:
        return None


def termination_time(files: tuple[Path, ...], boot_id: str | None = None, *, now: float | None = None,
                     stale_after_s: float = STALE_AFTER_S) -> datetime | None:
    """The VM's termination time from the first of `files` that is of this boot and holds one,
    unless it passed more than `stale_after_s` ago: the VM outlived it, so no watch keeps the
    file (a live one asks again, or drops the notice, within NOTICE_GRACE_S of T), and acting
    on it would flush every job that starts here at once, a requeue loop. Said once per time."""
    boot_id = host.boot_id() if boot_id is None else boot_id
    now = time.time() if now is None else now
    for path in files:
        when = termination(read(path), boot_id)
        if when is None:
            continue
        late = now - when.timestamp()
        if late <= stale_after_s:
            return when
        if when not in _said_stale:  # the published copy holds the same time: one line for both
            _said_stale.add(when)
            print(f"slurmagent: ignoring the termination time {fmt_time(when)} in {path}: it passed {human(late)} "
                  "ago and this VM still runs (stale: is the expiry watch running?)", file=sys.stderr, flush=True)
    return None


def countdown(cfg: Config, node: str, local: str, now: float) -> dict[str, Any] | None:
    """For `status`: the node's termination time and seconds left, when its state is reachable
    from here (this node's, or every node's with a `%n` state_dir)."""
    if "%n" not in cfg.state_dir and node != local:
        return None
    data = load(cfg, node)
    if not data or "termination_time" not in data:
        return None
    text = str(data["termination_time"])
    try:
        when = parse_time(text).timestamp()
    except ValueError:
        return {"termination_time": text, "in_s": None}
    return {"termination_time": text, "in_s": round(when - now)}


def errors_to_say(old: dict[str, Any] | None, errors: list[str], now: float,
                  repeat_s: float = REPEAT_SAID_S) -> tuple[list[str], dict[str, Any] | None]:
    """What a `--once` run says of its errors, and the `said_errors` record it keeps: errors
    that differ from the last ones said are said; the same ones again only `repeat_s` after
    they were last said; when none is left, one line says they cleared (record dropped)."""
    prev = (old or {}).get(SAID_KEY)
    prev = prev if isinstance(prev, dict) else {}
    before = [str(e) for e in prev.get("errors") or []] if isinstance(prev.get("errors"), list) else []
    said_at = prev.get("said_at") if isinstance(prev.get("said_at"), (int, float)) else 0.0
    since = str(prev.get("since") or "?")
    if not errors:
        if not before:
            return [], None
        return [f"cleared: no error now (since {since}: {'; '.join(before)})"], None
    if errors != before:
        return list(errors), {"errors": list(errors), "since": fmt_time(from_epoch(now)), "said_at": now}
    if now - said_at >= repeat_s:
        return [f"{e} (still, since {since})" for e in errors], {**prev, "said_at": now}
    return [], prev

"""What the job's owner sees of their checkpoint while the job runs.

The metrics (lag gauge, sync durations) are written where root's state lives, which an
ordinary user's job cannot write, so the wrapper also:

* says on the job's stderr how the checkpoint stands (last commit, its age and size, the last
  sync's duration, the lag), at a low rate: on this attempt's first commit, when the bucket
  falls behind or catches up, and otherwise at most every `interval_s` (10 minutes);
* keeps a small JSON record in the user's private directory
  (`${TMPDIR:-/tmp}/slurmagent-<uid>/jobs/<job>.json`, 0600) that `slurmagent status --job ID`
  shows beside the bucket's manifest. It is the user's file: a reader (root included) only
  displays it, never acts on it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from ..state.fsutil import atomic_write_text

RECORD_MAX_BYTES = 64 * 1024  # a record is a few hundred bytes; anything larger is not ours


def record_path(env: Mapping[str, str], uid: int, job_name: str) -> Path:
    """Where a job's status record lives: in the user's private per-user directory."""
    return Path(env.get("TMPDIR") or "/tmp") / f"slurmagent-{uid}" / "jobs" / f"{job_name}.json"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def manifest_summary(manifest: Any) -> dict[str, Any]:
    """The few facts of a committed manifest a person wants: attempt, time, files, bytes."""
    files = getattr(manifest, "files", {}) or {}
    return {"attempt": getattr(manifest, "attempt", None), "created": getattr(manifest, "created", None),
            "files": len(files), "bytes": sum(int(e.get("size", 0) or 0) for e in files.values()),
            "no_progress": getattr(manifest, "no_progress", None), "nodes": getattr(manifest, "node_count", 0) or 1}


class CheckpointReport:
    """Collects sync outcomes; says them at a low rate and keeps the owner's record current."""

    def __init__(self, say: Callable[[str], None], *, job: str, attempt: int, remote: str, ckpt_dir: str,
                 node: str = "", record: Path | None = None, interval_s: float = 600.0, behind_s: float = 180.0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.say, self.record, self.interval_s, self.behind_s = say, record, interval_s, behind_s
        self.clock, self.wall = clock, wall
        self.state: dict[str, Any] = {"version": 1, "job": job, "attempt": attempt, "remote": remote,
                                      "ckpt_dir": ckpt_dir, "node": node, "pid": os.getpid(), "state": "running"}
        self.last_said = clock()  # the first line comes with the first commit, or after interval_s
        self.behind = False
        self.commits = 0

    def restored(self, manifest: Any | None) -> None:
        """The checkpoint this attempt started from (None: a fresh start)."""
        if manifest is not None:
            self.state["restored"] = manifest_summary(manifest)
            self.state["last_commit"] = manifest_summary(manifest)
        self._write()

    def synced(self, manifest: Any | None, duration_s: float, files_sent: int, bytes_sent: int,
               lag_s: float | None, held_back: list[str] | None = None, say: bool = True) -> None:
        now = self.clock()
        self.state.update(last_sync={"at": self.wall(), "seconds": round(duration_s, 2), "files_sent": files_sent,
                                     "bytes_sent": bytes_sent},
                          lag_s=None if lag_s is None else round(lag_s, 1), held_back=list(held_back or []),
                          error=None)
        first = False
        if manifest is not None:
            self.state["last_commit"] = manifest_summary(manifest)
            self.commits += 1
            first = self.commits == 1
        behind = lag_s is not None and lag_s > self.behind_s
        changed, self.behind = behind != self.behind, behind
        self._write()
        if say and (first or changed or now - self.last_said >= self.interval_s):
            self.last_said = now
            self.say(self.line())

    def failed(self, error: str) -> None:
        self.state["error"] = error
        self._write()

    def ended(self, how: str) -> None:
        self.state["state"] = how
        self._write()

    def line(self) -> str:
        c, s = self.state.get("last_commit"), self.state.get("last_sync") or {}
        parts = []
        if c:
            age = age_s(c.get("created"), self.wall())
            parts.append(f"last commit: attempt {c['attempt']}, {c['files']} file(s), {human_bytes(c['bytes'])}"
                         + (f", {age:.0f} s ago" if age is not None else ""))
        else:
            parts.append("nothing committed yet")
        if s:
            parts.append(f"last sync {s['seconds']:.1f} s ({s['files_sent']} file(s), "
                         f"{human_bytes(s['bytes_sent'])} sent)")
        lag = self.state.get("lag_s")
        if lag is not None:
            parts.append(f"lag {lag:.0f} s" + (" (behind: the bucket is not keeping up)" if self.behind else ""))
        if self.state.get("held_back"):
            parts.append("held back: " + ", ".join(u or "(top-level files)" for u in self.state["held_back"]))
        return "checkpoint: " + "; ".join(parts)

    def _write(self) -> None:
        if self.record is None:
            return
        try:
            self.state["updated"] = self.wall()
            atomic_write_text(self.record, json.dumps(self.state, sort_keys=True), 0o600, durable=False)
        except OSError:
            pass  # a status record never fails the job


def age_s(created: Any, now: float) -> float | None:
    from datetime import datetime

    if not isinstance(created, str):
        return None
    try:
        return max(0.0, now - datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return None


def read_record(path: Path) -> dict[str, Any] | None:
    """A job's status record, read as untrusted data: no symlink followed, size capped, a JSON
    object or nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(RECORD_MAX_BYTES + 1)
    except OSError:
        return None
    if len(data) > RECORD_MAX_BYTES:
        return None
    try:
        rec = json.loads(data)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None

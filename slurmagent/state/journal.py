"""A durable outbox of actions (drain, requeue, release, repair request, resume).

Every action is written to `<state_dir>/journal/pending/` before it is tried and moved to
`done/` after, so nothing is lost when slurmctld or an API is down or the process dies
half-way. Any hook, timer or command replays what is pending first (`replay`).

* Crash-safe: each entry is one small JSON file written to a temporary name, fsync'd,
  renamed into place, and the directory fsync'd. An entry found in both `pending/` and
  `done/` (a crash between the two steps) counts as done.
* Bounded: `done/` keeps the newest `max_done` entries; `pending/` holds at most
  `max_pending` (the oldest are dropped with a loud log line) and entries older than
  `max_age_s` are dropped as stale (the next hook judges the node afresh anyway).
* Idempotent: the handlers (in `actions/handlers.py`) look at the current state before acting, so a
  replayed drain on a node already drained with that reason is a no-op, and a replayed
  repair request reuses its Compute `requestId` so the API does not act twice.
* One replayer at a time per journal (`flock` on `journal/lock`); a second caller skips
  the replay instead of waiting.

The bounds' defaults are `[repair]`'s (config.py), written once. Light: stdlib and the
config, both already loaded on the prolog's path.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .config import RepairConfig
from .fsutil import atomic_write_text, unsafe_for_root
from .repair_state import SUPPRESSED_MARKER

PENDING = "pending"
DONE = "done"


def needs_attention(state_dir: Path) -> bool:
    """For the healthy prolog: anything to replay or clear? One listdir and one stat."""
    try:
        with os.scandir(state_dir / "journal" / PENDING) as it:
            if any(_is_entry(e.name) for e in it):
                return True
    except OSError:
        pass
    return os.path.exists(state_dir / SUPPRESSED_MARKER)

# What a handler returns: the outcome text, or raises one of these.


class Retry(Exception):
    """Leave the entry pending (the target is unreachable or not ready yet); try later."""


class StopReplay(Retry):
    """Leave the entry pending and stop replaying the rest (e.g. slurmctld unreachable)."""


class Entry:
    """One journaled action (a plain class: this module is on the prolog's import path)."""

    __slots__ = ("id", "kind", "created", "payload", "attempts", "last_error", "outcome", "finished", "file")

    def __init__(self, id: str, kind: str, created: float, payload: dict[str, Any], attempts: int = 0,
                 last_error: str = "", outcome: str = "", finished: float | None = None, file: str = ""):
        self.id, self.kind, self.created, self.payload = id, kind, created, payload
        self.attempts, self.last_error, self.outcome, self.finished, self.file = (
            attempts, last_error, outcome, finished, file)

    def __repr__(self) -> str:
        return f"Entry({self.kind} {self.id[:8]} {self.payload})"

    def to_dict(self) -> dict[str, Any]:
        d = {
            "id": self.id,
            "kind": self.kind,
            "created": self.created,
            "payload": self.payload,
            "attempts": self.attempts,
            "last_error": self.last_error,
        }
        if self.finished is not None:
            d["outcome"] = self.outcome
            d["finished"] = self.finished
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], file: str) -> Entry:
        return cls(
            id=str(d["id"]),
            kind=str(d["kind"]),
            created=float(d["created"]),
            payload=dict(d.get("payload") or {}),
            attempts=int(d.get("attempts", 0)),
            last_error=str(d.get("last_error", "")),
            outcome=str(d.get("outcome", "")),
            finished=d.get("finished"),
            file=file,
        )


def _warn(msg: str) -> None:
    """Loud: stderr and syslog (journald) at warning level."""
    print(f"slurmagent journal: {msg}", file=sys.stderr)
    try:
        import syslog

        syslog.openlog("slurmagent", 0, syslog.LOG_DAEMON)
        syslog.syslog(syslog.LOG_WARNING, f"journal: {msg}")
    except OSError:
        pass


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """Journal and repair-state files: root-only (0600), fsync'd, renamed into place."""
    atomic_write_text(path, data.decode("utf-8"), 0o600)


class Journal:
    def __init__(self, directory: Path | str, *, max_done: int = RepairConfig.journal_max_done,
                 max_pending: int = RepairConfig.journal_max_pending,
                 max_age_s: float = RepairConfig.journal_max_age_s, max_attempts: int = 20,
                 clock: Callable[[], float] = time.time):
        self.dir = Path(directory)
        self.max_done = max_done
        self.max_pending = max_pending
        self.max_age_s = max_age_s
        self.max_attempts = max_attempts
        self.clock = clock

    @classmethod
    def for_config(cls, cfg, node: str | None) -> Journal:
        r = cfg.repair
        return cls(
            cfg.state_path(node) / "journal",
            max_done=r.journal_max_done,
            max_pending=r.journal_max_pending,
            max_age_s=r.journal_max_age_s,
        )

    # --- paths ----------------------------------------------------------------------

    @property
    def pending_dir(self) -> Path:
        return self.dir / PENDING

    @property
    def done_dir(self) -> Path:
        return self.dir / DONE

    def _ensure(self) -> None:
        for d in (self.dir, self.pending_dir, self.done_dir):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)

    # --- writing --------------------------------------------------------------------

    def add(self, kind: str, **payload: Any) -> Entry:
        """Record an action before it is tried (durable when this returns)."""
        self._ensure()
        now = self.clock()
        # 128 random bits as 32 hex digits, as uuid4().hex, without uuid (it imports platform):
        # the failing prolog's drain is journaled here, start-up speed
        entry = Entry(id=os.urandom(16).hex(), kind=kind, created=now, payload=payload)
        # Names order the replay: never before an existing entry, even when the wall clock
        # stepped back since it was written (NTP, a VM resumed from suspension).
        seq = max(time.time_ns(), self._last_seq() + 1)
        entry.file = f"{seq:020d}-{kind}-{entry.id[:12]}.json"
        _write_atomic(self.pending_dir / entry.file, json.dumps(entry.to_dict()).encode())
        self._cap_pending()
        return entry

    def _last_seq(self) -> int:
        last = 0
        for d in (self.pending_dir, self.done_dir):
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for name in names:
                head = name.split("-", 1)[0]
                if head.isdigit() and not name.startswith("."):
                    last = max(last, int(head))
        return last

    def mark_done(self, entry: Entry, outcome: str) -> None:
        """The action happened (or is moot): move it to done/ with its outcome."""
        self._ensure()
        entry.outcome = outcome
        entry.finished = self.clock()
        _write_atomic(self.done_dir / entry.file, json.dumps(entry.to_dict()).encode())
        try:
            os.unlink(self.pending_dir / entry.file)
        except FileNotFoundError:
            pass
        _fsync_dir(self.pending_dir)
        self._trim_done()

    def mark_failed_attempt(self, entry: Entry, error: str) -> None:
        entry.attempts += 1
        entry.last_error = error[:500]
        path = self.pending_dir / entry.file
        if path.exists():
            _write_atomic(path, json.dumps(entry.to_dict()).encode())

    # --- reading --------------------------------------------------------------------

    def has_pending(self) -> bool:
        """Cheap (one directory listing, stopping at the first entry): the healthy prolog path calls this."""
        return self.pending_count(stop_at=1) > 0

    def pending_count(self, stop_at: int = 0) -> int:
        """One directory listing (0 when the directory cannot be read); `stop_at` > 0 stops counting there."""
        n = 0
        try:
            with os.scandir(self.pending_dir) as it:
                for e in it:
                    n += _is_entry(e.name)
                    if stop_at and n >= stop_at:
                        break
        except OSError:
            return 0
        return n

    def _load_dir(self, d: Path) -> list[Entry]:
        out = []
        try:
            names = sorted(n for n in os.listdir(d) if _is_entry(n))
        except OSError:
            return out
        for name in names:
            try:
                out.append(Entry.from_dict(json.loads((d / name).read_text()), name))
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as exc:
                _warn(f"dropping unreadable entry {d / name}: {exc}")
                self._quarantine(d / name)
        return out

    def untrusted(self) -> str | None:
        """Why a root process must not replay this journal: a non-root user could have put
        actions in it (drain any node, requeue any job, recreate VMs). None when it is safe."""
        for d in (self.dir, self.pending_dir):
            why = unsafe_for_root(d)  # names the file, link or directory at fault
            if why:
                return why
        return None

    def pending(self) -> list[Entry]:
        why = self.untrusted()
        if why:
            _warn(f"refusing to replay {self.pending_dir}: {why}; its entries are left alone "
                  f"(fix: chown -R root {self.dir}; chmod -R go-w {self.dir})")
            return []
        entries = self._load_dir(self.pending_dir)
        done = {e.file for e in self._load_dir(self.done_dir)} if entries else set()
        live = []
        for e in entries:
            if e.file in done:  # crashed between writing done/ and unlinking pending/
                try:
                    os.unlink(self.pending_dir / e.file)
                except OSError:
                    pass
                continue
            live.append(e)
        return live

    def done(self) -> list[Entry]:
        return self._load_dir(self.done_dir)

    def _quarantine(self, path: Path) -> None:
        try:
            os.replace(path, path.with_name(f".bad-{path.name}"))
        except OSError:
            pass

    # --- bounds ---------------------------------------------------------------------

    def _cap_pending(self) -> None:
        try:
            names = sorted(n for n in os.listdir(self.pending_dir) if _is_entry(n))
        except OSError:
            return
        excess = len(names) - self.max_pending
        if excess > 0:
            _warn(f"{len(names)} pending actions exceed the cap of {self.max_pending}: "
                  f"dropping the {excess} oldest ({', '.join(names[:excess][:5])}{', ...' if excess > 5 else ''})")
            for name in names[:excess]:
                try:
                    os.unlink(self.pending_dir / name)
                except OSError:
                    pass

    def _trim_done(self) -> None:
        try:
            names = sorted(n for n in os.listdir(self.done_dir) if _is_entry(n))
        except OSError:
            return
        for name in names[: max(0, len(names) - self.max_done)]:
            try:
                os.unlink(self.done_dir / name)
            except OSError:
                pass

    # --- replay ---------------------------------------------------------------------

    def replay(self, handlers: dict[str, Callable[[Entry], str]], deadline_s: float = 30.0,
               lock_wait_s: float = 0.0) -> list[tuple[Entry, str]]:
        """Run pending entries oldest first. A handler returns the outcome (entry done),
        raises Retry (entry stays pending) or StopReplay (stays, and the rest wait too).
        Returns (entry, outcome-or-'pending: why') for each entry looked at."""
        if not self.has_pending():
            return []
        results: list[tuple[Entry, str]] = []
        lock = self._try_lock(lock_wait_s)
        if lock is None:
            return results  # someone else is replaying this journal right now
        try:
            end = time.monotonic() + deadline_s
            for entry in self.pending():
                if time.monotonic() > end:
                    break
                age = self.clock() - entry.created
                if age > self.max_age_s:
                    _warn(f"dropping stale {entry.kind} {entry.payload} ({age / 3600:.1f} h old, {entry.attempts} attempts)")
                    self.mark_done(entry, f"dropped: stale after {age:.0f} s")
                    results.append((entry, "dropped: stale"))
                    continue
                handler = handlers.get(entry.kind)
                if handler is None:
                    continue  # a kind this process does not handle (e.g. a newer version's)
                try:
                    outcome = handler(entry)
                except StopReplay as exc:
                    self.mark_failed_attempt(entry, str(exc))
                    results.append((entry, f"pending: {exc}"))
                    break
                except Retry as exc:
                    self.mark_failed_attempt(entry, str(exc))
                    if entry.attempts >= self.max_attempts:
                        _warn(f"giving up on {entry.kind} {entry.payload} after {entry.attempts} attempts: {exc}")
                        self.mark_done(entry, f"failed: {exc}")
                        results.append((entry, f"failed: {exc}"))
                    else:
                        results.append((entry, f"pending: {exc}"))
                    continue
                self.mark_done(entry, outcome)
                results.append((entry, outcome))
        finally:
            os.close(lock)
        return results

    def _try_lock(self, wait_s: float = 0.0) -> int | None:
        self._ensure()
        fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        end = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
            if time.monotonic() >= end:
                os.close(fd)
                return None
            time.sleep(0.05)

    def unreadable(self) -> str:
        """Why this process cannot list the pending entries ("" when it can, or none exist yet):
        a user reading root's 0700 journal must never be told "no pending actions"."""
        try:
            os.listdir(self.pending_dir)
        except FileNotFoundError:
            return ""
        except OSError as exc:
            return f"cannot read {self.pending_dir}: {exc.strerror or exc}"
        return ""

    def summary(self) -> dict[str, Any]:
        pend = self.pending() if self.pending_dir.exists() else []
        return {
            "dir": str(self.dir),
            "pending": len(pend),
            "oldest_pending_age_s": round(self.clock() - pend[0].created, 1) if pend else None,
            "pending_kinds": sorted({e.kind for e in pend}),
            "last_error": next((e.last_error for e in reversed(pend) if e.last_error), ""),
        }


def _is_entry(name: str) -> bool:
    """A journal entry's file name (hidden files are ones being written)."""
    return name.endswith(".json") and not name.startswith(".")

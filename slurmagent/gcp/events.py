"""Short-notice terminations from the metadata server: host maintenance and preemption.

`instance/maintenance-event` turns `TERMINATE_ON_HOST_MAINTENANCE` ahead of a host maintenance
that stops the VM (about an hour ahead on a GPU VM, 60 s otherwise; the window itself is in the
Compute API's `resourceStatus.upcomingMaintenance`, which `policy.decide_expiry` prefers) and
`instance/preempted` turns `TRUE` (30 s before a Spot VM stops). `probe_events` reads both
once (the timer's `--once`); `EventWatcher` long-polls each key in a thread
(`?wait_for_change=true&last_etag=...`) so the expiry loop reacts within a second.
`MIGRATE_ON_HOST_MAINTENANCE` is only reported (the VM survives).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from ..core.reasons import TERMINATE_ON_HOST_MAINTENANCE as TERMINATE
from . import metadata
from .metadata import MetadataError

MAINTENANCE_KEY = "instance/maintenance-event"
PREEMPTED_KEY = "instance/preempted"
EVENT_KEYS = (MAINTENANCE_KEY, PREEMPTED_KEY)
MAINTENANCE_NOTICE_S = 60.0  # without a known window or GPUs: the maintenance is taken as 60 s away
PREEMPT_NOTICE_S = 30.0  # Spot/preemptible VMs get 30 s
RETRY_MAX_S = 30.0  # an unreachable server is asked again with backoff up to this
PLAIN_POLL_MAX_S = 5.0  # a server without ETags is polled this often at most


@dataclass
class Events:
    """What the metadata server says about short-notice terminations."""

    maintenance: str = "NONE"
    preempted: str = "FALSE"
    error: str = ""  # the metadata server could not be read

    @property
    def notice(self) -> tuple[str, float] | None:
        """(kind, seconds of notice) of a termination notice now in force, if any."""
        if self.preempted.upper() == "TRUE":
            return "preempt", PREEMPT_NOTICE_S
        if self.maintenance.upper().startswith(TERMINATE):
            return "maintenance", MAINTENANCE_NOTICE_S
        return None

    @property
    def migrating(self) -> bool:
        return self.maintenance.upper().startswith("MIGRATE")


def probe_events(timeout_s: float) -> Events:
    """One plain read of both keys (for --once); a dead server costs one deadline, not two."""
    ev = Events()
    try:
        ev.maintenance = metadata.read(MAINTENANCE_KEY, timeout_s)[0] or "NONE"
        ev.preempted = metadata.read(PREEMPTED_KEY, timeout_s)[0] or "FALSE"
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
        etag, backoff = "", 1.0
        while not self.stop.is_set():
            try:
                value, new_etag = metadata.read(key, self.timeout_s, wait_s=self.wait_s if etag else 0.0,
                                                last_etag=etag)
            except MetadataError as exc:
                self._set_error(key, str(exc))
                self.stop.wait(backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)
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
                self.stop.wait(min(self.wait_s, PLAIN_POLL_MAX_S))

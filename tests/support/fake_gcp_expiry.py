"""FakeGcp plus what the expiry watch reads: instance scheduling and metadata notices.

* `instances.get` also answers `scheduling` (provisioningModel, maxRunDuration,
  instanceTerminationAction, terminationTime) and `resourceStatus.scheduling.terminationTimestamp`
  for instances given them with `set_scheduling`.
* `set_maintenance` gives an instance `resourceStatus.upcomingMaintenance` (a scheduled window).
* `instance/maintenance-event` (default `NONE`) and `instance/preempted` (default `FALSE`)
  speak the metadata server's long poll: an `ETag` header on every answer, and with
  `?wait_for_change=true` the answer waits until the value's ETag differs from `last_etag`
  (or, without one, until the next change) or `timeout_sec` passes. `set_event` changes a
  value and wakes the waiting requests.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlparse

from .fake_gcp import FakeGcp

EVENT_KEYS = ("instance/maintenance-event", "instance/preempted")


@dataclass
class FakeGcpExpiry(FakeGcp):
    scheduling: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: dict[str, str] = field(default_factory=lambda: {"instance/maintenance-event": "NONE",
                                                            "instance/preempted": "FALSE"})
    event_versions: dict[str, int] = field(default_factory=dict)
    waits: list[str] = field(default_factory=list)  # paths of long polls received
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def set_scheduling(self, instance: str, *, termination: str | None = None, field_name: str = "resourceStatus",
                       model: str = "FLEX_START", max_run_duration_s: int | None = None, action: str = "DELETE",
                       last_start: str | None = None) -> None:
        """termination goes to resourceStatus.scheduling.terminationTimestamp (field_name="resourceStatus")
        or scheduling.terminationTime (field_name="scheduling"); None: no time (or one from
        last_start + max_run_duration)."""
        sched: dict[str, Any] = {"provisioningModel": model, "instanceTerminationAction": action,
                                 "onHostMaintenance": "TERMINATE", "automaticRestart": False}
        extra: dict[str, Any] = {}
        if max_run_duration_s is not None:
            sched["maxRunDuration"] = {"seconds": str(max_run_duration_s)}
        if termination and field_name == "scheduling":
            sched["terminationTime"] = termination
        elif termination:
            extra["resourceStatus"] = {"scheduling": {"terminationTimestamp": termination}}
        if last_start:
            extra["lastStartTimestamp"] = last_start
        self.scheduling[instance] = {"scheduling": sched, **extra}

    def set_maintenance(self, instance: str, window_start: str | None, can_reschedule: bool = True,
                        zone: str = "us-central1-a") -> None:
        """`resourceStatus.upcomingMaintenance` of a scheduled host maintenance (None: none)."""
        extra = self.instances[(zone, instance)].extra
        if window_start is None:
            extra.pop("resourceStatus", None)
            return
        extra["resourceStatus"] = {"upcomingMaintenance": {
            "type": "SCHEDULED", "canReschedule": can_reschedule, "windowStartTime": window_start,
            "maintenanceStatus": "PENDING"}}

    def set_event(self, key: str, value: str) -> None:
        with self._cond:
            self.events[key] = value
            self.event_versions[key] = self.event_versions.get(key, 0) + 1
            self._cond.notify_all()

    def etag(self, key: str) -> str:
        raw = f"{key}:{self.event_versions.get(key, 0)}:{self.events.get(key)}".encode()
        return hashlib.sha1(raw).hexdigest()[:16]

    # --- overrides -------------------------------------------------------------------------

    def _instance_json(self, inst) -> dict:
        payload = super()._instance_json(inst)
        for key, value in self.scheduling.get(inst.name, {}).items():
            payload[key] = {**payload[key], **value} if isinstance(payload.get(key), dict) else value
        return payload

    def _metadata(self, h: BaseHTTPRequestHandler, path: str) -> None:
        key = path.strip("/")
        if key not in EVENT_KEYS:
            return super()._metadata(h, path)
        query = {k: v[-1] for k, v in parse_qs(urlparse(h.path).query).items()}
        if h.headers.get("Metadata-Flavor") != "Google":
            return self._send_text(h, 403, "Missing Metadata-Flavor:Google header.")
        if query.get("wait_for_change") == "true":
            self.waits.append(key)
            last = query.get("last_etag", "")
            deadline = time.monotonic() + float(query.get("timeout_sec", "60"))
            with self._cond:
                start_version = self.event_versions.get(key, 0)
                while time.monotonic() < deadline and self._server is not None:
                    if last and last != self.etag(key):
                        break
                    if not last and self.event_versions.get(key, 0) != start_version:
                        break
                    self._cond.wait(min(0.2, max(deadline - time.monotonic(), 0.01)))
        with self._cond:
            value, tag = self.events[key], self.etag(key)
        self.calls.append(self._call_record(key, query))
        data = value.encode()
        h.send_response(200)
        h.send_header("Metadata-Flavor", "Google")
        h.send_header("ETag", tag)
        h.send_header("Content-Type", "application/text")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    @staticmethod
    def _call_record(key: str, query: dict[str, str]):
        from .fake_gcp import Call

        return Call("metadata", "GET", key, query, None)

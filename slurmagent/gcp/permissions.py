"""Which Compute permissions this VM's service account holds: each one `repair` and `expiry-watch` use.

Asked without changing anything, for `doctor`. Compute answers `testIamPermissions` on an
instance (v1) and on a managed instance group (`instanceGroupManagers.testIamPermissions`, in
the beta API only); for the rest it offers no such call, so a harmless read stands in: the
project-level `compute.instances.list` by a list filtered to this VM, the operation reads by a
get of an operation that does not exist (404: allowed to read, 403: not). Google documents
`testIamPermissions` as a tool for permission-aware UIs that may "fail open": a line that
passes here can still fail at the real call, one that fails here will fail there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from .compute import is_local_endpoint
from .metadata import MigRef

DEFAULT_ENDPOINT = "https://compute.googleapis.com"
SCOPE = "https://www.googleapis.com/auth/cloud-platform"
INSTANCE_PERMISSIONS = ("compute.instances.get", "compute.instances.reportHostAsFaulty")
MIG_PERMISSIONS = ("compute.instanceGroupManagers.update",)
PROBE_OPERATION = "slurmagent-doctor-probe"  # never exists: a 404 says the read is allowed

# permission -> (who uses it, for what)
USES: dict[str, tuple[str, str]] = {
    "compute.instances.get": ("repair, expiry-watch", "read the VM: its MIG, machine type, termination time"),
    "compute.instances.reportHostAsFaulty": ("repair", "report a faulty host (repair = auto/report-faulty)"),
    "compute.instances.list": ("repair", "find VMs outside [gcp] zone (instances.list / aggregatedList)"),
    "compute.instanceGroupManagers.update": ("repair", "recreateInstances on the VM's MIG"),
    "compute.zoneOperations.get": ("repair", "wait for its zonal operations"),
    "compute.regionOperations.get": ("repair", "wait for a regional MIG's operations"),
}


@dataclass(frozen=True)
class Verdict:
    permission: str
    held: bool | None  # None: the question got no usable answer
    how: str  # the request that answered
    error: str = ""


class _Http:
    """One session with a per-request timeout: google-auth credentials, none for a local fake."""

    def __init__(self, endpoint: str, timeout_s: float):
        self.base = (endpoint or DEFAULT_ENDPOINT).rstrip("/")
        if "://" not in self.base:
            self.base = f"https://{self.base}"
        self.timeout_s = timeout_s
        if is_local_endpoint(self.base):
            import requests  # only when doctor asks: start-up speed

            self.session: Any = requests.Session()
        else:
            import google.auth  # only when doctor asks: start-up speed
            from google.auth.transport.requests import AuthorizedSession

            creds, _ = google.auth.default(scopes=[SCOPE])
            self.session = AuthorizedSession(creds)

    def call(self, method: str, path: str, body: dict | None = None, params: dict | None = None) -> tuple[int, Any]:
        resp = self.session.request(method, f"{self.base}{path}", json=body, params=params, timeout=self.timeout_s)
        try:
            payload = resp.json()
        except ValueError:
            payload = None
        return resp.status_code, payload


def _message(status: int, payload: Any) -> str:
    err = payload.get("error") if isinstance(payload, dict) else None
    text = err.get("message", "") if isinstance(err, dict) else ""
    return f"HTTP {status} {text}".strip()


def check(project: str, zone: str, instance: str, mig: MigRef | None, endpoint: str = "",
          timeout_s: float = 4.0) -> list[Verdict]:
    """One verdict per permission of USES (the MIG's and the regional operations' only when
    the VM is in such a MIG). Raises nothing for an HTTP answer; a transport error or missing
    credentials propagate (the caller's line says the API could not be asked)."""
    http = _Http(endpoint, timeout_s)
    p = f"/compute/v1/projects/{quote(project)}"
    out: list[Verdict] = []
    out += _test(http, f"{p}/zones/{quote(zone)}/instances/{quote(instance)}/testIamPermissions",
                 INSTANCE_PERMISSIONS, f"instances.testIamPermissions on {instance}")
    status, payload = http.call("GET", f"{p}/zones/{quote(zone)}/instances",
                                params={"filter": f'name eq "{instance}"', "maxResults": 1})
    out.append(_read("compute.instances.list", status, payload, f"instances.list in {zone}", allowed=(200,)))
    if mig is not None:
        beta = f"/compute/beta/projects/{quote(project)}/{mig.scope}/{quote(mig.location)}"
        out += _test(http, f"{beta}/instanceGroupManagers/{quote(mig.name)}/testIamPermissions", MIG_PERMISSIONS,
                     f"instanceGroupManagers.testIamPermissions (beta) on {mig.scope}/{mig.location}/{mig.name}")
    reads = [("compute.zoneOperations.get", f"{p}/zones/{quote(zone)}/operations/{PROBE_OPERATION}",
              f"zoneOperations.get in {zone}")]
    if mig is not None and mig.regional:
        reads.append(("compute.regionOperations.get",
                      f"{p}/regions/{quote(mig.location)}/operations/{PROBE_OPERATION}",
                      f"regionOperations.get in {mig.location}"))
    for perm, path, how in reads:
        status, payload = http.call("GET", path)
        out.append(_read(perm, status, payload, how, allowed=(200, 404)))
    return out


def _test(http: _Http, path: str, wanted: tuple[str, ...], how: str) -> list[Verdict]:
    status, payload = http.call("POST", path, {"permissions": list(wanted)})
    if status != 200 or not isinstance(payload, dict):
        return [Verdict(perm, False if status == 403 else None, how, _message(status, payload)) for perm in wanted]
    held = set(payload.get("permissions") or [])
    return [Verdict(perm, perm in held, how) for perm in wanted]


def _read(perm: str, status: int, payload: Any, how: str, allowed: tuple[int, ...]) -> Verdict:
    if status in allowed:
        return Verdict(perm, True, how)
    return Verdict(perm, False if status in (401, 403) else None, how, _message(status, payload))

"""Who am I on Google Cloud: project, zone, instance name and the instance's MIG.

The ONE client of the metadata server: plain urllib and a short deadline (no google
library), never through a proxy (`http_proxy` must not see, or answer for, the server),
honouring `GCE_METADATA_HOST` (or its old name `GCE_METADATA_ROOT`) and `GCE_METADATA_IP`
like google-auth does. `[gcp] project` / `[gcp] zone` in the config override the server.

* `get`: a value that does not change (project, zone, instance name), cached. Off Google
  Cloud the first lookup fails within the deadline with one clear line, and the failure is
  remembered for the rest of the process so nothing waits twice.
* `read`: a value that changes (maintenance/preemption notices), never cached; with
  `wait_s` it is a long poll (`wait_for_change`, `last_etag`).
"""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from ..errors import SlurmagentError

DEFAULT_IP = "169.254.169.254"
DEFAULT_TIMEOUT_S = 2.0
FLAVOR = ("Metadata-Flavor", "Google")


class MetadataError(SlurmagentError):
    """The metadata server did not answer (not on Google Cloud?) or lacks a value."""

    exit_code = 1


def metadata_host() -> str:
    """host[:port] of the metadata server. The IP is the default (not the DNS name), so a
    machine off Google Cloud fails fast instead of waiting on a name lookup."""
    return (os.environ.get("GCE_METADATA_HOST") or os.environ.get("GCE_METADATA_ROOT")
            or os.environ.get("GCE_METADATA_IP") or DEFAULT_IP)


def _open(path: str, timeout_s: float, query: str = ""):
    """One GET of computeMetadata/v1/<path>, never through a proxy; checks the flavor header."""
    host = metadata_host()
    req = urllib.request.Request(f"http://{host}/computeMetadata/v1/{path.lstrip('/')}{query}",
                                 headers={FLAVOR[0]: FLAVOR[1]})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    resp = opener.open(req, timeout=timeout_s)
    if resp.headers.get(FLAVOR[0]) != FLAVOR[1]:
        resp.close()
        raise MetadataError(f"{host} answered without 'Metadata-Flavor: Google': not a metadata server")
    return resp


_cache: dict[tuple[str, str], str | None] = {}
_unreachable: dict[str, str] = {}


def reset_cache() -> None:
    _cache.clear()
    _unreachable.clear()


def get(path: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, optional: bool = False) -> str | None:
    """GET computeMetadata/v1/<path> as text. None for an absent optional value (404)."""
    host = metadata_host()
    key = (host, path)
    if key in _cache:
        return _cache[key]
    if host in _unreachable:
        raise MetadataError(_unreachable[host])
    try:
        with _open(path, timeout_s) as resp:
            value = resp.read(65536).decode("utf-8", "replace").strip()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            if optional:
                _cache[key] = None
                return None
            raise MetadataError(f"metadata server has no {path!r} (HTTP 404)") from None
        raise MetadataError(f"metadata server {host}: HTTP {exc.code} for {path!r}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        why = getattr(exc, "reason", exc)
        msg = (f"not on Google Cloud? the metadata server {host} did not answer within {timeout_s:g} s ({why}); "
               "set [gcp] project and zone in the config, or GCE_METADATA_HOST")
        _unreachable[host] = msg
        raise MetadataError(msg) from None
    _cache[key] = value
    return value


def read(path: str, timeout_s: float, *, wait_s: float = 0.0, last_etag: str = "", limit: int = 4096) -> tuple[str, str]:
    """GET computeMetadata/v1/<path> -> (value, ETag), no cache (these keys change).

    With `wait_s` > 0: `wait_for_change=true&timeout_sec=wait_s` (and `last_etag`): the
    server answers on a change or after wait_s; the socket deadline is wait_s + timeout_s.
    `limit`: the most bytes read (a recursive listing is longer than a notice)."""
    host = metadata_host()
    query = ""
    if wait_s > 0:
        q = {"wait_for_change": "true", "timeout_sec": str(max(1, int(wait_s)))}
        if last_etag:
            q["last_etag"] = last_etag
        query = "?" + urllib.parse.urlencode(q)
    try:
        with _open(path, timeout_s + wait_s, query) as resp:
            return resp.read(limit).decode("utf-8", "replace").strip(), resp.headers.get("ETag", "")
    except urllib.error.HTTPError as exc:
        raise MetadataError(f"metadata server {host}: HTTP {exc.code} for {path!r}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        why = getattr(exc, "reason", exc)
        raise MetadataError(f"metadata server {host} did not answer ({why}; deadline {timeout_s + wait_s:g} s)") from None


def machine_type(timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """`instance/machine-type` (`projects/N/machineTypes/a3-highgpu-8g`) -> `a3-highgpu-8g`.
    Not cached here: a daemon retries after an outage (the caller keeps it per boot)."""
    value = read("instance/machine-type", timeout_s)[0]
    if not value:
        raise MetadataError("metadata server has an empty 'instance/machine-type'")
    return last_segment(value)


@dataclass(frozen=True)
class MigRef:
    """A managed instance group: zonal (`zones/Z`) or regional (`regions/R`)."""

    project: str
    scope: str  # "zones" | "regions"
    location: str
    name: str

    @property
    def regional(self) -> bool:
        return self.scope == "regions"

    @property
    def path(self) -> str:
        return f"projects/{self.project}/{self.scope}/{self.location}/instanceGroupManagers/{self.name}"

    @property
    def short(self) -> str:
        return f"{self.scope}/{self.location}/instanceGroupManagers/{self.name}"

    def __str__(self) -> str:
        return self.short

    def to_dict(self) -> dict[str, str]:
        return {"project": self.project, "scope": self.scope, "location": self.location, "name": self.name}

    @classmethod
    def from_dict(cls, d: dict[str, str]) -> MigRef:
        return cls(d["project"], d["scope"], d["location"], d["name"])


_CREATED_BY = re.compile(
    r"^(?:https://[^/]+/compute/(?:v1|beta|alpha)/)?"
    r"projects/(?P<project>[^/]+)/(?P<scope>zones|regions)/(?P<location>[^/]+)/instanceGroupManagers/(?P<name>[^/\s]+)$"
)


def parse_created_by(value: str | None) -> MigRef | None:
    """`projects/NUM/zones/Z/instanceGroupManagers/NAME` (or `regions/R/...`, or a full URL)
    -> MigRef; None when the instance was not created by a MIG."""
    if not value:
        return None
    m = _CREATED_BY.match(value.strip())
    if not m:
        return None
    return MigRef(m["project"], m["scope"], m["location"], m["name"])


def last_segment(value: str) -> str:
    """`projects/123/zones/us-central1-a` -> `us-central1-a`."""
    return value.rstrip("/").rsplit("/", 1)[-1]


def zone_to_region(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


@dataclass(frozen=True)
class Identity:
    project: str
    zone: str
    instance: str | None = None
    mig: MigRef | None = None

    @property
    def region(self) -> str:
        return zone_to_region(self.zone)


def project_and_zone(cfg, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[str, str]:
    """Config first; the metadata server only for what the config leaves empty."""
    project = cfg.gcp.project or get("project/project-id", timeout_s) or ""
    zone = cfg.gcp.zone or last_segment(get("instance/zone", timeout_s) or "")
    if not project or not zone:
        raise MetadataError("cannot tell the project/zone: set [gcp] project and zone")
    return project, zone


def identity(cfg, timeout_s: float = DEFAULT_TIMEOUT_S, *, with_instance: bool = True) -> Identity:
    """This machine's project, zone, instance name and MIG (from `created-by`)."""
    project, zone = project_and_zone(cfg, timeout_s)
    if not with_instance:
        return Identity(project, zone)
    name = get("instance/name", timeout_s)
    mig = parse_created_by(get("instance/attributes/created-by", timeout_s, optional=True))
    return Identity(project, zone, name, mig)

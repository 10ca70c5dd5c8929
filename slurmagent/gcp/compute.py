"""The Compute API: MIG repair and the VM's termination time (the only module importing
google.cloud.compute_v1).

* `instance_mig`: `instances.get` -> the `created-by` metadata item -> the MIG (zonal or regional).
* `vm` / `find_vms`: what `repair` decides by (`core/vm.VmFacts`: MIG, machine type,
  provisioning model, reservation affinity, status, GPUs), from one `instances.get`, or for
  VMs outside the home zone (regional MIGs) from ONE `instances.list` per listed zone or ONE
  `instances.aggregatedList` for the project (a `name eq` filter, chunks of 100 names).
* `recreate`: `instanceGroupManagers.recreateInstances` (or the regional one): ONE call per
  MIG with all its instances (chunks of 1000, the API's limit).
* `report_faulty`: `instances.reportHostAsFaulty` (disruption IMMEDIATE, one fault reason).
* `read_scheduling`: `instances.get` on the instance named like the node -> when the VM
  will be terminated (`resourceStatus.scheduling.terminationTimestamp`, else
  `scheduling.terminationTime`, else `lastStartTimestamp + scheduling.maxRunDuration`) and
  the scheduling facts around it (provisioning model, termination action, host maintenance
  policy, `resourceStatus.upcomingMaintenance`, whether it is a GPU VM).
* `wait`: the operation is polled through Zone/RegionOperationsClient on the same endpoint and
  credentials (the clients' own poller calls Google's endpoint whatever `client_options` say).

Every request has a timeout (capped by the caller's deadline) and `retry=None` so the
library's 600 s default retry cannot outlive it; 429, 5xx and connection failures are
retried here with jittered exponential backoff (honouring Retry-After); 403/404 and other
4xx are not. A mutation carries a `requestId`: a retry or a journal replay cannot act twice.

Credentials: anonymous for an `http://127.0.0.1` / `localhost` endpoint, else Application Default.
"""

from __future__ import annotations

import random
import re
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable
from urllib.parse import urlparse

from ..errors import ExpiryError, SlurmagentError
from ..core.vm import VmFacts
from ..core.timefmt import fmt_time, parse_time, usable_time
from . import metadata
from .metadata import MigRef, parse_created_by

MAX_PER_CALL = 1000  # recreateInstances takes at most 1000 instances
NAMES_PER_FILTER = 100  # instances.list/aggregatedList: names per `name eq` filter
REFUSED = frozenset({400, 403, 412})  # the API said no to this request (not "try later")
API_RETRIES = 5  # repair: attempts of one request on 429/5xx/connection failures
API_BACKOFF_S = 1.0  # repair: first backoff between those attempts (jittered, doubling)
SCHEDULING_CALL_TIMEOUT_S = 15.0  # expiry: one instances.get, within [expiry] api_timeout_s
SCHEDULING_RETRIES = 2
SCHEDULING_BACKOFF_S = 0.5
RETRIABLE = frozenset({408, 429, 500, 502, 503, 504})
NAMESPACE = uuid.UUID("5b0e6a4e-7f4c-4f0e-9a55-6c1a3d1f2b10")


class ComputeError(SlurmagentError):
    """A Compute API call failed (after retries where that makes sense)."""

    exit_code = 1

    def __init__(self, message: str, status: int | None = None, *, answered: bool = False):
        super().__init__(message)
        self.status = status
        self.answered = answered  # a reply came (malformed, say): the API is there, the request failed

    @property
    def retriable(self) -> bool:
        return self.status is None or self.status in RETRIABLE

    no_answer = property(lambda self: self.retriable and not self.answered)  # an outage, not a verdict

    @property
    def refused(self) -> bool:
        """Refused for this VM or this request (e.g. reportHostAsFaulty on a flex-start VM), not a
        passing failure: asking again will not help, another way might."""
        return self.status in REFUSED


@dataclass(frozen=True)
class OpRef:
    """An extended operation: zonal, regional or global."""

    scope: str  # "zones" | "regions" | "global"
    location: str
    name: str

    def to_dict(self) -> dict[str, str]:
        return {"scope": self.scope, "location": self.location, "name": self.name}

    def __str__(self) -> str:
        return f"{self.scope}/{self.location}/operations/{self.name}" if self.location else f"global/operations/{self.name}"


def chunk_request_id(request_id: str, index: int) -> str:
    """A stable UUID per chunk of a request, so a replay resends the same ids."""
    return request_id if index == 0 else str(uuid.uuid5(NAMESPACE, f"{request_id}/{index}"))


def is_local_endpoint(endpoint: str) -> bool:
    u = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
    return u.scheme == "http" and (u.hostname or "") in ("127.0.0.1", "localhost", "::1")


class Compute:
    def __init__(self, project: str, endpoint: str = "", *, call_timeout_s: float = 30.0, deadline_s: float = 120.0,
                 retries: int = 5, backoff_s: float = 1.0, sleep: Callable[[float], None] = time.sleep):
        self.project = project
        self.endpoint = endpoint
        self.call_timeout_s = call_timeout_s
        self.deadline_s = deadline_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.sleep = sleep
        self.calls: Counter[str] = Counter()  # API requests sent, by method (attempts included)
        self._clients: dict[str, Any] = {}

    @classmethod
    def from_config(cls, cfg, project: str) -> Compute:
        r = cfg.repair
        return cls(project, cfg.gcp.compute_endpoint, call_timeout_s=float(r.api_timeout_s),
                   deadline_s=float(r.operation_timeout_s), retries=API_RETRIES, backoff_s=API_BACKOFF_S)

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    # --- clients (google imported here only) -------------------------------------------

    def _client(self, kind: str):
        if kind in self._clients:
            return self._clients[kind]
        try:
            from google.cloud import compute_v1
        except ImportError as exc:  # pragma: no cover - a declared dependency
            raise ComputeError(f"google-cloud-compute is not installed: {exc}") from None
        classes = {
            "instances": compute_v1.InstancesClient,
            "igm": compute_v1.InstanceGroupManagersClient,
            "rigm": compute_v1.RegionInstanceGroupManagersClient,
            "zone_ops": compute_v1.ZoneOperationsClient,
            "region_ops": compute_v1.RegionOperationsClient,
            "global_ops": compute_v1.GlobalOperationsClient,
        }
        kwargs: dict[str, Any] = {"transport": "rest"}
        if self.endpoint:
            kwargs["client_options"] = {"api_endpoint": self.endpoint}
            if is_local_endpoint(self.endpoint):
                from google.auth.credentials import AnonymousCredentials

                kwargs["credentials"] = AnonymousCredentials()
        try:
            client = classes[kind](**kwargs)
        except Exception as exc:  # DefaultCredentialsError and friends
            raise ComputeError(f"cannot create a Compute client: {type(exc).__name__}: {exc}") from None
        self._clients[kind] = client
        return client

    # --- one request, with retries -----------------------------------------------------

    def _call(self, method: str, fn: Callable[..., Any], end: float, **kwargs: Any) -> Any:
        from google.api_core import exceptions as gexc

        transport_errors: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)
        try:
            import requests

            transport_errors += (requests.exceptions.RequestException,)
        except ImportError:  # pragma: no cover
            pass
        try:
            from google.auth import exceptions as auth_exc

            transport_errors += (auth_exc.TransportError,)
            auth_errors: tuple[type[BaseException], ...] = (auth_exc.RefreshError, auth_exc.DefaultCredentialsError)
        except ImportError:  # pragma: no cover
            auth_errors = ()
        try:  # a 200 whose body is not the expected JSON (a proxy's error page, a truncated reply)
            from google.protobuf.json_format import Error as ParseError

            malformed: tuple[type[BaseException], ...] = (ParseError, ValueError)
        except ImportError:  # pragma: no cover
            malformed = (ValueError,)
        attempt = 0
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise ComputeError(f"{method}: deadline passed before the call", None)
            self.calls[method] += 1
            retry_after = None
            try:
                return fn(**kwargs, retry=None, timeout=min(self.call_timeout_s, remaining))
            except gexc.GoogleAPICallError as exc:
                status = exc.code if isinstance(exc.code, int) else None
                message = re.sub(r"^(GET|POST|PUT|PATCH|DELETE) \S+: ", "", str(exc.message or ""))
                err = ComputeError(f"{method}: HTTP {status} {message}".strip(), status)
                response = getattr(exc, "response", None)
                if response is not None:
                    retry_after = _retry_after(getattr(response, "headers", {}) or {})
            except auth_errors as exc:
                if not _token_unreachable(exc, transport_errors):
                    raise ComputeError(f"{method}: no usable Google credentials: {exc}", 401) from None
                err = ComputeError(f"{method}: no access token yet: {exc}", None)  # the metadata server, not IAM
            except transport_errors as exc:
                err = ComputeError(f"{method}: {type(exc).__name__}: {exc}", None)
            except malformed as exc:
                text = (str(exc).strip().splitlines() or [""])[0][:200]
                err = ComputeError(f"{method}: malformed response ({type(exc).__name__}: {text})", None, answered=True)
            if not err.retriable or attempt >= self.retries:
                if attempt:
                    err.args = (f"{err.args[0]} (after {attempt + 1} attempts)",)
                raise err
            delay = retry_after if retry_after is not None else self.backoff_s * (2 ** attempt) * random.uniform(0.5, 1.0)
            delay = min(delay, 30.0)
            if time.monotonic() + delay >= end:
                raise ComputeError(f"{err.args[0]} (deadline reached after {attempt + 1} attempts)", err.status,
                                   answered=err.answered)
            self.sleep(delay)
            attempt += 1

    def _end(self, deadline_s: float | None) -> float:
        return time.monotonic() + (self.deadline_s if deadline_s is None else deadline_s)

    # --- reads ---------------------------------------------------------------------------

    def instance(self, zone: str, instance: str, deadline_s: float | None = None) -> Any:
        """`instances.get`: the Instance message (metadata, scheduling, resource status)."""
        client = self._client("instances")
        return self._call("instances.get", client.get, self._end(deadline_s), project=self.project, zone=zone,
                          instance=instance)

    def instance_mig(self, zone: str, instance: str, deadline_s: float | None = None) -> MigRef | None:
        """The MIG that created this instance (`created-by`), None when it is not in one."""
        return instance_mig_of(self.instance(zone, instance, deadline_s))

    def vm(self, zone: str, instance: str, deadline_s: float | None = None) -> VmFacts:
        """`instances.get` -> the facts `repair` decides by. An answer that is not this instance
        (no name: a proxy's `[]` or `{}`) is a malformed response, not a VM without facts."""
        inst = self.instance(zone, instance, deadline_s)
        if getattr(inst, "name", "") != instance:
            raise ComputeError(f"instances.get: malformed response (not instance {instance!r})", None, answered=True)
        return vm_facts(inst, zone)

    def find_vms(self, names: list[str], zones: list[str] | None = None,
                 deadline_s: float | None = None) -> dict[str, VmFacts]:
        """VMs by name: in `zones` (one `instances.list` each), or anywhere in the project (one
        `instances.aggregatedList`). Names not found are absent from the answer."""
        end = self._end(deadline_s)
        found: dict[str, VmFacts] = {}
        for i in range(0, len(names), NAMES_PER_FILTER):
            flt = name_filter(names[i:i + NAMES_PER_FILTER])
            if zones is None:
                for zone, inst in self._aggregated(flt, end):
                    found.setdefault(inst.name, vm_facts(inst, zone))
            else:
                for zone in zones:
                    for inst in self._listed(zone, flt, end):
                        found.setdefault(inst.name, vm_facts(inst, zone))
        return {n: found[n] for n in names if n in found}

    def _listed(self, zone: str, flt: str, end: float) -> list[Any]:
        from google.cloud import compute_v1

        client, out, token = self._client("instances"), [], ""
        while True:
            req = compute_v1.ListInstancesRequest(project=self.project, zone=zone, filter=flt, page_token=token)
            page = self._call("instances.list", client.list, end, request=req)
            out.extend(page.items)
            token = page.next_page_token
            if not token:
                return out

    def _aggregated(self, flt: str, end: float) -> list[tuple[str, Any]]:
        from google.cloud import compute_v1

        client, out, token = self._client("instances"), [], ""
        while True:
            req = compute_v1.AggregatedListInstancesRequest(project=self.project, filter=flt, page_token=token)
            page = self._call("instances.aggregatedList", client.aggregated_list, end, request=req)
            for scope, scoped in page.items.items():
                out.extend((metadata.last_segment(scope), inst) for inst in scoped.instances)
            token = page.next_page_token
            if not token:
                return out

    # --- mutations -----------------------------------------------------------------------

    def recreate(self, mig: MigRef, instances: list[tuple[str, str]], request_id: str,
                 deadline_s: float | None = None) -> list[OpRef]:
        """recreateInstances for (zone, name) pairs of one MIG: one call per 1000 instances."""
        from google.cloud import compute_v1

        end = self._end(deadline_s)
        ops = []
        urls = [f"zones/{zone}/instances/{name}" for zone, name in instances]
        for i in range(0, len(urls), MAX_PER_CALL):
            body = compute_v1.InstanceGroupManagersRecreateInstancesRequest(instances=urls[i:i + MAX_PER_CALL])
            rid = chunk_request_id(request_id, i // MAX_PER_CALL)
            if mig.regional:
                client = self._client("rigm")
                req = compute_v1.RecreateInstancesRegionInstanceGroupManagerRequest(
                    project=self.project, region=mig.location, instance_group_manager=mig.name,
                    region_instance_group_managers_recreate_request_resource=compute_v1.RegionInstanceGroupManagersRecreateRequest(
                        instances=urls[i:i + MAX_PER_CALL]),
                    request_id=rid)
                op = self._call("regionInstanceGroupManagers.recreateInstances", client.recreate_instances_unary, end,
                                request=req)
            else:
                client = self._client("igm")
                req = compute_v1.RecreateInstancesInstanceGroupManagerRequest(
                    project=self.project, zone=mig.location, instance_group_manager=mig.name,
                    instance_group_managers_recreate_instances_request_resource=body, request_id=rid)
                op = self._call("instanceGroupManagers.recreateInstances", client.recreate_instances_unary, end,
                                request=req)
            ops.append(op_ref(op, mig.scope, mig.location))
        return ops

    def report_faulty(self, zone: str, instance: str, behavior: str, description: str, request_id: str,
                      deadline_s: float | None = None) -> OpRef:
        """reportHostAsFaulty: the host is taken out and the VM moved (disruption IMMEDIATE)."""
        from google.cloud import compute_v1

        client = self._client("instances")
        body = compute_v1.InstancesReportHostAsFaultyRequest(
            disruption_schedule="IMMEDIATE",
            fault_reasons=[compute_v1.InstancesReportHostAsFaultyRequestFaultReason(
                behavior=behavior, description=description[:1000])],
        )
        req = compute_v1.ReportHostAsFaultyInstanceRequest(
            project=self.project, zone=zone, instance=instance,
            instances_report_host_as_faulty_request_resource=body, request_id=request_id)
        op = self._call("instances.reportHostAsFaulty", client.report_host_as_faulty_unary, self._end(deadline_s),
                        request=req)
        return op_ref(op, "zones", zone)

    # --- operations ----------------------------------------------------------------------

    def wait(self, op: OpRef, deadline_s: float | None = None, poll_s: float = 0.5) -> None:
        """Poll the operation until DONE (raise on its error) or the deadline."""
        from google.cloud import compute_v1

        end = self._end(deadline_s)
        interval = poll_s
        while True:
            if op.scope == "zones":
                got = self._call("zoneOperations.get", self._client("zone_ops").get, end,
                                 project=self.project, zone=op.location, operation=op.name)
            elif op.scope == "regions":
                got = self._call("regionOperations.get", self._client("region_ops").get, end,
                                 project=self.project, region=op.location, operation=op.name)
            else:
                got = self._call("globalOperations.get", self._client("global_ops").get, end,
                                 project=self.project, operation=op.name)
            if got.status == compute_v1.Operation.Status.DONE:
                errors = list(getattr(getattr(got, "error", None), "errors", []) or [])
                if errors or got.http_error_status_code >= 400:
                    detail = "; ".join(f"{e.code}: {e.message}" for e in errors) or got.http_error_message
                    raise ComputeError(f"operation {op.name} failed: {detail}", got.http_error_status_code or None)
                return
            if time.monotonic() + interval >= end:
                raise ComputeError(f"operation {op.name} not done within the deadline (status {got.status.name})", None)
            self.sleep(interval)
            interval = min(interval * 1.5, 5.0)


# --- the VM's termination time (expiry watch) -----------------------------------------------


@dataclass(frozen=True)
class SchedulingInfo:
    termination_time: datetime | None
    provisioning_model: str = ""
    instance_termination_action: str = ""
    max_run_duration_s: float | None = None
    field: str = ""  # the API field the time came from
    on_host_maintenance: str = ""  # TERMINATE | MIGRATE
    gpu_vm: bool = False  # GPUs attached (or an accelerator-optimized machine type)
    maintenance_window_start: datetime | None = None  # resourceStatus.upcomingMaintenance.windowStartTime
    maintenance_can_reschedule: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "termination_time": fmt_time(self.termination_time) if self.termination_time else None,
            "provisioning_model": self.provisioning_model,
            "instance_termination_action": self.instance_termination_action,
            "max_run_duration_s": self.max_run_duration_s,
            "field": self.field,
            "on_host_maintenance": self.on_host_maintenance,
            "gpu_vm": self.gpu_vm,
            "maintenance_window_start": (fmt_time(self.maintenance_window_start)
                                         if self.maintenance_window_start else None),
            "maintenance_can_reschedule": self.maintenance_can_reschedule,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SchedulingInfo:
        t, w = d.get("termination_time"), d.get("maintenance_window_start")
        return cls(parse_time(t) if t else None, d.get("provisioning_model", ""),
                   d.get("instance_termination_action", ""), d.get("max_run_duration_s"), d.get("field", ""),
                   d.get("on_host_maintenance", ""), bool(d.get("gpu_vm")), parse_time(w) if w else None,
                   d.get("maintenance_can_reschedule"))


def _has(msg: Any, name: str) -> bool:
    try:
        return name in msg
    except TypeError:
        return bool(getattr(msg, name, None))


def api_time(field: str, text: str, offset_s: float = 0.0) -> datetime:
    """A time the API gave (plus `offset_s`), or ExpiryError naming the field (timefmt.usable_time)."""
    try:
        return usable_time(text, offset_s)
    except ValueError as exc:
        plus = f" + {offset_s:g} s" if offset_s else ""
        raise ExpiryError(f"instances.get: {field} {text!r}{plus} is not a usable time ({exc})") from None


def scheduling_from_instance(inst: Any) -> SchedulingInfo:
    """A compute_v1.Instance -> the termination time and the scheduling facts around it.
    Raises ExpiryError when a time it needs is unusable (the watch keeps its cached answer)."""
    sched = inst.scheduling if _has(inst, "scheduling") else None
    model = str(sched.provisioning_model) if sched is not None and _has(sched, "provisioning_model") else ""
    action = (str(sched.instance_termination_action)
              if sched is not None and _has(sched, "instance_termination_action") else "")
    mrd = None
    if sched is not None and _has(sched, "max_run_duration"):
        mrd = float(sched.max_run_duration.seconds) + sched.max_run_duration.nanos / 1e9
    when, src = None, ""
    rs = inst.resource_status if _has(inst, "resource_status") else None
    if rs is not None and _has(rs, "scheduling") and _has(rs.scheduling, "termination_timestamp"):
        src = "resourceStatus.scheduling.terminationTimestamp"
        when = api_time(src, rs.scheduling.termination_timestamp)
    elif sched is not None and _has(sched, "termination_time") and sched.termination_time:
        src = "scheduling.terminationTime"
        when = api_time(src, sched.termination_time)
    elif mrd and _has(inst, "last_start_timestamp") and inst.last_start_timestamp:
        src = "lastStartTimestamp+scheduling.maxRunDuration"
        when = api_time(src, inst.last_start_timestamp, mrd)
    on_maintenance = (str(sched.on_host_maintenance)
                      if sched is not None and _has(sched, "on_host_maintenance") else "")
    window, can_reschedule = None, None
    if rs is not None and _has(rs, "upcoming_maintenance"):
        um = rs.upcoming_maintenance
        if _has(um, "window_start_time") and um.window_start_time:
            window = api_time("resourceStatus.upcomingMaintenance.windowStartTime", um.window_start_time)
        if _has(um, "can_reschedule"):
            can_reschedule = bool(um.can_reschedule)
    gpu_vm = vm_facts(inst, "").gpu_vm
    return SchedulingInfo(when, model, action, mrd, src, on_maintenance, gpu_vm, window, can_reschedule)


def read_scheduling(cfg: Any, node: str) -> SchedulingInfo:
    """`instances.get` for the instance named like this node (the slurm-gcp convention)."""
    project, zone = metadata.project_and_zone(cfg, cfg.expiry.metadata_timeout_s)
    budget = float(cfg.expiry.api_timeout_s)
    compute = Compute(project, cfg.gcp.compute_endpoint, call_timeout_s=max(1.0, min(budget, SCHEDULING_CALL_TIMEOUT_S)),
                      deadline_s=budget, retries=SCHEDULING_RETRIES, backoff_s=SCHEDULING_BACKOFF_S)
    try:
        inst = compute.instance(zone, node, budget)
    except ComputeError as exc:
        if exc.status == 404:
            raise ExpiryError(f"instances.get: no instance {node!r} in {project}/{zone} "
                              "(slurmagent takes the node name as the instance name)") from None
        raise
    return scheduling_from_instance(inst)


def instance_mig_of(inst: Any) -> MigRef | None:
    items = list(getattr(getattr(inst, "metadata", None), "items", []) or [])
    return parse_created_by(next((i.value for i in items if i.key == "created-by"), None))


def vm_facts(inst: Any, zone: str) -> VmFacts:
    """A compute_v1.Instance -> core/vm.VmFacts (the zone from the instance when it says one)."""
    sched = inst.scheduling if _has(inst, "scheduling") else None
    model = str(sched.provisioning_model) if sched is not None and _has(sched, "provisioning_model") else ""
    ra = inst.reservation_affinity if _has(inst, "reservation_affinity") else None
    reservation = (str(ra.consume_reservation_type)
                   if ra is not None and _has(ra, "consume_reservation_type") else "")
    mig = instance_mig_of(inst)
    gpus = sum(int(a.accelerator_count or 0) for a in (inst.guest_accelerators or []))
    where = metadata.last_segment(inst.zone) if _has(inst, "zone") and inst.zone else zone
    return VmFacts(zone=where, status=str(inst.status) if _has(inst, "status") else "",
                   machine_type=metadata.last_segment(inst.machine_type) if _has(inst, "machine_type") else "",
                   provisioning_model=model, reservation=reservation, mig=mig.to_dict() if mig else None, gpus=gpus)


def name_filter(names: list[str]) -> str:
    """Compute's regular-expression filter for these exact names (`name eq "(a|b)"`)."""
    return 'name eq "(' + "|".join(n.replace(".", "\\.") for n in names) + ')"'


def op_ref(op: Any, scope: str, location: str) -> OpRef:
    """The Operation's own zone/region link wins over the caller's guess."""
    zone = getattr(op, "zone", "") or ""
    region = getattr(op, "region", "") or ""
    if zone:
        return OpRef("zones", zone.rstrip("/").rsplit("/", 1)[-1], op.name)
    if region:
        return OpRef("regions", region.rstrip("/").rsplit("/", 1)[-1], op.name)
    return OpRef(scope, location, op.name)


def _retry_after(headers: Any) -> float | None:
    try:
        value = headers.get("Retry-After") or headers.get("retry-after")
        return None if value is None else max(0.0, float(value))
    except (AttributeError, ValueError):
        return None


def _token_unreachable(exc: BaseException, transport_errors: tuple[type[BaseException], ...]) -> bool:
    """A token refresh that failed on the way (the metadata server slow, restarting, 5xx), not a
    refusal (a 4xx: the VM has no service account): retried and counted as transport."""
    cause = exc.__cause__ or (exc.args[0] if exc.args else None)
    refused = re.search(r"Status: 4\d\d", str(cause))  # google-auth's words for a 4xx: no service account
    return bool(getattr(exc, "retryable", False)) or (isinstance(cause, transport_errors) and not refused)

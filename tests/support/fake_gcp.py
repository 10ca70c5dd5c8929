"""A fake Compute API + metadata server on 127.0.0.1 for the repair tests.

It speaks the Compute REST JSON that google-cloud-compute's REST transport sends (the real
client library and google-auth talk to it through `[gcp] compute_endpoint` and
`GCE_METADATA_HOST`):

* GET  /compute/v1/projects/P/zones/Z/instances/I                        instances.get
* GET  /compute/v1/projects/P/zones/Z/instances?filter=name eq "(a|b)"   instances.list
* GET  /compute/v1/projects/P/aggregated/instances?filter=...            instances.aggregatedList
* POST /compute/v1/projects/P/zones/Z/instances/I/reportHostAsFaulty     instances.reportHostAsFaulty
* POST /compute/v1/projects/P/zones/Z/instanceGroupManagers/M/recreateInstances
* POST /compute/v1/projects/P/regions/R/instanceGroupManagers/M/recreateInstances
* GET  /compute/v1/projects/P/{zones/Z|regions/R|global}/operations/O    (and POST .../O/wait)
* POST /compute/v1/projects/P/zones/Z/instances/I/testIamPermissions    instances.testIamPermissions
* POST /compute/beta/projects/P/{zones/Z|regions/R}/instanceGroupManagers/M/testIamPermissions
* GET  /storage/v1/b/B/o                                                  objects.list (no objects)
* GET  /storage/v1/b/B/iam/testPermissions?permissions=...                buckets.testIamPermissions
* GET  /computeMetadata/v1/...                                             (Metadata-Flavor: Google)

`testIamPermissions` answers the permissions asked minus those in `denied`, as Compute and
Cloud Storage do (a subset, HTTP 200, whatever the caller lacks). The two storage routes know
only the buckets in `buckets` (others: 404): enough for `doctor`'s bucket line, which writes nothing.

Every request is recorded (`calls`); `fail(kind, 429, 429)` makes the next requests of a
kind answer those HTTP errors, then succeed. A `requestId` seen before returns the same
operation without acting again, as the real API does.

An instance carries what `repair` reads (machine type, `scheduling.provisioningModel`,
`reservationAffinity`, GPUs, status). `reportHostAsFaulty` refuses, as Google documents, a VM
that is not RUNNING (INSTANCE_SHOULD_BE_RUNNING), not an A3 Ultra/A4/A4X/A3 Mega/A3 High 8g
(MACHINE_TYPE_NOT_SUPPORTED) or not reservation-bound (INSTANCES_WITHOUT_RESERVATION_NOT_SUPPORTED):
with HTTP 400 and Compute's error body, or, with `refuse_in_operation`, as an operation that
ends DONE with that error code.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlparse

API = "https://www.googleapis.com/compute/v1"
ERROR_REASONS = {400: "invalid", 403: "forbidden", 404: "notFound", 429: "rateLimitExceeded", 500: "backendError",
                 503: "backendError"}


@dataclass
class Call:
    kind: str
    method: str
    path: str
    query: dict[str, str]
    body: Any
    status: int = 200


REPORTABLE_TYPES = ("a3-ultragpu-", "a4-highgpu-", "a4x-highgpu-", "a3-megagpu-8g", "a3-highgpu-8g")


@dataclass
class FakeInstance:
    name: str
    zone: str
    created_by: str | None = None
    status: str = "RUNNING"
    recreated: int = 0
    reported: int = 0
    machine_type: str = "a3-highgpu-8g"
    provisioning_model: str = ""  # "" = not sent (STANDARD)
    reservation: str = ""  # reservationAffinity.consumeReservationType
    gpus: int = 8
    extra: dict = field(default_factory=dict)  # more instance JSON (resourceStatus, scheduling keys, ...)
    refuse: str | None = None  # refuse reportHostAsFaulty with this code whatever the VM (e.g. RATE_LIMIT...)

    def refusal(self) -> str | None:
        """Why reportHostAsFaulty is refused for this VM (Google's error code), None: accepted."""
        if self.refuse:
            return self.refuse
        if self.status != "RUNNING":
            return "INSTANCE_SHOULD_BE_RUNNING"
        if not self.machine_type.startswith(REPORTABLE_TYPES):
            return "MACHINE_TYPE_NOT_SUPPORTED"
        if self.provisioning_model != "RESERVATION_BOUND" and not (
                self.provisioning_model in ("", "STANDARD") and self.reservation == "SPECIFIC_RESERVATION"):
            return "INSTANCES_WITHOUT_RESERVATION_NOT_SUPPORTED"
        return None


@dataclass
class FakeGcp:
    project: str = "test-proj"
    project_number: str = "123456789"
    instances: dict[tuple[str, str], FakeInstance] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    failures: dict[str, list[int]] = field(default_factory=dict)
    ops: dict[str, dict] = field(default_factory=dict)
    polls_until_done: int = 1
    op_errors: list[dict] = field(default_factory=list)  # the next operations end DONE with these errors
    on_recreate: Callable[[str, list[str]], None] | None = None
    refuse_in_operation: bool = False  # reportHostAsFaulty refusals come as a failed operation, not HTTP 400
    denied: set[str] = field(default_factory=set)  # permissions testIamPermissions leaves out
    buckets: set[str] = field(default_factory=set)  # what the storage routes know
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _request_ids: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    # --- setup ------------------------------------------------------------------------

    def mig_path(self, name: str, zone: str | None = None, region: str | None = None) -> str:
        where = f"regions/{region}" if region else f"zones/{zone}"
        return f"projects/{self.project_number}/{where}/instanceGroupManagers/{name}"

    def add_instance(self, name: str, zone: str = "us-central1-a", mig: str | None = None,
                     region: str | None = None, **facts: Any) -> FakeInstance:
        """`facts`: FakeInstance fields (machine_type, provisioning_model, reservation, gpus, status, extra)."""
        created_by = self.mig_path(mig, zone=None if region else zone, region=region) if mig else None
        inst = FakeInstance(name, zone, created_by, **facts)
        self.instances[(zone, name)] = inst
        return inst

    def set_identity(self, instance: str, zone: str = "us-central1-a", created_by: str | None = None) -> None:
        self.metadata.update({
            "project/project-id": self.project,
            "project/numeric-project-id": self.project_number,
            "instance/zone": f"projects/{self.project_number}/zones/{zone}",
            "instance/name": instance,
            "instance/hostname": f"{instance}.c.{self.project}.internal",
            "instance/machine-type": f"projects/{self.project_number}/machineTypes/a3-highgpu-8g",
        })
        if created_by:
            self.metadata["instance/attributes/created-by"] = created_by
        else:
            self.metadata.pop("instance/attributes/created-by", None)

    def fail(self, kind: str, *codes: int) -> None:
        """The next len(codes) requests of `kind` answer these HTTP errors."""
        self.failures.setdefault(kind, []).extend(codes)

    def calls_of(self, *kinds: str) -> list[Call]:
        return [c for c in self.calls if c.kind in kinds]

    @property
    def mutations(self) -> list[Call]:
        return [c for c in self.calls if c.method == "POST" and not c.kind.endswith(("Operations.wait",
                                                                                    "testIamPermissions"))]

    # --- server -----------------------------------------------------------------------

    def start(self) -> FakeGcp:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK wait

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                fake._handle(self, "GET")

            def do_POST(self):
                fake._handle(self, "POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def host(self) -> str:
        assert self._server
        return f"127.0.0.1:{self._server.server_address[1]}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    # --- request handling ---------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        u = urlparse(h.path)
        query = {k: v if k == "permissions" else v[-1] for k, v in parse_qs(u.query).items()}
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("latin-1")
        if u.path.startswith("/computeMetadata/v1/"):
            return self._metadata(h, u.path[len("/computeMetadata/v1/"):])
        kind, handler, args = self._route(method, u.path)
        call = Call(kind, method, u.path, query, body)
        with self._lock:
            self.calls.append(call)
            queued = self.failures.get(kind)
            code = queued.pop(0) if queued else None
        if kind == "unknown":
            code = 404
        if code:
            call.status = code
            return self._error(h, code, f"injected {code} for {kind}" if kind != "unknown" else f"no route {u.path}")
        status, payload = handler(query, body, **args)
        call.status = status
        if status >= 400:
            reason, message = payload if isinstance(payload, tuple) else (None, payload)
            return self._error(h, status, message, reason)
        self._send(h, status, payload)

    def _route(self, method: str, path: str):
        p = r"/compute/v1/projects/(?P<project>[^/]+)"
        routes = [
            ("GET", p + r"/zones/(?P<zone>[^/]+)/instances/(?P<instance>[^/]+)$", "instances.get", self._instance_get),
            ("GET", p + r"/zones/(?P<zone>[^/]+)/instances$", "instances.list", self._instance_list),
            ("GET", p + r"/aggregated/instances$", "instances.aggregatedList", self._instance_aggregated),
            ("POST", p + r"/zones/(?P<zone>[^/]+)/instances/(?P<instance>[^/]+)/reportHostAsFaulty$",
             "instances.reportHostAsFaulty", self._report_faulty),
            ("POST", p + r"/(?P<scope>zones)/(?P<location>[^/]+)/instanceGroupManagers/(?P<mig>[^/]+)/recreateInstances$",
             "instanceGroupManagers.recreateInstances", self._recreate),
            ("POST", p + r"/(?P<scope>regions)/(?P<location>[^/]+)/instanceGroupManagers/(?P<mig>[^/]+)/recreateInstances$",
             "regionInstanceGroupManagers.recreateInstances", self._recreate),
            ("GET", p + r"/zones/(?P<location>[^/]+)/operations/(?P<op>[^/]+)$", "zoneOperations.get", self._op_get),
            ("POST", p + r"/zones/(?P<location>[^/]+)/operations/(?P<op>[^/]+)/wait$", "zoneOperations.wait", self._op_get),
            ("GET", p + r"/regions/(?P<location>[^/]+)/operations/(?P<op>[^/]+)$", "regionOperations.get", self._op_get),
            ("POST", p + r"/regions/(?P<location>[^/]+)/operations/(?P<op>[^/]+)/wait$", "regionOperations.wait",
             self._op_get),
            ("GET", p + r"/global/operations/(?P<op>[^/]+)$", "globalOperations.get", self._op_get),
            ("POST", p + r"/zones/(?P<zone>[^/]+)/instances/(?P<instance>[^/]+)/testIamPermissions$",
             "instances.testIamPermissions", self._test_permissions),
            ("POST", r"/compute/beta/projects/(?P<project>[^/]+)/(?P<scope>zones|regions)/(?P<location>[^/]+)"
                     r"/instanceGroupManagers/(?P<mig>[^/]+)/testIamPermissions$",
             "instanceGroupManagers.testIamPermissions", self._test_permissions),
            ("GET", r"/storage/v1/b/(?P<bucket>[^/]+)/o$", "storage.objects.list", self._objects_list),
            ("GET", r"/storage/v1/b/(?P<bucket>[^/]+)/iam/testPermissions$", "storage.buckets.testIamPermissions",
             self._bucket_test_permissions),
        ]
        for m, pattern, kind, handler in routes:
            match = re.match(pattern, path)
            if match and m == method:
                args = match.groupdict()
                args.pop("project", None)
                return kind, handler, args
        return "unknown", None, {}

    def _instance_get(self, query, body, zone: str, instance: str):
        inst = self.instances.get((zone, instance))
        if inst is None:
            return 404, f"The resource 'projects/{self.project}/zones/{zone}/instances/{instance}' was not found"
        return 200, self._instance_json(inst)

    def _test_permissions(self, query, body, **where):
        asked = (body or {}).get("permissions") or []
        return 200, {"permissions": [p for p in asked if p not in self.denied]}

    def _objects_list(self, query, body, bucket: str):
        if bucket not in self.buckets:
            return 404, "The specified bucket does not exist."
        return 200, {"kind": "storage#objects"}

    def _bucket_test_permissions(self, query, body, bucket: str):
        if bucket not in self.buckets:
            return 404, "The specified bucket does not exist."
        return 200, {"kind": "storage#testIamPermissionsResponse",
                     "permissions": [p for p in query.get("permissions", []) if p not in self.denied]}

    def _instance_json(self, inst: FakeInstance) -> dict:
        zone, instance = inst.zone, inst.name
        items = [{"key": "enable-oslogin", "value": "TRUE"}]
        if inst.created_by:
            items.append({"key": "created-by", "value": inst.created_by})
        out = {
            "kind": "compute#instance", "id": str(abs(hash((zone, instance))) % 10**15), "name": instance,
            "zone": f"{API}/projects/{self.project}/zones/{zone}", "status": inst.status,
            "machineType": f"{API}/projects/{self.project}/zones/{zone}/machineTypes/{inst.machine_type}",
            "metadata": {"kind": "compute#metadata", "fingerprint": "abc=", "items": items},
            "selfLink": f"{API}/projects/{self.project}/zones/{zone}/instances/{instance}",
            "scheduling": {"onHostMaintenance": "TERMINATE" if inst.gpus else "MIGRATE", "automaticRestart": True},
        }
        if inst.provisioning_model:
            out["scheduling"]["provisioningModel"] = inst.provisioning_model
        if inst.reservation:
            out["reservationAffinity"] = {"consumeReservationType": inst.reservation}
        if inst.gpus:
            out["guestAccelerators"] = [{"acceleratorCount": inst.gpus, "acceleratorType": (
                f"{API}/projects/{self.project}/zones/{zone}/acceleratorTypes/nvidia-h100-80gb")}]
        for key, value in inst.extra.items():
            out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    def _matching(self, query) -> Callable[[str], bool]:
        """`name eq "RE2"` (Compute's regular-expression filter; the whole name must match)."""
        flt = query.get("filter", "")
        if not flt:
            return lambda name: True
        m = re.fullmatch(r'\s*name\s+eq\s+"(.*)"\s*', flt)
        assert m, f"fake: unsupported filter {flt!r}"
        pattern = re.compile(m[1])
        return lambda name: pattern.fullmatch(name) is not None

    def _instance_list(self, query, body, zone: str):
        match = self._matching(query)
        items = [self._instance_json(i) for (z, n), i in sorted(self.instances.items()) if z == zone and match(n)]
        return 200, {"kind": "compute#instanceList", "id": f"projects/{self.project}/zones/{zone}/instances",
                     "items": items, "selfLink": f"{API}/projects/{self.project}/zones/{zone}/instances"}

    def _instance_aggregated(self, query, body):
        match = self._matching(query)
        scoped: dict[str, dict] = {}
        for (zone, name), inst in sorted(self.instances.items()):
            if match(name):
                scoped.setdefault(f"zones/{zone}", {"instances": []})["instances"].append(self._instance_json(inst))
        return 200, {"kind": "compute#instanceAggregatedList", "id": f"projects/{self.project}/aggregated/instances",
                     "items": scoped, "selfLink": f"{API}/projects/{self.project}/aggregated/instances"}

    def _new_op(self, query, op_type: str, scope: str, location: str, target: str) -> dict:
        rid = query.get("requestId")
        if rid and rid in self._request_ids:
            return self.ops[self._request_ids[rid]]
        n = next(self._ids)
        name = f"operation-{n}-{op_type}"
        op = {"kind": "compute#operation", "id": str(1000 + n), "name": name, "operationType": op_type,
              "status": "RUNNING", "progress": 0, "targetLink": target,
              "selfLink": f"{API}/projects/{self.project}/{scope}/{location}/operations/{name}",
              "insertTime": "2026-11-30T05:00:00.000-08:00", "_polls": 0, "_new": True}
        op["zone" if scope == "zones" else "region"] = f"{API}/projects/{self.project}/{scope}/{location}"
        if self.op_errors:
            err = self.op_errors.pop(0)
            op["_error"] = {"error": {"errors": [{"code": err.get("code", "RESOURCE_NOT_FOUND"),
                                                  "message": err.get("message", "injected")}]},
                            "httpErrorStatusCode": err.get("status", 400), "httpErrorMessage": "BAD REQUEST"}
        self.ops[name] = op
        if rid:
            self._request_ids[rid] = name
        return op

    def _recreate(self, query, body, scope: str, location: str, mig: str):
        urls = (body or {}).get("instances") or []
        if not urls:
            return 400, "Required field 'instances' not specified"
        if len(urls) > 1000:
            return 400, "Too many instances: at most 1000"
        mig_suffix = f"/{scope}/{location}/instanceGroupManagers/{mig}"
        names = []
        for url in urls:
            m = re.search(r"zones/([^/]+)/instances/([^/]+)$", url)
            inst = self.instances.get((m[1], m[2])) if m else None
            if inst is None or not (inst.created_by or "").endswith(mig_suffix):
                return 400, f"Instance '{url}' is not a member of instance group manager '{mig}'"
            names.append(inst.name)
        target = f"{API}/projects/{self.project}/{scope}/{location}/instanceGroupManagers/{mig}"
        with self._lock:
            op = self._new_op(query, "recreateInstances", scope, location, target)
            fresh = op.pop("_new", False)
        if fresh:
            for name in names:
                for inst in self.instances.values():
                    if inst.name == name:
                        inst.recreated += 1
            if self.on_recreate:
                self.on_recreate(mig, names)
        return 200, self._public(op)

    def _report_faulty(self, query, body, zone: str, instance: str):
        inst = self.instances.get((zone, instance))
        if inst is None:
            return 404, f"The resource 'projects/{self.project}/zones/{zone}/instances/{instance}' was not found"
        body = body or {}
        reasons = body.get("faultReasons") or []
        valid = {"BEHAVIOR_UNSPECIFIED", "PERFORMANCE", "SILENT_DATA_CORRUPTION", "UNRECOVERABLE_GPU_ERROR",
                 "CHIP_ERROR"}
        if body.get("disruptionSchedule") not in ("IMMEDIATE", "FUTURE") or not reasons or any(
                r.get("behavior") not in valid for r in reasons):
            return 400, f"Invalid value in reportHostAsFaulty request: {body}"
        refusal = inst.refusal()
        if refusal and not self.refuse_in_operation:
            return 400, (refusal, f"{refusal}: reportHostAsFaulty is not supported for instance "
                                  f"'projects/{self.project}/zones/{zone}/instances/{instance}'")
        target = f"{API}/projects/{self.project}/zones/{zone}/instances/{instance}"
        with self._lock:
            op = self._new_op(query, "reportHostAsFaulty", "zones", zone, target)
            fresh = op.pop("_new", False)
            if fresh and refusal:
                op["_error"] = {"error": {"errors": [{"code": refusal, "message": f"{refusal}: not supported for "
                                                                                   f"{instance}"}]},
                                "httpErrorStatusCode": 400, "httpErrorMessage": "BAD REQUEST"}
        if fresh and not refusal:
            inst.reported += 1
        return 200, self._public(op)

    def _op_get(self, query, body, op: str, location: str | None = None):
        found = self.ops.get(op)
        if found is None:
            return 404, f"The resource 'operations/{op}' was not found"
        with self._lock:
            found["_polls"] += 1
            if found["_polls"] >= self.polls_until_done:
                found.update(status="DONE", progress=100, endTime="2026-11-30T05:00:01.000-08:00",
                             **found.get("_error", {}))
        return 200, self._public(found)

    @staticmethod
    def _public(op: dict) -> dict:
        return {k: v for k, v in op.items() if not k.startswith("_")}

    # --- metadata ------------------------------------------------------------------------

    def _metadata(self, h: BaseHTTPRequestHandler, path: str) -> None:
        self.calls.append(Call("metadata", "GET", path, {}, None))
        if h.headers.get("Metadata-Flavor") != "Google":
            return self._send_text(h, 403, "Missing Metadata-Flavor:Google header.")
        with self._lock:
            queued = self.failures.get("metadata")
            code = queued.pop(0) if queued else None
        if code:
            return self._send_text(h, code, f"injected {code} for metadata")
        value = self.metadata.get(path.strip("/"))
        if value is None:
            return self._send_text(h, 404, "not found")
        self._send_text(h, 200, value)

    # --- wire ----------------------------------------------------------------------------

    def _send(self, h: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json; charset=UTF-8")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _send_text(self, h: BaseHTTPRequestHandler, status: int, text: str) -> None:
        data = text.encode()
        h.send_response(status)
        h.send_header("Metadata-Flavor", "Google")
        h.send_header("Content-Type", "application/text")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _error(self, h: BaseHTTPRequestHandler, code: int, message: str, reason: str | None = None) -> None:
        self._send(h, code, {"error": {"code": code, "message": message, "errors": [
            {"message": message, "domain": "global", "reason": reason or ERROR_REASONS.get(code, "error")}]}})

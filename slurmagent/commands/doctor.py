"""`slurmagent doctor`: each check is a pass/fail line with the fix, never an exception.

It changes nothing: every check reads (the state dir is judged, never created; the
permissions, Compute's and the bucket's, are asked with `testIamPermissions` or a harmless
read). Exit 0: every line ok or skipped; 1: a check failed; 2: the config file named by
--config/$SLURMAGENT_CONFIG is missing or invalid; 3: the metadata server, the Compute API or
the bucket gave no answer (3 wins over 1).

Exit 3 also when slurmctld does not answer (`doctor_checks.controller_results`).

Local checks (config, slurm.conf found as the hooks find it, NVML, state dir, metrics file) run
first. The external ones (metadata server, Compute permission, bucket, clock, the job channel,
the controller and what Slurm 25.11+ does for it, the systemd units: `doctor_checks.py`) then run
side by side in daemon threads with
one shared deadline: every request has its own timeout, and a check that still has not
answered at the deadline is a failed line ("no answer within N s"), so one hung endpoint
neither hides the other lines nor holds the command past `EXTERNAL_DEADLINE_S`.
"""

from __future__ import annotations

import email.utils
import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from ..state import config as config_mod
from ..errors import EXIT_OK, EXIT_PROBLEMS, EXIT_UNREACHABLE, EXIT_USAGE, SlurmagentError
from ..state.build import version
from ..state.fsutil import untrusted_reason
from ..checkpoint.remote import parse_remote
from ..gcp import metadata
from ..gcp import permissions
from ..gcp.compute import Compute, ComputeError
from ..gcp.metadata import parse_created_by
from ..state.host import node_name
from ..slurm.commands import CONF_SEARCH, conf_value, read_conf_lines, valid_node_name
from ..state import metrics
from . import health
from .doctor_checks import (SLURM_CONTROLLER, SLURM_FEATURES, Result, controller_results, find_slurm_conf,
                            metrics_file_result, one_line as _one_line, skip as _skip, unit_results)
from ..slurm.hookfiles import Verdict, conf_values, healthcheck_verdict, hook_verdict

METADATA_TIMEOUT_S = 2.0  # one metadata request (capped by [expiry] metadata_timeout_s)
CALL_TIMEOUT_S = 4.0  # one Compute / Cloud Storage / clock request
EXTERNAL_DEADLINE_S = 7.0  # all external checks together
MAX_CLOCK_SKEW_S = 2.0
DEFAULT_COMPUTE_ENDPOINT = "https://compute.googleapis.com"

FIX_METADATA = "run on a GCE VM or set [gcp] project/zone"
FIX_ROLE = "roles/compute.instanceAdmin.v1 has every one repair and expiry-watch use"
FIX_COMPUTE = "check [gcp] compute_endpoint and the network path to the Compute API"
FIX_BUCKET_IAM = "grant this VM's service account roles/storage.objectUser on the bucket"
FIX_CLOCK = "enable NTP (chrony/systemd-timesyncd; on GCE: server metadata.google.internal)"


def exit_code(results: list[Result]) -> int:
    """2 a config error; 3 when a service gave no answer (the verdict is incomplete, as for
    `status` and `repair`); 1 any other failed line; 0 all good."""
    if any(r.config_error for r in results):
        return EXIT_USAGE
    if any(r.unreachable and not r.ok for r in results):
        return EXIT_UNREACHABLE
    return EXIT_OK if all(r.ok for r in results) else EXIT_PROBLEMS


def as_json(results: list[Result]) -> dict[str, object]:
    """`doctor --json`: the same lines as the table, and the exit code they give."""
    code = exit_code(results)
    return {"ok": code == EXIT_OK, "exit_code": code, "version": version(), "checks": [r.to_dict() for r in results]}


def slurm_conf_results(conf: Path | None, tried: list[Path] | None = None) -> list[Result]:
    """The slurm.conf lines slurmagent's hooks rely on (see hooks/slurm.conf.example); `conf`:
    the one found (`doctor_checks.find_slurm_conf`), None when none of `tried` is readable."""
    lines = read_conf_lines(conf) if conf is not None else []
    if not lines:
        where = ", ".join(str(p) for p in tried) if tried else str(conf)
        return [Result("slurm.conf", False, f"cannot read a slurm.conf (tried {where})",
                       "set [slurm] conf (or SLURM_CONF) to the slurm.conf slurmd reads")]
    out = [_from_verdict(f"slurm.conf {key}", hook_verdict(key, conf_values(lines, key), conf.parent))
           for key in ("Prolog", "Epilog")]
    out.append(_from_verdict("slurm.conf HealthCheckProgram",
                             healthcheck_verdict(conf_value(lines, "HealthCheckProgram"), conf.parent)))
    flags = (conf_value(lines, "PrologFlags") or "").lower().split(",")
    out.append(Result("slurm.conf PrologFlags", "alloc" in flags, ",".join(f for f in flags if f) or "not set",
                      "PrologFlags=Alloc (check the node when the job is allocated, before it starts)"))
    params = (conf_value(lines, "SchedulerParameters") or "").split(",")
    out.append(Result("slurm.conf nohold_on_prolog_fail", "nohold_on_prolog_fail" in params,
                      "set" if "nohold_on_prolog_fail" in params else "missing: jobs would be requeued HELD",
                      "add nohold_on_prolog_fail to SchedulerParameters"))
    timeout = conf_value(lines, "PrologEpilogTimeout")
    out.append(Result("slurm.conf PrologEpilogTimeout", bool(timeout), timeout or "not set (hooks may hang forever)",
                      "PrologEpilogTimeout=120"))
    return out


def _from_verdict(name: str, v: Verdict) -> Result:
    return Result(name, v.ok, v.detail, v.fix, skipped=v.skipped)


def missing_slurm_conf_lines(conf: Path | None, tried: list[Path] | None = None) -> list[str]:
    """What `install` says slurm.conf still needs (the slurm.conf found as doctor finds it)."""
    return [f"{r.name}: {r.fix}" for r in slurm_conf_results(conf, tried) if not r.ok and r.fix]


def install_still_needs(root: Path) -> tuple[str, list[str]]:
    """`install`'s "slurm.conf (WHERE) still needs" lines, from the slurm.conf found as the
    hooks find it (the configless cache included), under `root` when it is not /."""
    if root == Path("/"):
        src = health.SOURCES
        conf, tried = find_slurm_conf("", os.environ if src.env is None else src.env, src.conf_search)
    else:
        conf, tried = find_slurm_conf("", {}, tuple(root / str(p).lstrip("/") for p in CONF_SEARCH))
    return (str(conf) if conf else " or ".join(str(p) for p in tried)), missing_slurm_conf_lines(conf, tried)


def run_doctor(config_path: str | None, *, clock: Callable[[], float] = time.time,
               external_deadline_s: float = EXTERNAL_DEADLINE_S) -> list[Result]:
    """Every line, local checks first. slurm.conf is searched as the hooks search it
    (`health.SOURCES.conf_search`: the configless cache included)."""
    results: list[Result] = [Result("version", True, f"slurmagent {version()}")]  # which one runs on this node
    path, required = config_mod.config_path(config_path)
    try:
        cfg = config_mod.load(config_path, for_root_hook=True)
        if not required and not os.path.lexists(path):
            results.append(Result("config", True, f"no config file at {path}: the built-in defaults apply"))
        else:
            results.append(Result("config", True, f"{cfg.source} valid, root-owned, not writable by others"))
    except SlurmagentError as exc:
        refused = "refused" in str(exc)
        fix = (f"chown root:root {path} and chmod go-w it and every directory above it"
               if refused else f"fix {path} (see docs/admin/configuration.md)")
        results.append(Result("config", False, str(exc), fix, config_error=not refused))
        try:
            cfg = config_mod.load(config_path)
        except SlurmagentError:
            cfg = config_mod.Config()
    src = health.SOURCES
    conf, tried = find_slurm_conf(cfg.slurm.conf, os.environ if src.env is None else src.env, src.conf_search)
    if cfg.slurm.conf and conf != Path(cfg.slurm.conf):  # the search went on: say so, never pass it over
        results.append(Result("[slurm] conf", False, f"{cfg.slurm.conf} is not a readable file"
                              + (f"; read {conf} instead" if conf else ""),
                              "set [slurm] conf to the slurm.conf slurmd reads, or remove it to search"))
    results.extend(slurm_conf_results(conf, tried))
    node = node_name()
    if not valid_node_name(node):  # it names state paths
        node = node_name(None, {})  # the host name
    results.append(_gpu_result(cfg, node))
    results.append(_state_dir_result(cfg.state_path(node)))
    results.extend(external_results(cfg, clock=clock, deadline_s=external_deadline_s, conf=conf,
                                    textfile=metrics.for_node(cfg, node).textfile))
    return results


def _gpu_result(cfg: config_mod.Config, node: str) -> Result:
    try:
        snap = health.read_snapshot(cfg, node)
    except SlurmagentError as exc:
        return Result("GPUs", False, str(exc), "check the NVIDIA driver (nvidia-smi) or [health] snapshot")
    if snap.nvml_error:
        return Result("GPUs", False, f"NVML cannot start: {snap.nvml_error}", "install/load the NVIDIA driver")
    exp = health.expected(cfg, node)
    if exp.count is None:  # the gpu-count rule would be off: a missing GPU would pass as healthy
        return Result("GPUs", False, f"{len(snap.gpus)} GPU(s) seen, expected count unknown: tried "
                      + "; ".join(exp.tried),
                      "set [health] expected_gpus, or make slurm.conf/gres.conf readable here "
                      "([slurm] conf, e.g. the configless cache /var/spool/slurmd/conf-cache/slurm.conf)")
    ok = len(snap.gpus) >= exp.count
    detail = f"{len(snap.gpus)} GPU(s) seen, {exp.count} expected ({exp.source})"
    return Result("GPUs", ok, detail, "set Gres=gpu:N for this node or [health] expected_gpus")


def _state_dir_result(state_dir: Path) -> Result:
    """Judged, never created or written: a diagnostic changes nothing (the first real run creates it)."""
    name = "state dir"
    if not state_dir.exists():
        parent = next((p for p in state_dir.parents if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            return Result(name, False, f"{state_dir} does not exist and {parent} is not writable by this user",
                          f"mkdir -p {state_dir} (as root)")
        why = untrusted_reason(parent)
        if why:
            return Result(name, False, f"{state_dir} does not exist; {why}: root would ignore the files in it",
                          "set state_dir to a path under a root-only directory")
        return Result(name, True, f"{state_dir} does not exist yet: the first slurmagent run creates it "
                                  f"(under {parent}, writable)")
    if not state_dir.is_dir():
        return Result(name, False, f"{state_dir} is not a directory", f"remove {state_dir} or set state_dir")
    if not os.access(state_dir, os.W_OK | os.X_OK):
        return Result(name, False, f"{state_dir}: not writable by this user", f"chmod u+w {state_dir} (as root)")
    why = untrusted_reason(state_dir)  # root ignores every file in it: expiry, journal, cursor, decision log
    if why:
        return Result("state dir", False, f"{why}: root would ignore the files in {state_dir}",
                      f"rm -r {state_dir} and let root create it, or set state_dir to a path under a root-only "
                      "directory (a `%n` path in a world-writable directory can be created by any user first)")
    return Result("state dir", True, f"{state_dir} writable, only by root")


# --- external checks: bounded, side by side ------------------------------------------------


def external_results(cfg: config_mod.Config, *, clock: Callable[[], float] = time.time,
                     deadline_s: float = EXTERNAL_DEADLINE_S, conf: Path | None = None,
                     textfile: Path | None = None) -> list[Result]:
    md_timeout = max(0.1, min(float(cfg.expiry.metadata_timeout_s) or METADATA_TIMEOUT_S, METADATA_TIMEOUT_S))
    checks: list[tuple[str, str, Callable[[], Result]]] = [
        ("metadata server", FIX_METADATA, lambda: _metadata_result(cfg, md_timeout)),
        ("compute API", FIX_COMPUTE, lambda: _compute_results(cfg, md_timeout, deadline_s)),
        ("checkpoint bucket", "check [checkpoint] remote and the network path to Cloud Storage",
         lambda: _bucket_result(cfg)),
        ("clock", FIX_CLOCK, lambda: _clock_result(cfg, md_timeout, clock)),
        ("job channel", "systemctl restart slurmagent-watch (journalctl -u slurmagent-watch says why)",
         lambda: _channel_result(cfg)),
        (SLURM_CONTROLLER, "check slurmctld and the network path to it (scontrol ping)",
         lambda: controller_results(cfg.slurm.scontrol, float(cfg.slurm.timeout_s), conf)),
        ("slurmagent-watch", "check systemd (systemctl status slurmagent-watch)", unit_results),
    ]
    if textfile is not None:  # its modes, then node_exporter's own word where it answers on this host
        checks.append(("metrics file", "see docs/admin/observability.md", lambda: metrics_file_result(textfile)))
    rows = run_bounded(checks, deadline_s)
    i = next(i for i, r in enumerate(rows) if r.name == "compute API")
    if not rows[i + 1].name.startswith("permission "):  # the check hung: the same lines, every time
        rows[i + 1:i + 1] = _permission_skips("not checked: the Compute API did not answer in time")
    for head, follower, line in ((SLURM_CONTROLLER, SLURM_FEATURES, _skip(SLURM_FEATURES, "not asked: the controller "
                                                                                       "did not answer in time")),
                                 ("slurmagent-watch", "expiry timer", Result("expiry timer", False, "systemctl did not "
                                                                             "answer in time", "systemctl status"))):
        i = next(i for i, r in enumerate(rows) if r.name == head)
        if i + 1 >= len(rows) or rows[i + 1].name != follower:
            rows.insert(i + 1, line)
    return rows


LOCAL_CHECKS = ("job channel", "slurmagent-watch", "metrics file")  # this host's own: hung is a problem (1), not an outage (3)


def run_bounded(checks: list[tuple[str, str, Callable[[], Result | list[Result]]]],
                deadline_s: float) -> list[Result]:
    """Run each check in a daemon thread; whatever has not answered by the deadline fails (a
    remote service: unreachable, exit 3; this host's own, `LOCAL_CHECKS`: a problem, exit 1).
    A check may give several lines (the Compute API and its permissions)."""
    slots: list[Result | list[Result] | None] = [None] * len(checks)

    def target(i: int, name: str, fix: str, fn: Callable[[], Result | list[Result]]) -> None:
        try:
            slots[i] = fn()
        except Exception as exc:  # noqa: BLE001 - a doctor line, never a traceback
            slots[i] = Result(name, False, _one_line(f"{type(exc).__name__}: {exc}"), fix)

    threads = []
    for i, (name, fix, fn) in enumerate(checks):
        t = threading.Thread(target=target, args=(i, name, fix, fn), name=f"doctor-{name}", daemon=True)
        t.start()
        threads.append(t)
    end = time.monotonic() + deadline_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    out: list[Result] = []
    for slot, (name, fix, _) in zip(slots, checks):
        if slot is None:
            slot = Result(name, False, f"no answer within {deadline_s:g} s", fix, unreachable=name not in LOCAL_CHECKS)
        out.extend(slot if isinstance(slot, list) else [slot])
    return out


def _channel_result(cfg: config_mod.Config) -> Result:
    """This node's wrapper -> root channel answers a no-op (actions/job_channel.probe)."""
    from ..actions.channel_client import probe  # only here: start-up speed
    from ..state.host import node_name

    state, detail = probe(cfg, node_name())
    if state in ("off", "absent"):
        return _skip("job channel", detail)
    return Result("job channel", state == "ok", detail,
                  "systemctl restart slurmagent-watch (journalctl -u slurmagent-watch says why)")


def _metadata_result(cfg: config_mod.Config, timeout_s: float) -> Result:
    name = "metadata server"
    host = metadata.metadata_host()
    try:
        project = metadata.get("project/project-id", timeout_s)
        zone = metadata.last_segment(metadata.get("instance/zone", timeout_s) or "")
        instance = metadata.get("instance/name", timeout_s, optional=True)
    except SlurmagentError as exc:
        if cfg.gcp.project and cfg.gcp.zone:
            return Result(name, True, f"{host} not reachable; using [gcp] project {cfg.gcp.project!r} and zone "
                                      f"{cfg.gcp.zone!r} from the config ({_one_line(exc, 120)})")
        return Result(name, False, _one_line(exc), FIX_METADATA, unreachable=True)
    return Result(name, True, f"{host}: project {project}, zone {zone}, instance {instance or '?'}")


def _compute_results(cfg: config_mod.Config, md_timeout: float, deadline_s: float) -> list[Result]:
    """The VM as the Compute API sees it (`instances.get`), then one line per permission that
    `repair` and `expiry-watch` use (gcp/permissions.py asks, changing nothing)."""
    name = "compute API"

    def lookup(path: str) -> str:
        try:
            return metadata.get(path, md_timeout, optional=True) or ""
        except SlurmagentError:
            return ""

    project = cfg.gcp.project or lookup("project/project-id")
    zone = cfg.gcp.zone or metadata.last_segment(lookup("instance/zone"))
    instance = lookup("instance/name")
    if not (project and zone and instance):
        missing = ", ".join(k for k, v in (("project", project), ("zone", zone), ("instance name", instance)) if not v)
        return [_skip(name, f"not checked: {missing} unknown (the metadata server did not say)"),
                *_permission_skips("not checked: the VM is unknown")]
    compute = Compute(project, cfg.gcp.compute_endpoint, call_timeout_s=CALL_TIMEOUT_S,
                      deadline_s=max(1.0, deadline_s - md_timeout), retries=1, backoff_s=0.5)
    mig = parse_created_by(lookup("instance/attributes/created-by"))
    try:
        mig = compute.instance_mig(zone, instance)
        where = f"in MIG {mig.path}" if mig else "NOT in a managed instance group: `repair` cannot recreate it"
        head = Result(name, True, f"instances.get {project}/{zone}/{instance}: {where}")
    except ComputeError as exc:
        if exc.status in (401, 403):  # the permission lines below say which one
            head = Result(name, True, f"answers; instances.get {instance} refused ({_one_line(exc, 120)})")
        else:
            fix = (f"check [gcp] project/zone: no VM {instance!r} in {project}/{zone}" if exc.status == 404 else
                   "check the network path to the Compute API ([gcp] compute_endpoint)")
            return [Result(name, False, f"instances.get {instance}: {_one_line(exc)}", fix, unreachable=exc.no_answer),
                    *_permission_skips("not checked: the Compute API did not answer")]
    try:
        verdicts = permissions.check(project, zone, instance, mig, cfg.gcp.compute_endpoint, CALL_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - transport error, no credentials: a line, never a traceback
        return [head, *_permission_skips(f"not asked: {_one_line(f'{type(exc).__name__}: {exc}', 160)}")]
    rows = {v.permission: _permission_result(v) for v in verdicts}
    absent = "not needed: the VM is in no MIG" if mig is None else "not needed: the MIG is zonal"
    return [head, *(rows.get(p) or _skip(f"permission {p}", absent) for p in permissions.USES)]


def _permission_result(v: permissions.Verdict) -> Result:
    who, what = permissions.USES[v.permission]
    name = f"permission {v.permission}"
    if v.held:
        return Result(name, True, f"held ({v.how}); {who}: {what}")
    fix = f"grant this VM's service account {v.permission} ({FIX_ROLE})"
    if v.held is False:
        return Result(name, False, f"MISSING ({v.how}{': ' + v.error if v.error else ''}): {who} cannot {what}", fix)
    return Result(name, False, f"cannot tell ({v.how}: {v.error})", fix)


def _permission_skips(why: str) -> list[Result]:
    return [_skip(f"permission {p}", why) for p in permissions.USES]


# What the checkpoint path does with objects: upload and compose (create), restore (get), scan
# (list), replace a manifest and remove compose parts (delete). roles/storage.objectUser has them.
BUCKET_PERMISSIONS = ("storage.objects.create", "storage.objects.get", "storage.objects.list",
                      "storage.objects.delete", "storage.objects.update")  # update: customTime marks for the lifecycle rule


def _bucket_result(cfg: config_mod.Config) -> Result:
    """Lists one object name under the prefix (does the bucket exist, may this VM read it),
    then asks the bucket's `testIamPermissions` for what the checkpoint path uses. It writes
    nothing: an endpoint without `testIamPermissions` (an emulator) says so in the line."""
    name = "checkpoint bucket"
    remote = cfg.checkpoint.remote
    if not remote:
        return _skip(name, "not configured ([checkpoint] remote is empty)")
    from ..checkpoint.gcs.bucket import make_client  # the storage client only for this check: start-up speed

    try:
        bucket_name, prefix = parse_remote(remote)
    except SlurmagentError as exc:
        return Result(name, False, _one_line(exc), "set [checkpoint] remote = \"gs://BUCKET/PREFIX\"")
    where = f"gs://{bucket_name}/{prefix}" if prefix else f"gs://{bucket_name}"
    step = "connecting"
    try:
        client = make_client()
        step = "objects.list"
        next(iter(client.list_blobs(bucket_name, max_results=1, prefix=f"{prefix}/" if prefix else None,
                                    timeout=CALL_TIMEOUT_S, retry=None)), None)
        step = "testIamPermissions"
        granted = set(client.bucket(bucket_name).test_iam_permissions(list(BUCKET_PERMISSIONS),
                                                                      timeout=CALL_TIMEOUT_S, retry=None))
    except SlurmagentError as exc:  # no credentials
        return Result(name, False, _one_line(exc), "run on a VM with a service account or set "
                                                   "GOOGLE_APPLICATION_CREDENTIALS")
    except Exception as exc:  # noqa: BLE001
        code = getattr(exc, "code", None)
        if code == 404 and step == "objects.list":
            return Result(name, False, f"bucket gs://{bucket_name} does not exist (remote {remote})",
                          f"create it (gcloud storage buckets create gs://{bucket_name}) or fix [checkpoint] remote")
        if code in (404, 501) and step == "testIamPermissions":  # the bucket exists (listed): no such method here
            return Result(name, True, f"listed {where}; its write permissions not checked: this endpoint has no "
                                      f"bucket testIamPermissions (HTTP {code}: an emulator?)")
        if code in (401, 403):
            return Result(name, False, f"{step} on gs://{bucket_name} refused: HTTP {code}", FIX_BUCKET_IAM)
        return Result(name, False, f"{step} on gs://{bucket_name} failed: {_one_line(f'{type(exc).__name__}: {exc}', 200)}",
                      "check the network path to Cloud Storage (STORAGE_EMULATOR_HOST for an emulator)",
                      unreachable=code is None or code >= 500 or code in (408, 429))
    missing = [p for p in BUCKET_PERMISSIONS if p not in granted]
    if missing:
        return Result(name, False, f"this VM's account lacks {', '.join(missing)} on gs://{bucket_name}", FIX_BUCKET_IAM)
    return Result(name, True, f"listed {where}; holds {', '.join(p.split('.')[-1] for p in BUCKET_PERMISSIONS)} "
                              f"on gs://{bucket_name} (testIamPermissions)")


def _clock_result(cfg: config_mod.Config, md_timeout: float, clock: Callable[[], float]) -> Result:
    """Local time against the `Date` header of the metadata server, else of the Compute
    endpoint; `timedatectl show -p NTPSynchronized` when neither answers."""
    name = "clock"
    sources = [(f"the metadata server {metadata.metadata_host()}",
                f"http://{metadata.metadata_host()}/computeMetadata/v1/", {"Metadata-Flavor": "Google"}, md_timeout,
                True)]
    endpoint = (cfg.gcp.compute_endpoint or DEFAULT_COMPUTE_ENDPOINT).rstrip("/")
    if "://" not in endpoint:
        endpoint = f"https://{endpoint}"
    sources.append((f"the Compute endpoint {endpoint}", f"{endpoint}/", {}, CALL_TIMEOUT_S, False))
    tried = []
    for what, url, headers, timeout, flavored in sources:
        try:
            skew, rtt = http_date_skew(url, headers, timeout, clock, require_flavor=flavored)
        except (OSError, ValueError) as exc:
            tried.append(f"{what}: {_one_line(getattr(exc, 'reason', exc), 80)}")
            continue
        margin = MAX_CLOCK_SKEW_S + rtt / 2
        if abs(skew) > margin:
            ahead = "ahead of" if skew > 0 else "behind"
            return Result(name, False, f"local clock {abs(skew):.1f} s {ahead} {what} (limit {MAX_CLOCK_SKEW_S:g} s)",
                          FIX_CLOCK)
        return Result(name, True, f"within {MAX_CLOCK_SKEW_S:g} s of {what} (off by {skew:+.1f} s)")
    synced = _ntp_synchronized()
    if synced is True:
        return Result(name, True, "timedatectl: NTP synchronized (no HTTP time source answered)")
    if synced is False:
        return Result(name, False, "timedatectl: NTP not synchronized", FIX_CLOCK)
    return _skip(name, "cannot tell: " + "; ".join(tried) + "; timedatectl unavailable")


def http_date_skew(url: str, headers: dict[str, str], timeout: float, clock: Callable[[], float] = time.time,
                   *, require_flavor: bool = False) -> tuple[float, float]:
    """(local - server seconds, round trip) from one response's `Date` header (1 s resolution,
    truncated, so the server's time is taken as the middle of its second). `require_flavor`:
    only a real metadata server (`Metadata-Flavor: Google`) counts, not a proxy answering for it."""
    req = urllib.request.Request(url, headers=headers)
    t0 = clock()
    m0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - http(s) URL from config
            answer = resp.headers
    except urllib.error.HTTPError as exc:  # any HTTP answer carries a Date
        answer = exc.headers
    rtt = time.monotonic() - m0
    if require_flavor and (answer is None or answer.get("Metadata-Flavor") != "Google"):
        raise ValueError("answered without 'Metadata-Flavor: Google'")
    date = answer.get("Date") if answer is not None else None
    if not date:
        raise ValueError("no Date header in the answer")
    parsed = email.utils.parsedate_to_datetime(date)
    server = parsed.timestamp() + 0.5
    return t0 + rtt / 2 - server, rtt


def _ntp_synchronized() -> bool | None:
    exe = shutil.which("timedatectl")
    if not exe:
        return None
    try:
        proc = subprocess.run([exe, "show", "-p", "NTPSynchronized", "--value"], capture_output=True, text=True,
                              timeout=CALL_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    value = proc.stdout.strip().lower()
    if proc.returncode != 0 or value not in ("yes", "no"):
        return None
    return value == "yes"


"""What a job's wrapper may ask of root on its node, and whether root grants it.

The wrapper runs as the job's user: it may not drain a node or write root's state dir. It
asks the `watch` service over a local socket instead (DESIGN: "Wrapper -> root"). Everything
in a request is untrusted input: it is parsed here with hard limits, then judged against
what root read itself: the asking process's uid (the kernel's SO_PEERCRED, never the
request) and the job as Slurm shows it (owner uid, state, nodes). A request is granted
only for a RUNNING job of the asking uid that runs on this node, about this node or (a
drain, a report) another node of the same job: a multi-node job's batch step names the node
its evidence points at.

Four operations:

- `metrics`: per-job checkpoint figures folded into the node's textfile. Only the names in
  `JOB_METRICS`, each with the one label `job` that root sets itself from the judged job id.
- `drain`: this node out, for a rule in `JOB_DRAIN_RULES` (a hang or a straggler the wrapper
  saw), with a cleaned detail and, for a hang, the `pid` of the rank it found stopped; root
  drains only on what it sees itself (that pid a process of the job here, stopped or a zombie,
  or this node's GPU check failing: actions/job_channel.py), then through the breaker and the
  journal. A multi-node job asks the named node's root through its agent there.
- `count`: a hang whose evidence named this node (the `pid` of the job's rank there) but that
  root would not drain on what it saw itself, counted against this node for lemon tracking
  (policy/lemon.py); once per job, once per user and node a day; a blameless hang is never
  counted.
- `report`: the same rule and detail, written to root's decision log only (a straggler the
  job's owner chose to report, not drain); at most `MAX_REPORTS_PER_JOB` per job on a node.
- `ping`: nothing; the answer says the channel serves (`doctor`, `status`).

Pure: the socket, Slurm and the actions are the runtime's (actions/job_channel.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..core import reasons
from ..slurm.model import JobOwner

MAX_REQUEST_BYTES = 16 * 1024
# An attempt's seconds by part (core/goodput.attempt_parts), summed per node: the goodput panel's
# progress / all. Asked as "slurmagent_job_seconds_total/<part>"; root sets the `part` label.
JOB_PARTS = ("progress", "startup", "restore", "recompute", "hang_detection", "flush")
# name -> "set" (a gauge) or "add" (a counter); the wrapper's own figures, nothing else
JOB_METRICS = {
    "slurmagent_checkpoint_lag_seconds": "set",
    "slurmagent_checkpoint_age_seconds": "set",
    "slurmagent_flush_seconds": "set",
    "slurmagent_bytes_synced_total": "add",
    "slurmagent_checkpoint_sync_errors_total": "add",
    "slurmagent_requeues_total": "add",
    "slurmagent_hangs_total": "add",
    **{f"slurmagent_job_seconds_total/{part}": "add" for part in JOB_PARTS},
}
# Node totals root counts from what it sees itself (a hang drain or count it granted), never
# from a job's word: still accepted from a wrapper of an earlier version, and dropped.
ROOT_COUNTED = ("slurmagent_hangs_total",)
PER_JOB = ("slurmagent_checkpoint_lag_seconds", "slurmagent_checkpoint_age_seconds")  # labelled {job_id}; the others are node totals
JOB_DRAIN_RULES = ("hang", "straggler")
OPS = ("metrics", "drain", "report", "count", "ping")  # ping: is the channel serving (doctor, status)
ANY_NODE_OPS = ("drain", "report")  # may name another node of the job (the batch step's evidence)
MAX_REPORTS_PER_JOB = 16
MAX_VALUE = 1e15  # a value past this is a lie or a bug: refused, never written
MAX_DEPTH = 3  # {"add": {"name": 1}} is 2 deep; deeper is refused before json.loads (a RecursionError there)
# What one request may add: no job's wrapper does more in one ask (one requeue, one hang, one failed
# round per request; an attempt's bytes and seconds, sent once at its end, within a year and a PB).
# A larger delta is a lie or a bug: refused. The wrapper clamps its own figures to these
# (actions/job_channel.ChannelMetrics), so a figure past them never costs the rest of its request.
MAX_ADD = {
    "slurmagent_requeues_total": 1,
    "slurmagent_hangs_total": 1,
    "slurmagent_checkpoint_sync_errors_total": 1,
    "slurmagent_bytes_synced_total": 1e15,
    **{f"slurmagent_job_seconds_total/{part}": 366 * 86400 for part in JOB_PARTS},
}
MAX_SET = 366 * 86400  # a lag, an age (a restored checkpoint may be old), a flush: a year at most
MAX_PID = 4194304  # the kernel's pid_max ceiling (PID_MAX_LIMIT)
_JOB_ID = re.compile(r"^[0-9]{1,12}(_[0-9]{1,9})?$")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class RequestError(ValueError):
    """The request is malformed: refused with this one line."""


@dataclass(frozen=True)
class JobRequest:
    op: str  # "metrics" | "drain" | "report" | "count"
    job: str
    node: str
    set_: dict[str, float] = field(default_factory=dict)
    add: dict[str, float] = field(default_factory=dict)
    rule: str = ""
    detail: str = ""
    clear: bool = False  # metrics: the job's own per-job series go (the job ends)
    rid: str = ""  # the asker's id of this request: a retry of it gets the first answer
    pid: int = 0  # drain: the rank's process on this node the asker found stopped (root looks itself)


def job_series(names, job: str) -> tuple[str, ...]:
    """The prefixes of job `job`'s series of these metrics, to clear when it ends (`{job=` too:
    the label's name up to 0.1.0, left in an upgraded node's metrics.json)."""
    return tuple(f'{name}{{{label}="{job}"}}' for name in names for label in ("job_id", "job"))


def nesting(raw: bytes) -> int:
    """How deep `[`/`{` nest in ``raw`` outside JSON strings (a linear scan, no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def parse_request(raw: bytes) -> JobRequest:
    """The request, or :class:`RequestError` (never another exception: anything may arrive)."""
    if len(raw) > MAX_REQUEST_BYTES:
        raise RequestError(f"request over {MAX_REQUEST_BYTES} bytes")
    if nesting(raw) > MAX_DEPTH:
        raise RequestError(f"request nested deeper than {MAX_DEPTH}")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise RequestError("request is not one JSON object") from None
    if not isinstance(doc, dict):
        raise RequestError("request is not one JSON object")
    op, job, node = doc.get("op"), doc.get("job"), doc.get("node")
    if op not in OPS:
        raise RequestError(f"unknown op {str(op)[:20]!r} ({', '.join(OPS)})")
    if op == "ping":  # asks nothing of a job: no id, no node
        return JobRequest("ping", "", "")
    rid = doc.get("id", "")
    if not isinstance(rid, str) or rid and not _REQUEST_ID.match(rid):
        raise RequestError("id must be up to 64 letters, digits, - or _")
    if not isinstance(job, str) or not _JOB_ID.match(job):
        raise RequestError("job must be a Slurm job id")
    if not isinstance(node, str) or not 0 < len(node) <= 255:  # judged against this node's own name
        raise RequestError("node must be a node name")
    if op == "metrics":
        return JobRequest(op, job, node, set_=_values(doc.get("set"), "set"), add=_values(doc.get("add"), "add"),
                          clear=doc.get("clear") is True, rid=rid)
    rule, detail = doc.get("rule"), doc.get("detail", "")
    rules = ("hang",) if op == "count" else JOB_DRAIN_RULES
    if rule not in rules:
        raise RequestError(f"{op} rule must be one of {', '.join(rules)}")
    if not isinstance(detail, str):
        raise RequestError("detail must be text")
    pid = doc.get("pid", 0) if op in ("drain", "count") else 0
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid <= MAX_PID:
        raise RequestError(f"pid must be a process id (0..{MAX_PID})")
    return JobRequest(op, job, node, rule=rule, detail=reasons.clean_reason(detail)[:150], rid=rid, pid=pid)


def job_of(raw: bytes) -> str:
    """The job a request names ("" when it is malformed): whose budget it spends, never trusted."""
    try:
        return parse_request(raw).job
    except RequestError:
        return ""


def _values(doc: Any, kind: str) -> dict[str, float]:
    if doc is None:
        return {}
    if not isinstance(doc, dict) or len(doc) > len(JOB_METRICS):
        raise RequestError(f"{kind} must be an object of metric names")
    out = {}
    for name, value in doc.items():
        if JOB_METRICS.get(name) != kind:
            raise RequestError(f"{str(name)[:60]!r} is not a job metric one may {kind}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not 0 <= value <= MAX_VALUE:
            raise RequestError(f"{name}: value must be a number in [0, {MAX_VALUE:g}]")
        most = MAX_ADD[name] if kind == "add" else MAX_SET
        if value > most:
            raise RequestError(f"{name}: {value:g} is more than one request may {kind} ({most:g})")
        out[name] = float(value)
    return out


def judge(req: JobRequest, peer_uid: int, owner: JobOwner | None, this_node: str) -> str:
    """Why root refuses the request ("" = granted)."""
    if req.node != this_node and req.op not in ANY_NODE_OPS:
        return f"node {req.node} is not this node ({this_node})"
    if owner is None:
        return f"job {req.job} is not known to Slurm"
    if peer_uid != 0 and owner.uid != peer_uid:
        return f"job {req.job} does not belong to uid {peer_uid}"
    if owner.state != "RUNNING":
        return f"job {req.job} is {owner.state or 'not running'}, not RUNNING"
    if this_node not in owner.nodes:
        return f"job {req.job} does not run on {this_node}"
    if req.node not in owner.nodes:
        return f"node {req.node} is not one of job {req.job}'s"
    return ""


def metric_update(req: JobRequest) -> tuple[dict, dict, tuple[str, ...] | None]:
    """(set_, add, replace_prefix) for `Metrics.update`: per-job gauges labelled with the judged
    job id; `clear` removes that job's per-job series (no other job's)."""
    def key(name: str) -> tuple:
        if "/" in name:  # a fixed label value, checked against JOB_METRICS in parsing
            base, part = name.split("/", 1)
            return (base, (("part", part),))
        return (name, (("job_id", req.job),)) if name in PER_JOB else (name, ())

    clear = job_series(PER_JOB, req.job) if req.clear else None
    add = {key(n): v for n, v in req.add.items() if n not in ROOT_COUNTED}
    return {key(n): v for n, v in req.set_.items()}, add, clear


def drain_reason(req: JobRequest) -> str:
    return reasons.make_reason(req.rule, f"job {req.job}: {req.detail}" if req.detail else f"job {req.job}")

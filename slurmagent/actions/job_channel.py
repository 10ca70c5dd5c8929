"""The wrapper -> root channel: `watch` (root) serves its node's wrapped jobs, which ask.

The wrapper runs as the job's user, so the node's metrics and drains are root's: it asks
(`ask_root`, `ChannelMetrics`: best effort, a short deadline; no answer costs the job only
the figure, said once on stderr) and `ChannelServer` judges and acts.

A Unix stream socket (`[watch] channel_socket`, mode 0666 in a root-owned 0755 directory:
any local process may connect, none may replace it). One JSON request per connection, one
JSON answer (`{"ok": bool, "why": str}`). The caller's uid comes from the kernel
(SO_PEERCRED); the job's owner, state and nodes from Slurm (squeue, numeric fields only),
cached for `OWNER_TTL_S`; the request's own words are judged, never believed
(policy/job_requests.py). Granted metrics go into the node's textfile; a granted drain goes
through the journal and the breaker like any other fault drain, at most once per job on a
node; a hang counted against every node of a job goes into this node's repair state (the
lemon count's other input, `state/repair_state.record_hangs`). Every request is answered within `CONNECTION_TIMEOUT_S`; one connection at a time, so a
flood of them delays answers and costs root nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .executor import JournalExecutor
from ..errors import SlurmagentError
from ..policy import job_requests
from ..slurm.commands import Slurm
from ..slurm.model import JobOwner
from ..state import metrics
from ..state.config import Config
from ..state.decisionlog import DecisionLog
from ..state.repair_state import record_hangs

CONNECTION_TIMEOUT_S = 2.0
OWNER_TTL_S = 30.0
BACKLOG = 16


def peer_uid(conn: socket.socket) -> int:
    """The connecting process's uid as the kernel saw it at connect()."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


class ChannelServer:
    def __init__(self, cfg: Config, node: str, slurm: Slurm, log: DecisionLog, *,
                 clock: Callable[[], float] = time.monotonic, say: Callable[[str], None] = print):
        self.cfg = cfg
        self.node = node
        self.slurm = slurm
        self.log = log
        self.clock = clock
        self.say = say
        self.path = Path(cfg.node_path(cfg.watch.channel_socket, node))
        self.owners: dict[str, tuple[float, JobOwner | None]] = {}
        self.drained_for: set[str] = set()  # jobs that already had their one drain from this node
        self.counted_for: set[str] = set()  # jobs whose hang was counted against their nodes
        self.reports: dict[str, int] = {}  # job -> reports written to the decision log from it
        self.counts: dict[str, int] = {"granted": 0, "refused": 0, "malformed": 0, "failed": 0}
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Bind and serve in a daemon thread. The directory is made root-owned 0755; a stale
        socket of an earlier run is replaced."""
        self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        if self.path.parent.stat().st_uid == os.geteuid():
            os.chmod(self.path.parent, 0o755)  # whatever the umask (the watch unit's is 0027): jobs must get in
        with contextlib.suppress(FileNotFoundError):
            if self.path.is_socket():
                self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.bind(str(self.path))
        os.chmod(self.path, 0o666)  # any job's user may ask; the uid is the kernel's to tell
        sock.listen(BACKLOG)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="job-channel", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
        if self._thread is not None:
            self._thread.join(CONNECTION_TIMEOUT_S + 1)

    def _serve(self) -> None:
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed by stop()
            with conn:
                conn.settimeout(CONNECTION_TIMEOUT_S)
                try:
                    answer = self.handle(peer_uid(conn), _read_request(conn))
                    conn.sendall(json.dumps(answer).encode() + b"\n")
                except OSError:
                    self.counts["failed"] += 1  # the caller went away or stalled: its loss only

    # --- one request -------------------------------------------------------------------

    def handle(self, uid: int, raw: bytes) -> dict[str, Any]:
        try:
            req = job_requests.parse_request(raw)
        except job_requests.RequestError as exc:
            self.counts["malformed"] += 1
            return {"ok": False, "why": str(exc)}
        try:
            owner = self._owner(req.job)
        except SlurmagentError as exc:
            self.counts["failed"] += 1
            return {"ok": False, "why": f"cannot read job {req.job} from Slurm: {exc}"}
        why = job_requests.judge(req, uid, owner, self.node)
        if not why and req.op == "drain" and req.job in self.drained_for:
            why = f"job {req.job} already asked for a drain from {self.node}"
        if not why and req.op == "count" and req.job in self.counted_for:
            why = f"job {req.job} already counted a hang from {self.node}"
        if not why and req.op == "report" and self.reports.get(req.job, 0) >= job_requests.MAX_REPORTS_PER_JOB:
            why = f"job {req.job} already sent {job_requests.MAX_REPORTS_PER_JOB} reports to {self.node}"
        if why:
            self.counts["refused"] += 1
            self.log.write("job-request", node=self.node, job=req.job, uid=uid, op=req.op, verdict="refused", why=why)
            return {"ok": False, "why": why}
        self.counts["granted"] += 1
        if req.rule == "straggler" and req.op in ("report", "drain"):  # labelled by the straggler's node
            metrics.for_node(self.cfg, self.node).update(add={("slurmagent_stragglers_total", (("node", req.node),)): 1})
        if req.op == "metrics":
            set_, add, clear = job_requests.metric_update(req)
            metrics.for_node(self.cfg, self.node).update(set_=set_, add=add, replace_prefix=clear)
            return {"ok": True, "why": ""}
        if req.op == "report":  # the decision log only: what a job saw, said where root's decisions are
            self.reports[req.job] = self.reports.get(req.job, 0) + 1
            self.log.write("job-request", node=self.node, job=req.job, uid=uid, op="report", verdict="granted",
                           rule=req.rule, about=req.node, detail=req.detail)  # about: the node it names
            return {"ok": True, "why": "reported"}
        if req.op == "count":  # a hang that names no node: every node of the job, as Slurm lists them
            self.counted_for.add(req.job)
            nodes = sorted(owner.nodes)
            record_hangs(self.cfg.state_path(self.node), nodes, time.time())
            self.log.write("job-request", node=self.node, job=req.job, uid=uid, op="count", verdict="granted",
                           rule=req.rule, detail=req.detail, nodes=nodes)
            return {"ok": True, "why": f"counted against {', '.join(nodes)}"}
        self.drained_for.add(req.job)
        reason = job_requests.drain_reason(req)
        outcome = JournalExecutor(self.cfg, self.slurm, self.node).drain_fault(
            reason, node=req.node, source=f"job {req.job} ({req.rule})", job=req.job)
        self.log.write("job-request", node=self.node, job=req.job, uid=uid, op="drain", verdict="granted",
                       reason=reason, action=outcome.action, drained=req.node)
        self.say(f"job {req.job} (uid {uid}) asked to drain {req.node} ({req.rule}): {outcome.action}")
        return {"ok": True, "why": outcome.action}

    def _owner(self, job: str) -> JobOwner | None:
        now = self.clock()
        cached = self.owners.get(job)
        if cached is not None and now - cached[0] < OWNER_TTL_S:
            return cached[1]
        owner = self.slurm.job_owner(job)
        if len(self.owners) > 256:
            self.owners.clear()
        self.owners[job] = (now, owner)
        return owner


def _read_request(conn: socket.socket) -> bytes:
    """Up to one line or MAX_REQUEST_BYTES + 1 (then refused as too long), within the timeout."""
    data = b""
    deadline = time.monotonic() + CONNECTION_TIMEOUT_S
    while b"\n" not in data and len(data) <= job_requests.MAX_REQUEST_BYTES:
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0] if b"\n" in data else data


# --- the wrapper's side (the job's user) ------------------------------------------------------

ASK_TIMEOUT_S = 2.0


def ask_root(path: str | Path, request: dict[str, Any], timeout_s: float = ASK_TIMEOUT_S) -> dict[str, Any]:
    """One request, one answer. Raises OSError (no socket, refused, timeout) or ValueError."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout_s)
        s.connect(str(path))
        s.sendall(json.dumps(request, separators=(",", ":")).encode() + b"\n")
        data = b""
        while b"\n" not in data and len(data) < 65536:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    answer = json.loads(data.split(b"\n", 1)[0] or b"null")
    if not isinstance(answer, dict):
        raise ValueError("no answer")
    return answer


class ChannelMetrics:
    """A MetricsSink (run/supervisor.py) that asks root to write the job's figures."""

    def __init__(self, path: str | Path, job: str, node: str, say: Callable[[str], None]):
        self.path, self.job, self.node, self.say = Path(path), job, node, say
        self._said = False

    def update(self, set_: dict | None = None, add: dict | None = None, replace_prefix: str | tuple[str, ...] | None = None) -> None:
        """Keys are (name, labels) as for state.metrics.Metrics; root sets the `job` label itself."""
        def wire(name: str, labels: tuple) -> str:  # a `part` label travels in the name (job_requests.JOB_PARTS)
            part = dict(labels).get("part")
            return f"{name}/{part}" if part else name

        request = {"op": "metrics", "job": self.job, "node": self.node,
                   "set": {wire(*k): v for k, v in (set_ or {}).items()},
                   "add": {wire(*k): v for k, v in (add or {}).items()}}
        if replace_prefix:  # the supervisor removes the job's own lag series as it ends
            request["clear"] = True
        try:
            answer = ask_root(self.path, request)
        except (OSError, ValueError) as exc:
            answer = {"ok": False, "why": f"no answer from {self.path} ({exc})"}
        if not answer.get("ok") and not self._said:
            self._said = True
            self.say(f"the node's metrics did not take this job's figures: {answer.get('why')}")

"""The wrapper -> root channel: `watch` (root) serves its node's wrapped jobs, which ask.

The wrapper runs as the job's user, so the node's metrics and drains are root's: it asks
(`ask_root`, `ChannelMetrics`: best effort, retried within a short deadline; no answer costs the
job only the figure, said once on stderr) and `ChannelServer` judges and acts.

A Unix stream socket (`[watch] channel_socket`, mode 0666 in a root-owned 0755 directory:
any local process may connect, none may replace it). One JSON request per connection, one
JSON answer (`{"ok": bool, "why": str}`). The caller's uid comes from the kernel
(SO_PEERCRED); the job's owner, state and nodes from Slurm (squeue, numeric fields only),
read afresh for every drain, count and report, cached `OWNER_TTL_S` for metrics only; the
request's own words are judged, never believed (policy/job_requests.py). Granted metrics go
into the node's textfile; a drain is made only on root's own evidence (actions/root_evidence.py:
the named rank stopped or a zombie in /proc, or this node's GPU check failing), then through the
journal and the breaker like any other fault drain, at most once per job on a node; a hang
counted against every node of a job (an attempt that ran `[watch] hang_count_min_run_s`) goes
into this node's repair state (the lemon count's other input, `state/repair_state.record_hangs`).
Root counts `slurmagent_hangs_total` itself, from the drains and counts it grants.

Any local user may connect, so the server holds against all of them: one selector thread reads
every open connection side by side (an idle one costs a slot, dropped after
`CONNECTION_TIMEOUT_S`; at most `MAX_CONNECTIONS`, `MAX_PER_UID` of one uid), `WORKERS`
threads judge and answer whole requests (the shared state under one lock; waiting requests
bounded in all, per uid and per (uid, job): each job has its own budget), any exception in a
request is caught, counted and answered, and a refusal is logged once per uid and minute with
its count (`RefusalLog`), so no flood grows root's log. If the serving thread itself dies,
`alive()` says so and `watch` exits non-zero for systemd to restart it.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from .executor import JournalExecutor
from .root_evidence import count_evidence, drain_evidence, node_gpu_fault
from ..errors import SlurmagentError
from ..policy import job_requests
from ..slurm.commands import Slurm
from ..slurm.model import JobOwner
from ..state import metrics
from ..state.config import Config
from ..state.decisionlog import DecisionLog
from ..state.repair_state import record_hangs

CONNECTION_TIMEOUT_S = 2.0  # a connection's whole request must arrive within this
OWNER_TTL_S = 30.0  # metrics only: a drain, a count, a report read Slurm afresh
BACKLOG = 128
MAX_CONNECTIONS = 256  # open at once; past it a new one is closed at once
MAX_PER_UID = 64  # open at once from one uid (root's own wrappers included)
WORKERS = 4  # requests judged side by side (each may read Slurm)
MAX_QUEUED = 64  # whole requests waiting for a worker; past it: "busy", answered at once
MAX_QUEUED_PER_UID = 32  # of them from one uid: one user (whatever job ids it names) takes at most half
MAX_QUEUED_PER_JOB = 2  # of them for one (uid, job): each job its own budget, below WORKERS: one job never takes all
ACCEPTS_PER_PASS = 64  # new connections taken per selector pass: reads are never starved by a connect flood
UNKNOWN_TTL_S = 5.0  # "Slurm does not know this job": reused this long (a flood of made-up ids costs no squeue)
REFUSAL_WINDOW_S = 60.0
ANSWERS_KEPT, ANSWER_TTL_S = 4096, 600.0  # answers by (uid, request id), for retries whose answer was lost
BUSY = json.dumps({"ok": False, "why": "busy: too many requests at once, ask again"}).encode()
RAN_HERE_S = 600.0  # a job seen RUNNING here may still send its end-of-attempt figures this long
# What a job no longer RUNNING may still send: its attempt's end (requeue count, flush, seconds by
# part, a hang) and the removal of its own series; never a lag or an age, never a drain.
END_OF_ATTEMPT = {"slurmagent_requeues_total", "slurmagent_flush_seconds", "slurmagent_hangs_total",
                  *(f"slurmagent_job_seconds_total/{part}" for part in job_requests.JOB_PARTS)}


def peer_uid(conn: socket.socket) -> int:
    """The connecting process's uid as the kernel saw it at connect()."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


class RefusalLog:
    """Refusals to the decision log without a flood: a uid's first refusal in a window is written
    at once, the rest of that window as one summary line (count, ops, the last reason) when the
    window ends. So a uid costs root at most two lines a minute, whatever it sends."""

    def __init__(self, log: DecisionLog, node: str, window_s: float = REFUSAL_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        self.log, self.node, self.window_s, self.clock = log, node, window_s, clock
        self.windows: dict[int, dict[str, Any]] = {}  # uid -> {"start", "count", "ops", "why", "job"}
        self.lock = threading.Lock()  # its own: the selector thread flushes without waiting on a drain

    def refused(self, uid: int, job: str, op: str, why: str) -> None:
        with self.lock:
            self._refused(uid, job, op, why)

    def _refused(self, uid: int, job: str, op: str, why: str) -> None:
        now = self.clock()
        w = self.windows.get(uid)
        if w is None:
            self.windows[uid] = {"start": now, "count": 0, "ops": {}, "why": "", "job": ""}
            self.log.write("job-request", node=self.node, job=job, uid=uid, op=op, verdict="refused", why=why)
            return
        w["count"] += 1
        w["ops"][op] = w["ops"].get(op, 0) + 1
        w["why"], w["job"] = why, job

    def flush(self, everything: bool = False) -> None:
        """Write the summary of every window that ended (all of them at a stop)."""
        now = self.clock()
        for uid, w in list(self.windows.items()):
            if not everything and now - w["start"] < self.window_s:
                continue
            del self.windows[uid]
            if w["count"]:
                self.log.write("job-request", node=self.node, uid=uid, verdict="refused", count=w["count"],
                               ops=w["ops"], job=w["job"], why=w["why"], window_s=round(now - w["start"], 1))


class _Conn:
    __slots__ = ("sock", "uid", "deadline", "data")

    def __init__(self, sock: socket.socket, uid: int, deadline: float):
        self.sock, self.uid, self.deadline, self.data = sock, uid, deadline, b""


class ChannelServer:
    def __init__(self, cfg: Config, node: str, slurm: Slurm, log: DecisionLog, *,
                 clock: Callable[[], float] = time.monotonic, say: Callable[[str], None] = print,
                 proc: str = "/proc", gpu_fault: Callable[[], str] = node_gpu_fault):
        self.cfg, self.proc, self.gpu_fault = cfg, proc, gpu_fault  # root's own look (actions/root_evidence.py)
        self.node = node
        self.slurm = slurm
        self.log = log
        self.clock = clock
        self.say = say
        self.path = Path(cfg.node_path(cfg.watch.channel_socket, node))
        self.owners: dict[str, tuple[float, JobOwner | None]] = {}
        self.ran_here: dict[str, tuple[float, int]] = {}  # job -> (when root last saw it RUNNING here, its uid)
        self.drained_for: set[str] = set()  # jobs that already had their one drain from this node
        self.counted_for: set[str] = set()  # jobs whose hang was counted against their nodes
        self.reports: dict[str, int] = {}  # job -> reports written to the decision log from it
        self.counts: dict[str, int] = {"granted": 0, "refused": 0, "malformed": 0, "failed": 0, "errors": 0,
                                       "idle": 0, "shed": 0, "busy": 0}
        self.refusals = RefusalLog(log, node, clock=clock)
        self.answered: dict[tuple[int, str], tuple[float, dict[str, Any]]] = {}  # (uid, request id) -> answer
        self.lock = threading.Lock()  # the state above, the metrics textfile, the decision log
        self.failure = ""  # why the serving thread ended, when it did not end by stop()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._pool: ThreadPoolExecutor | None = None
        self._queued: dict[Any, int] = {}  # uid, and (uid, job) -> its requests waiting for or in a worker
        self._queue_lock = threading.Lock()
        self._inflight: dict[tuple[int, str], threading.Event] = {}  # (uid, request id) being judged now

    def _count(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1

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
        sock.setblocking(False)
        self._sock = sock
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="job-channel-request")
        self._thread = threading.Thread(target=self._serve_supervised, name="job-channel", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """Serving: the thread runs (False once it died of anything but stop())."""
        return self._thread is not None and self._thread.is_alive() and not self.failure

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(CONNECTION_TIMEOUT_S + 1)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        with self.refusals.lock:
            self.refusals.flush(everything=True)
        with contextlib.suppress(OSError):
            self.path.unlink()

    def _serve_supervised(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - said and seen by alive(); watch exits for a restart
            self.failure = f"{type(exc).__name__}: {exc}"
            self.say(f"the channel for wrapped jobs at {self.path} stopped serving: {self.failure}")
        finally:
            sock, self._sock = self._sock, None
            if sock is not None:
                sock.close()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        open_conns: dict[int, _Conn] = {}
        last_flush = self.clock()
        try:
            while not self._stopping.is_set():
                for key, _ in sel.select(timeout=0.1):
                    if key.data is None:
                        self._accept(sel, open_conns)
                    else:
                        self._read(sel, open_conns, key.data)
                now = self.clock()
                for c in [c for c in open_conns.values() if now > c.deadline]:  # idle or too slow: dropped
                    self._count("idle")
                    self._drop(sel, open_conns, c)
                if now - last_flush >= 1.0:
                    last_flush = now
                    with self.refusals.lock:
                        self.refusals.flush()
        finally:
            for c in list(open_conns.values()):
                self._drop(sel, open_conns, c)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, open_conns: dict[int, _Conn]) -> None:
        for _ in range(ACCEPTS_PER_PASS):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (23, 24):  # ENFILE, EMFILE: shed until descriptors come back
                    self._count("shed")
                    return
                raise
            try:
                uid = peer_uid(conn)
            except OSError:
                conn.close()
                continue
            if len(open_conns) >= MAX_CONNECTIONS or sum(c.uid == uid for c in open_conns.values()) >= MAX_PER_UID:
                self._count("shed")
                with contextlib.suppress(OSError):  # the asker tries again with backoff (ask_root)
                    conn.setblocking(False)
                    conn.send(BUSY + b"\n")
                conn.close()
                continue
            conn.setblocking(False)
            c = _Conn(conn, uid, self.clock() + CONNECTION_TIMEOUT_S)
            open_conns[conn.fileno()] = c
            sel.register(conn, selectors.EVENT_READ, c)

    def _read(self, sel: selectors.BaseSelector, open_conns: dict[int, _Conn], c: _Conn) -> None:
        try:
            chunk = c.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._count("failed")
            self._drop(sel, open_conns, c)
            return
        if not chunk and not c.data:  # connected and hung up without a word: nothing to answer or log
            self._count("idle")
            self._drop(sel, open_conns, c)
            return
        c.data += chunk
        if chunk and b"\n" not in c.data and len(c.data) <= job_requests.MAX_REQUEST_BYTES:
            return  # more to come
        sel.unregister(c.sock)
        open_conns.pop(c.sock.fileno(), None)
        raw = c.data.split(b"\n", 1)[0]
        keys = (c.uid, (c.uid, job_requests.job_of(raw)))  # the job as the request names it: a budget, not trust
        with self._queue_lock:
            busy = self._queued.get("all", 0) >= MAX_QUEUED or self._queued.get(keys[0], 0) >= MAX_QUEUED_PER_UID \
                or self._queued.get(keys[1], 0) >= MAX_QUEUED_PER_JOB
            if not busy:
                for key in ("all", *keys):
                    self._queued[key] = self._queued.get(key, 0) + 1
        if busy:
            self._count("busy")
            self._answer(c, json.loads(BUSY))
            return
        self._pool.submit(self._work, c, raw, keys)

    def _drop(self, sel: selectors.BaseSelector, open_conns: dict[int, _Conn], c: _Conn) -> None:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(c.sock)
        open_conns.pop(c.sock.fileno(), None)
        c.sock.close()

    def _work(self, c: _Conn, raw: bytes, keys: tuple) -> None:
        try:
            self._answer(c, self.handle(c.uid, raw))
        finally:
            with self._queue_lock:
                for key in ("all", *keys):
                    self._queued[key] -= 1
                    if not self._queued[key]:
                        del self._queued[key]

    def _answer(self, c: _Conn, answer: dict[str, Any]) -> None:
        try:
            c.sock.setblocking(True)
            c.sock.settimeout(CONNECTION_TIMEOUT_S)
            c.sock.sendall(json.dumps(answer).encode() + b"\n")
        except OSError:
            self._count("failed")  # the caller went away or stalled: its loss only
        finally:
            c.sock.close()

    # --- one request -------------------------------------------------------------------

    def handle(self, uid: int, raw: bytes) -> dict[str, Any]:
        """Judge and act on one request; never raises (a bug is counted and answered, not fatal)."""
        try:
            return self._handle(uid, raw)
        except Exception as exc:  # noqa: BLE001 - no request may end the channel
            with self.lock:
                self.counts["errors"] += 1
            return {"ok": False, "why": f"root could not handle the request ({type(exc).__name__}); it was not taken"}

    def _handle(self, uid: int, raw: bytes) -> dict[str, Any]:
        try:
            req = job_requests.parse_request(raw)
        except job_requests.RequestError as exc:
            self._count("malformed")
            self.refusals.refused(uid, "", "malformed", str(exc))
            return {"ok": False, "why": str(exc)}
        if req.op == "ping":
            with self.lock:
                return {"ok": True, "why": "serving: " + ", ".join(f"{v} {k}" for k, v in self.counts.items() if v)}
        if not req.rid:
            return self._decide(uid, req)
        key = (uid, req.rid)
        with self.lock:  # one judgement per (uid, id): a retry gets the first's answer once there is one
            if key in self.answered:
                return self.answered[key][1]
            if key in self._inflight:  # still being judged: "busy" at once (no worker parked), asked again
                return json.loads(BUSY)
            self._inflight[key] = threading.Event()
        try:
            answer = self._decide(uid, req)
            with self.lock:
                now = self.clock()
                if len(self.answered) >= ANSWERS_KEPT:
                    self.answered = {k: v for k, v in self.answered.items() if now - v[0] < ANSWER_TTL_S}
                    while len(self.answered) >= ANSWERS_KEPT:
                        self.answered.pop(next(iter(self.answered)))
                self.answered[key] = (now, answer)
            return answer
        finally:
            with self.lock:
                self._inflight.pop(key).set()

    def _decide(self, uid: int, req: job_requests.JobRequest) -> dict[str, Any]:
        try:
            owner = self._owner(req.job, fresh=req.op != "metrics")
        except SlurmagentError as exc:
            self._count("failed")
            return {"ok": False, "why": f"cannot read job {req.job} from Slurm: {exc}"}
        with self.lock:
            answer, drain = self._judged(uid, req, owner)
        if drain is None:
            return answer
        # root's own evidence, then the drain itself, outside the lock: a GPU check, the journal and
        # scontrol may take seconds. The job's one drain ask from this node is spent either way.
        seen, evidence = drain_evidence(req, owner, self.node, self.cfg, proc=self.proc, gpu_fault=self.gpu_fault)
        if not seen:
            with self.lock:
                self.counts["refused"] += 1
                self.counts["granted"] -= 1
                self.refusals.refused(uid, req.job, req.op, evidence)
            return {"ok": False, "why": evidence}
        reason = job_requests.drain_reason(req)
        outcome = JournalExecutor(self.cfg, self.slurm, self.node).drain_fault(
            reason, node=req.node, source=f"job {req.job} ({req.rule})", job=req.job)
        self.log.write("job-request", node=self.node, job=req.job, uid=uid, op="drain", verdict="granted",
                       reason=reason, action=outcome.action, drained=req.node, evidence=evidence)
        if req.rule == "hang":  # a node total from root's own observation (policy/job_requests.ROOT_COUNTED)
            with self.lock:
                metrics.for_node(self.cfg, self.node).update(add={("slurmagent_hangs_total", ()): 1})
        self.say(f"job {req.job} (uid {uid}) asked to drain {req.node} ({req.rule}): {outcome.action}")
        return {"ok": True, "why": outcome.action}

    def _judged(self, uid: int, req: job_requests.JobRequest, owner: JobOwner | None
                ) -> tuple[dict[str, Any], job_requests.JobRequest | None]:
        """(the answer, or the drain still to make); under the lock: the state is checked and marked here."""
        why = job_requests.judge(req, uid, owner, self.node)
        if not why:
            self.ran_here[req.job] = (self.clock(), owner.uid)
        elif req.op == "metrics" and self._ended_here(req, uid, owner):
            why = ""  # the attempt's end, from a job root saw running here moments ago
        if not why and req.op == "drain" and req.job in self.drained_for:
            why = f"job {req.job} already asked for a drain from {self.node}"
        if not why and req.op == "count" and req.job in self.counted_for:
            why = f"job {req.job} already counted a hang from {self.node}"
        least = self.cfg.watch.hang_count_min_run_s
        if not why and req.op == "count" and (owner.run_s is None or owner.run_s < least):
            ran = "an unknown time" if owner.run_s is None else f"{owner.run_s:.0f} s"
            why = f"job {req.job} has run {ran}, less than hang_count_min_run_s ({least:g} s): no hang counted"
        if not why and req.op == "count":
            why = count_evidence(req, owner, self.node, self.cfg.state_path(self.node), uid, self.proc)
        if not why and req.op == "report" and self.reports.get(req.job, 0) >= job_requests.MAX_REPORTS_PER_JOB:
            why = f"job {req.job} already sent {job_requests.MAX_REPORTS_PER_JOB} reports to {self.node}"
        if why:
            self.counts["refused"] += 1
            self.refusals.refused(uid, req.job, req.op, why)
            return {"ok": False, "why": why}, None
        self.counts["granted"] += 1
        if req.rule == "straggler" and req.op in ("report", "drain"):  # labelled by the straggler's node
            metrics.for_node(self.cfg, self.node).update(add={("slurmagent_stragglers_total", (("node", req.node),)): 1})
        if req.op == "metrics":
            set_, add, clear = job_requests.metric_update(req)
            metrics.for_node(self.cfg, self.node).update(set_=set_, add=add, replace_prefix=clear)
            return {"ok": True, "why": ""}, None
        if req.op == "report":  # the decision log only: what a job saw, said where root's decisions are
            self.reports[req.job] = self.reports.get(req.job, 0) + 1
            self.log.write("job-request", node=self.node, job=req.job, uid=uid, op="report", verdict="granted",
                           rule=req.rule, about=req.node, detail=req.detail)  # about: the node it names
            return {"ok": True, "why": "reported"}, None
        if req.op == "count":  # a hang whose evidence named this node, which root would not drain
            self.counted_for.add(req.job)
            nodes = [self.node]
            record_hangs(self.cfg.state_path(self.node), nodes, time.time(), uid=owner.uid,
                         why=f"job {req.job}: {req.detail}" if req.detail else f"job {req.job}")
            metrics.for_node(self.cfg, self.node).update(add={("slurmagent_hangs_total", ()): 1})
            self.log.write("job-request", node=self.node, job=req.job, uid=uid, op="count", verdict="granted",
                           rule=req.rule, detail=req.detail, nodes=nodes)
            return {"ok": True, "why": f"counted against {', '.join(nodes)}"}, None
        self.drained_for.add(req.job)  # marked now: a second ask is refused while this one drains
        return {}, req

    def _ended_here(self, req: job_requests.JobRequest, uid: int, owner: JobOwner | None) -> bool:
        """A job root saw RUNNING on this node within `RAN_HERE_S`, of this uid, no longer RUNNING
        (requeued, ending): its end-of-attempt figures and the removal of its own series only."""
        seen = self.ran_here.get(req.job)
        if seen is None or self.clock() - seen[0] > RAN_HERE_S or seen[1] != uid and uid != 0:
            return False
        if owner is not None and (owner.state == "RUNNING" or owner.uid != seen[1]):
            return False  # running elsewhere now, or no longer the same job: the judge's word stands
        if req.node != self.node:
            return False
        return set(req.set_) | set(req.add) <= END_OF_ATTEMPT

    def _owner(self, job: str, fresh: bool) -> JobOwner | None:
        now = self.clock()
        with self.lock:
            cached = self.owners.get(job)
        if cached is not None and (not fresh and now - cached[0] < OWNER_TTL_S
                                   or cached[1] is None and now - cached[0] < UNKNOWN_TTL_S):
            return cached[1]  # a job Slurm did not know moments ago cannot be one this uid runs here
        owner = self.slurm.job_owner(job)
        with self.lock:
            if len(self.owners) > 256:
                self.owners.clear()
            if len(self.ran_here) > 4096:
                self.ran_here = {j: v for j, v in self.ran_here.items() if now - v[0] <= RAN_HERE_S}
            self.owners[job] = (now, owner)
        return owner

"""The wrapper's side of the wrapper -> root channel (actions/job_channel.py serves it as root):
`ask_root` (one request, retried with backoff, an id so a retry is answered once), `ChannelMetrics`
(the job's figures, clamped to what root takes) and `probe` (doctor's and status's no-op)."""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from ..policy import job_requests
from ..state.config import Config


ASK_TIMEOUT_S = 2.0
ASK_DEADLINE_S = 5.0  # retries of a refused connection or a "busy" answer, within this
# A drain: root looks itself first, its GPU check included (`slurmagent check`, 20 s at most)
DRAIN_TIMEOUT_S, DRAIN_DEADLINE_S = 30.0, 45.0


def ask_root(path: str | Path, request: dict[str, Any], timeout_s: float = ASK_TIMEOUT_S,
             deadline_s: float = ASK_DEADLINE_S) -> dict[str, Any]:
    """One request, one answer. The request gets an id (unless it has one), so asking again is safe:
    a full backlog, a refused or reset connection, a lost answer or "busy" is asked again with
    backoff until `deadline_s`, and root answers a retry as it answered the first. Raises OSError
    (no socket, no answer in time) or ValueError."""
    if request.get("op") != "ping" and "id" not in request:
        request = {**request, "id": uuid.uuid4().hex}
    end, pause = time.monotonic() + deadline_s, 0.05
    while True:
        try:
            answer = _ask_once(path, request, timeout_s)
        except FileNotFoundError:
            raise  # no channel at all: asking again will not make one
        except OSError:
            if time.monotonic() + pause + timeout_s > end:
                raise
        else:
            if answer.get("ok") or not str(answer.get("why", "")).startswith("busy:") or time.monotonic() + pause > end:
                return answer
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def answer_line(answer: dict[str, Any]) -> str:
    """Root's answer as the wrapper says it: "granted: why" or "refused: why"."""
    return ("granted: " if answer.get("ok") else "refused: ") + str(answer.get("why") or "")[:200]


def _ask_once(path: str | Path, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
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


def probe(cfg: Config, node: str, timeout_s: float = ASK_TIMEOUT_S) -> tuple[str, str]:
    """Does this node's channel answer? ("off" | "absent" | "ok" | "silent", one line): `doctor`
    and `status` ask it a no-op, so a channel that stopped serving is seen, not guessed."""
    if not cfg.watch.channel_socket:
        return "off", "turned off ([watch] channel_socket is empty)"
    path = Path(cfg.node_path(cfg.watch.channel_socket, node))
    if not path.is_socket():
        return "absent", f"no channel at {path} (slurmagent-watch is not running on this node)"
    try:
        answer = ask_root(path, {"op": "ping"}, timeout_s=timeout_s, deadline_s=timeout_s)
    except (OSError, ValueError) as exc:
        return "silent", f"{path} does not answer ({type(exc).__name__}: {exc}); wrapped jobs get no drains or metrics"
    why = str(answer.get("why") or "")
    if not answer.get("ok") and why.startswith("busy:"):
        return "ok", f"{path} answers (busy now: {why[5:].strip()[:80]})"
    if not answer.get("ok") and why.startswith("unknown op"):
        return "ok", f"{path} answers (a watch older than this slurmagent: it knows no ping)"
    if not answer.get("ok"):
        return "silent", f"{path} answered but not to a ping ({why[:100]})"
    return "ok", f"{path} answers ({why or 'serving'})"


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

        request = {"op": "metrics", "job": self.job, "node": self.node,  # clamped: root refuses a request past them
                   "set": {wire(*k): min(v, job_requests.MAX_SET) for k, v in (set_ or {}).items()},
                   "add": {wire(*k): min(v, job_requests.MAX_ADD.get(wire(*k), v)) for k, v in (add or {}).items()}}
        if replace_prefix:  # the supervisor removes the job's own lag series as it ends
            request["clear"] = True
        try:
            answer = ask_root(self.path, request, deadline_s=ASK_TIMEOUT_S)  # a figure never holds a flush up
        except (OSError, ValueError) as exc:
            answer = {"ok": False, "why": f"no answer from {self.path} ({exc})"}
        if not answer.get("ok") and not self._said:
            self._said = True
            self.say(f"the node's metrics did not take this job's figures: {answer.get('why')}")

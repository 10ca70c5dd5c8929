"""The wrapper's side of the wrapper -> root channel (the `watch` service on its node).

The wrapper runs as the job's user, so the node's metrics and drains are root's: it asks
over `[watch] channel_socket` (actions/job_channel.py judges and acts). Best effort with a
short deadline: no answer (no `watch` running, an old release) costs the job nothing but
the figure; the first failure is said once on stderr.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, Callable

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

    def update(self, set_: dict | None = None, add: dict | None = None, replace_prefix: str | None = None) -> None:
        """Keys are (name, labels) as for state.metrics.Metrics; root sets the `job` label itself."""
        request = {"op": "metrics", "job": self.job, "node": self.node,
                   "set": {name: v for (name, _), v in (set_ or {}).items()},
                   "add": {name: v for (name, _), v in (add or {}).items()}}
        if replace_prefix:  # the supervisor removes the job's own lag series as it ends
            request["clear"] = True
        try:
            answer = ask_root(self.path, request)
        except (OSError, ValueError) as exc:
            answer = {"ok": False, "why": f"no answer from {self.path} ({exc})"}
        if not answer.get("ok") and not self._said:
            self._said = True
            self.say(f"the node's metrics did not take this job's figures: {answer.get('why')}")

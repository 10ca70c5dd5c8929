"""One JSON line per decision (node, job, rule, action, duration) to a file and syslog.

Cloud Logging's agent parses JSON lines; `status` and the tests read the same file.
A failure to log never fails a hook.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def warn(msg: str) -> None:
    """Loud: stderr and syslog/journald at warning level."""
    print(f"slurmagent: {msg}", file=sys.stderr)
    try:
        import syslog

        syslog.openlog("slurmagent", 0, syslog.LOG_DAEMON)
        syslog.syslog(syslog.LOG_WARNING, msg)
    except OSError:
        pass


def path_for(cfg: Any, node: str) -> Path:
    """Where a node's decisions go: `[hooks] log_file` (`%n` = node), else `<state_dir>/hooks.log`."""
    if cfg.hooks.log_file:
        return Path(cfg.node_path(cfg.hooks.log_file, node))
    return cfg.state_path(node) / "hooks.log"


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class DecisionLog:
    def __init__(self, path: Path | None, use_syslog: bool = True, tag: str = "slurmagent"):
        self.path = path
        self.use_syslog = use_syslog
        self.tag = tag
        self.started = time.monotonic()

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"time": utc_now(), "event": event, **{k: v for k, v in fields.items() if v is not None}}
        record.setdefault("duration_ms", round((time.monotonic() - self.started) * 1000, 1))
        line = json.dumps(record, sort_keys=False, default=str)
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o640)
                try:
                    os.write(fd, (line + "\n").encode())
                finally:
                    os.close(fd)
            except OSError as exc:
                print(f"slurmagent: cannot write decision log {self.path}: {exc.strerror}", file=sys.stderr)
        if self.use_syslog:
            try:
                import syslog

                level = syslog.LOG_WARNING if record.get("verdict") in ("unhealthy", "internal-error") else syslog.LOG_INFO
                syslog.openlog(self.tag, 0, syslog.LOG_DAEMON)
                syslog.syslog(level, line)
            except OSError:
                pass
        return record


def read_records(path: Path) -> list[dict[str, Any]]:
    records = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return records
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records

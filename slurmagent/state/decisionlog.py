"""One JSON line per decision (node, job, rule, action, duration) to a file and syslog.

Cloud Logging's agent parses JSON lines (every line has `severity` in its names and the
`version` that wrote it, so a half-upgraded cluster shows); `status` and the tests read the
same file. A failure to log never fails a hook.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from .build import version

# One line stays readable by `status`, Cloud Logging's agent and syslog: a node with thousands of
# XIDs once wrote an 8.9 MB line. Past the bound, long texts and lists are cut with a marker.
MAX_LINE_BYTES = 64 * 1024
MAX_TEXT_CHARS = 4096
LIST_BUDGET_BYTES = 16 * 1024
ESSENTIAL = ("time", "severity", "event", "node", "job", "verdict", "rule", "gpu", "reason", "action", "duration_ms", "version")
# Cloud Logging's LogSeverity names: what the Ops Agent maps `severity` to.
SEVERITIES = ("DEBUG", "INFO", "NOTICE", "WARNING", "ERROR", "CRITICAL", "ALERT", "EMERGENCY")
WARNING_VERDICTS = ("unhealthy", "expiry", "warning")


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


def severity_of(fields: dict[str, Any]) -> str:
    """A given `severity` wins; else ERROR for an internal error, WARNING for a drain, an expiry or
    a warning, INFO for the rest (a healthy check)."""
    given = str(fields.get("severity") or "").upper()
    if given in SEVERITIES:
        return given
    verdict = fields.get("verdict")
    if verdict == "internal-error" or fields.get("error"):
        return "ERROR"
    if verdict in WARNING_VERDICTS or fields.get("warnings"):
        return "WARNING"
    return "INFO"


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class DecisionLog:
    def __init__(self, path: Path | None, use_syslog: bool = True, tag: str = "slurmagent"):
        self.path = path
        self.use_syslog = use_syslog
        self.tag = tag
        self.started = time.monotonic()

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        given = {k: v for k, v in fields.items() if v is not None}
        severity = severity_of(given)
        record = {"time": utc_now(), "severity": severity, "event": event, **given}
        record["severity"] = severity  # normalised, where a caller gave one
        record.setdefault("duration_ms", round((time.monotonic() - self.started) * 1000, 1))
        record.setdefault("version", version())
        record, line = bounded(record)
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

                level = {"DEBUG": syslog.LOG_DEBUG, "INFO": syslog.LOG_INFO, "NOTICE": syslog.LOG_NOTICE,
                         "WARNING": syslog.LOG_WARNING}.get(record["severity"], syslog.LOG_ERR)
                syslog.openlog(self.tag, 0, syslog.LOG_DAEMON)
                syslog.syslog(level, line)
            except OSError:
                pass
        return record


def bounded(record: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(record, its JSON line) with the line at most MAX_LINE_BYTES: texts and lists cut with a
    marker (`truncated: true` on the record), and if that is not enough, the essential fields only."""
    line = _dumps(record)
    if len(line.encode()) <= MAX_LINE_BYTES:
        return record, line
    record = {**{k: _shrink(v) for k, v in record.items()}, "truncated": True}
    line = _dumps(record)
    if len(line.encode()) > MAX_LINE_BYTES:
        record = {**{k: _shrink(record[k]) for k in ESSENTIAL if k in record}, "truncated": True}
        line = _dumps(record)
    return record, line


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=False, default=str)


def _shrink(value: Any) -> Any:
    if isinstance(value, str):
        if len(value) <= MAX_TEXT_CHARS:
            return value
        return value[:MAX_TEXT_CHARS] + f"... {len(value) - MAX_TEXT_CHARS} more characters (truncated)"
    if isinstance(value, dict):
        kept, dropped = _fit(((str(k), _shrink(v)) for k, v in value.items()), len(value))
        return dict(kept, **({"...": f"{dropped} more (truncated)"} if dropped else {}))
    if isinstance(value, (list, tuple)):
        kept, dropped = _fit((_shrink(v) for v in value), len(value))
        return kept + ([f"... {dropped} more (truncated)"] if dropped else [])
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    return _shrink(str(value))


def _fit(items: Iterable[Any], total: int) -> tuple[list[Any], int]:
    """The first items whose JSON fits in LIST_BUDGET_BYTES, and how many were left out."""
    kept: list[Any] = []
    used = 0
    for item in items:
        used += len(_dumps(item).encode()) + 2
        if used > LIST_BUDGET_BYTES:
            break
        kept.append(item)
    return kept, total - len(kept)


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

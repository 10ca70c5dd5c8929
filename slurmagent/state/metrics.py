"""Prometheus textfile-collector output, shared by every slurmagent process on a node.

Values live in `<state_dir>/metrics.json` (updated under a lock, so short-lived hooks can
add to counters); after each update the `.prom` file is rewritten atomically for
node_exporter's textfile collector. A failure to write metrics never fails the caller, and is
never silent: a failed textfile write is counted (`slurmagent_metrics_write_failures_total`, in
the store, so it shows once a write works again) and said once on stderr and syslog (again only
when the failure changes, or after a write that worked). Every run of a component stamps
`slurmagent_last_run_timestamp_seconds{component}`, so the file is rewritten even when nothing
else changed: a heartbeat an alert can watch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from .build import version
from .decisionlog import warn
from .fsutil import atomic_write_text, read_state_file

HEARTBEAT = "slurmagent_last_run_timestamp_seconds"
WRITE_FAILURES = "slurmagent_metrics_write_failures_total"

HELP = {
    "slurmagent_build_info": ("gauge", "always 1; the version label is the slurmagent that last wrote these metrics"),
    "slurmagent_gpu_healthy": ("gauge", "1 when the GPU passed the last check, 0 when it has a drain finding"),
    "slurmagent_node_healthy": ("gauge", "1 when the node passed the last check"),
    "slurmagent_last_check_timestamp_seconds": ("gauge", "Unix time of the last health check"),
    HEARTBEAT: ("gauge", "Unix time of the last run of a slurmagent component (prolog, epilog, healthcheck, "
                "watch, expiry, repair), written every run even when nothing else changed"),
    WRITE_FAILURES: ("counter", "writes of this textfile that failed, by errno (EACCES, EROFS, ...); counted in "
                     "metrics.json and shown once a write works again"),
    "slurmagent_drains_total": ("counter", "nodes drained by slurmagent, by rule"),
    "slurmagent_requeues_total": ("counter", "jobs requeued by slurmagent"),
    "slurmagent_repairs_total": ("counter", "nodes whose repair was asked for, by action (recreate, report-faulty, "
                                 "power-down) and result (requested, refused, failed)"),
    "slurmagent_node_faults": ("gauge", "repairs asked for this node within [repair] lemon_window_s (written by the "
                               "node that runs `repair`)"),
    "slurmagent_lemon_nodes": ("gauge", "nodes repaired at least [repair] lemon_faults times within lemon_window_s"),
    "slurmagent_flush_seconds": ("gauge", "duration of the last checkpoint flush (signal to requeue)"),
    "slurmagent_bytes_synced_total": ("counter", "checkpoint bytes uploaded"),
    "slurmagent_checkpoint_lag_seconds": (
        "gauge", "how long the bucket has been behind a running job's checkpoint dir: age of the oldest "
        "checkpoint file change not yet committed (0: all committed)"),
    "slurmagent_checkpoint_age_seconds": (
        "gauge", "age of a running job's newest committed checkpoint (what a restore now gets): seconds since "
        "its commit; absent before the first"),
    "slurmagent_checkpoint_sync_errors_total": ("counter", "checkpoint syncs that failed (background and final)"),
    "slurmagent_termination_timestamp_seconds": (
        "gauge", "Unix time at which this VM will be stopped or deleted (flex-start/spot expiry, maintenance, "
        "preemption), by source; absent when none is known"),
    "slurmagent_expiry_read_failures_total": (
        "counter", "expiry-watch runs that could not learn the termination time for a reason that will not pass by "
        "itself, by reason (permission, not-found, refused, malformed: 3 in a row): expiry protection is off"),
    "slurmagent_journal_pending": (
        "gauge", "journaled actions (drain, requeue, repair...) not carried out yet: Slurm or the Compute API "
        "did not take them; retried on the next run"),
    "slurmagent_job_seconds_total": (
        "counter", "wrapped jobs' attempts that ended on this node (the batch step's), seconds by part: progress "
        "(first progress -> last commit), startup, restore, recompute (after the last commit), flush; goodput = "
        "progress / all"),
    "slurmagent_hangs_total": ("counter", "hangs of wrapped jobs that root on this node drained it for or counted "
                               "(root's own evidence and checks; a job's word alone is not counted)"),
    "slurmagent_stragglers_total": ("counter", "straggling ranks that wrapped jobs reported (or had drained) "
                                    "through this node's root channel, by the node the straggler ran on"),
    "slurmagent_breaker_open": ("gauge", "1 while the drain circuit breaker suppresses drains"),
    "slurmagent_jobs_requeued_on_fault_total": (
        "counter", "jobs that left a node whose GPU failed under them, requeued (by: slurmagent, or the job's wrapper)"),
    "slurmagent_jobs_cancelled_on_fault_total": (
        "counter", "jobs cancelled on a node whose GPU failed under them (not requeueable)"),
    "slurmagent_fault_to_leave_seconds": (
        "gauge", "last job off a failed GPU: seconds from the fault seen to the job off the node"),
}


def _key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self, state_dir: Path, textfile: Path | None = None, say: Callable[[str], None] = warn):
        self.state_dir = Path(state_dir)
        self.store = self.state_dir / "metrics.json"
        self.said = self.state_dir / "metrics.said"  # the textfile failure said last (said once)
        self.textfile = Path(textfile) if textfile else self.state_dir / "slurmagent.prom"
        self.say = say

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, float]]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.state_dir / "metrics.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            values = read_values(self.state_dir)
            before = dict(values)
            yield values
            for k in [k for k in values if k.startswith("slurmagent_build_info")]:
                del values[k]  # one series: a half-upgraded node shows the version that writes now
            values[_key("slurmagent_build_info", {"version": version()})] = 1.0
            if values == before and self.textfile.exists():
                return  # nothing changed (e.g. a journal backlog still 0 after a replay): no rewrite
            atomic_write_text(self.store, json.dumps(values, sort_keys=True), 0o640, durable=False)
            if not self._write_textfile(values):  # stored first: a shown counter never goes back
                atomic_write_text(self.store, json.dumps(values, sort_keys=True), 0o640, durable=False)
        finally:
            os.close(fd)

    def _write_textfile(self, values: dict[str, float]) -> bool:
        """The `.prom` file; a failure is counted in `values` (then stored) and said once."""
        try:
            atomic_write_text(self.textfile, render(values), 0o644, durable=False, root_dir=True)
        except OSError as exc:
            reason = errno.errorcode.get(exc.errno or 0, "OSError")
            k = _key(WRITE_FAILURES, {"reason": reason})
            values[k] = values.get(k, 0.0) + 1
            msg = (f"cannot write metrics to {self.textfile}: {exc.strerror or exc} ({reason}); "
                   f"node_exporter gets no new values (counted in {WRITE_FAILURES}, said once)")
            if _read_said(self.said) != msg:
                self.say(msg)
                atomic_write_text(self.said, msg, 0o640, durable=False)
            return False
        with contextlib.suppress(FileNotFoundError):
            self.said.unlink()  # written again: the next failure is said again
        return True

    def update(self, set_: dict[tuple[str, tuple], float] | None = None,
               add: dict[tuple[str, tuple], float] | None = None, replace_prefix: str | tuple[str, ...] | None = None,
               component: str | None = None) -> None:
        """Set gauges / add to counters; keys are (name, ((label, value), ...)). `component`: this
        is a run of it (prolog, watch, ...), stamped in its heartbeat series."""
        try:
            with self._locked() as values:
                if replace_prefix:
                    for k in [k for k in values if k.startswith(replace_prefix)]:
                        del values[k]
                for (name, labels), v in (set_ or {}).items():
                    values[_key(name, dict(labels))] = float(v)
                for (name, labels), v in (add or {}).items():
                    k = _key(name, dict(labels))
                    values[k] = float(values.get(k, 0.0)) + float(v)
                if component:
                    values[_key(HEARTBEAT, {"component": component})] = time.time()
        except OSError as exc:
            print(f"slurmagent: cannot write metrics in {self.state_dir}: {exc.strerror}", file=sys.stderr)

    def heartbeat(self, component: str) -> None:
        """A run of `component` that had nothing else to write."""
        self.update(component=component)

    def record_check(self, report, drained_rule: str | None = None, requeued: bool = False,
                     drop: tuple[str, ...] = (), component: str | None = None) -> None:
        """Gauges from a health report; a drain and a requeue count once each; series starting with
        a `drop` prefix go (an ended job's), in the same write."""
        bad = {f.gpu for f in report.findings if f.severity.name == "DRAIN" and f.gpu is not None}
        ids = report.gpu_ids or {i: (None, None) for i in range(report.gpus_seen)}
        gauges = {("slurmagent_gpu_healthy", gpu_labels(i, *ids[i])): 0.0 if i in bad else 1.0 for i in sorted(ids)}
        gauges[("slurmagent_node_healthy", ())] = 1.0 if report.healthy else 0.0
        gauges[("slurmagent_last_check_timestamp_seconds", ())] = time.time()
        add = {}
        if drained_rule:
            add[("slurmagent_drains_total", (("rule", drained_rule),))] = 1
        if requeued:
            add[("slurmagent_requeues_total", ())] = 1
        self.update(set_=gauges, add=add, replace_prefix=("slurmagent_gpu_healthy{", *drop), component=component)


def gpu_labels(index: int, uuid: str | None, pci_bus_id: str | None) -> tuple[tuple[str, str], ...]:
    """dcgm-exporter's label names (`gpu`, `UUID`, `pci_bus_id`), so a dashboard joins the two."""
    labels = [("gpu", str(index))]
    if uuid:
        labels.append(("UUID", uuid))
    if pci_bus_id:
        labels.append(("pci_bus_id", pci_bus_id))
    return tuple(labels)


def exact(value: float) -> str:
    """The value as Prometheus parses it back unchanged: whole numbers as integers (a Unix time
    of 1796130845 stays that, not 1.79613e+09), others by `repr` (shortest exact float)."""
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2 ** 63:
        return str(int(value))
    return repr(value)


def render(values: dict[str, float]) -> str:
    lines = []
    for name, (kind, text) in HELP.items():
        series = sorted(k for k in values if k == name or k.startswith(name + "{"))
        if not series:
            continue
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        lines += [f"{k} {exact(float(values[k]))}" for k in series]
    return "\n".join(lines) + "\n"


def _read_said(path: Path) -> str:
    try:
        return read_state_file(path)[:4096].decode()
    except (OSError, UnicodeDecodeError):
        return ""


def read_values(state_dir: Path) -> dict[str, float]:
    """The stored values; as root none that a user could have written (they start afresh)."""
    try:
        values = json.loads(read_state_file(Path(state_dir) / "metrics.json"))
        return values if isinstance(values, dict) else {}
    except (OSError, ValueError):
        return {}


def for_node(cfg, node: str | None) -> Metrics:
    """The node's metrics, honouring `[metrics] textfile` (and `[hooks] syslog` for what is said)."""
    textfile = cfg.node_path(cfg.metrics.textfile, node) if cfg.metrics.textfile else None
    return Metrics(cfg.state_path(node), Path(textfile) if textfile else None,
                   say=warn if cfg.hooks.syslog else _stderr)


def _stderr(msg: str) -> None:
    print(f"slurmagent: {msg}", file=sys.stderr)

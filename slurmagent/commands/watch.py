"""`slurmagent watch`: drain the node the moment a drain-class XID shows up, between jobs too.

Two inputs feed one judge:

* NVML XID critical-error events (:class:`slurmagent.gpu.nvml.NvmlXidEvents`, with an
  injectable ``nvml`` module) in a daemon thread, so a driver call that hangs never stops
  the rest; pynvml itself is imported only by :mod:`slurmagent.gpu.nvml`.
* The kernel log through the same :mod:`slurmagent.gpu.kernlog` source and cursor the Prolog
  uses. ``/dev/kmsg`` wakes the loop itself (``poll`` on an fd at its end); a plain file
  (``[health] kernel_log``) is ``stat``-ed every ``interval`` seconds; journalctl/dmesg are
  read every 5 s (`kernlog_changes.py`). Nothing is read when nothing changed.
  Read, judge, act and commit happen under the kernlog lock, and the cursor is committed
  only after the decision was acted on: an XID is judged once, across restarts too.

A drain-class XID (``xid.classify(code, detail).drains``) drains the node with the reason
the checks give (``slurmagent: xid 79 on gpu 3 (fallen off the bus)``), never over an
admin's drain; application-class XIDs are counted and logged. One decision line per event
(event ``watch``). The same XID on the same GPU seen by both inputs within 30 s is one event.

When the XID leaves a GPU unusable under a running job (``eviction_policy.evicts_jobs``: its immediate
action is a GPU reset or a node reboot) and our drain stands (not held back by the circuit
breaker, not an admin's drain), the jobs running on the node leave it at once
(``eviction.FaultEviction``: wrapped jobs flush, the others are requeued); the loop follows
the flushed ones until they are off the node or their deadline passed (event ``fault-evict``).

The daemon runs threads, so it never forks a child itself: a GPU snapshot (to map kernel-log
XIDs to GPU indices) is read through :class:`slurmagent.gpu.nvml_deadline.ThreadSafeReader`,
whose forkserver starts before the event thread.

systemd: ``Type=notify`` (READY=1, WATCHDOG=1, STOPPING=1 over ``$NOTIFY_SOCKET``, a plain
unix datagram socket). SIGTERM/SIGINT stop it cleanly with exit status 0.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import signal
import sys
import threading
import time
from typing import Any, Callable, TextIO

from ..actions.executor import JournalExecutor
from ..actions.eviction import FaultEviction
from ..actions.fault import FaultResponse, respond_to_fault
from ..gpu import kernlog
from ..core import catalogue
from ..core.checks import Finding, Report, Severity, count_unknown_finding, xid_finding
from ..state import metrics
from ..state.config import Config
from ..state.decisionlog import DecisionLog, path_for as decision_log_path
from ..errors import SlurmagentError, SlurmError
from .health import expected, read_snapshot
from ..state.host import sd_notify, watchdog_interval
from ..core.kernel_xid import map_to_gpus
from ..gpu.kernlog_changes import change_detector
from ..gpu.nvml import NVML_WAIT_MS, GpuRef, NvmlUnavailable, NvmlXidEvents, XidEvent
from ..gpu.nvml_deadline import ThreadSafeReader
from ..slurm.commands import Slurm

DEFAULT_INTERVAL_S = 0.25  # kernel-log poll period
HEARTBEAT_S = 60.0  # slurmagent_last_run_timestamp_seconds{component="watch"} period (the alert allows 15 min)
NVML_RETRY_S = 60.0  # NVML unavailable: try again this often (said once, not every time)
DUPLICATE_WINDOW_S = 30.0  # the NVML event and the NVRM line of one XID arrive within this
RETRY_MIN_S, RETRY_MAX_S = 1.0, 30.0  # after a failed drain or a busy kernlog lock
EVENT_WAIT_S = 1.0  # loop period when every input wakes it (kmsg fd, NVML pipe): watchdog, retries
FOLLOW_S = 0.5  # loop period while flushed jobs are followed off a failed GPU
EVICTED_KEPT = 1000  # jobs remembered as already moved off this node (a repeated XID skips them)


# --- the watcher ------------------------------------------------------------------------


class _Retry:
    """Failure state of one input: said once per streak, retried with exponential backoff."""

    def __init__(self, say: Callable[[str], None], what: str):
        self.say, self.what = say, what
        self.failing = False
        self.backoff = RETRY_MIN_S
        self.at = 0.0

    def due(self) -> bool:
        return self.failing and time.monotonic() >= self.at

    def ok(self) -> None:
        if self.failing:
            self.say(f"{self.what}: recovered; acting on XID events again")
        self.failing = False
        self.backoff = RETRY_MIN_S

    def failed(self, exc: BaseException) -> None:
        if not self.failing:
            self.say(f"{self.what}: cannot act: {_describe(exc)}; retrying")
        self.failing = True
        self.at = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, RETRY_MAX_S)


class Watcher:
    """Follows NVML XID events and the kernel log; drains on a drain-class XID."""

    def __init__(
        self,
        cfg: Config,
        node: str,
        slurm: Slurm | None = None,
        *,
        nvml: Any = None,
        use_nvml: bool = True,
        interval: float = DEFAULT_INTERVAL_S,
        log: DecisionLog | None = None,
        stderr: TextIO = sys.stderr,
        env: dict[str, str] | os._Environ = os.environ,
        nvml_retry_s: float = NVML_RETRY_S,
        nvml_wait_ms: int = NVML_WAIT_MS,
        snapshot_reader: ThreadSafeReader | None = None,
    ):
        self.cfg = cfg
        self.node = node
        self.heartbeat_s = HEARTBEAT_S
        self.slurm = slurm or Slurm.from_config(cfg)
        self.interval = interval
        self.log = log or DecisionLog(decision_log_path(cfg, node), use_syslog=cfg.hooks.syslog)
        self.stderr = stderr
        self.env = env
        self.state_dir = cfg.state_path(node)
        self.source: kernlog.Source | None = None
        if cfg.health.kernel_log_enabled:
            self.source = kernlog.source_for(cfg.node_path(cfg.health.kernel_log, node))
        self.use_nvml = use_nvml
        self.nvml_events = NvmlXidEvents(nvml, wait_ms=nvml_wait_ms)
        self.snapshot_reader = snapshot_reader or ThreadSafeReader()
        self.nvml_retry_s = nvml_retry_s
        self.nvml_gpus: list[GpuRef] = []
        self.nvml_state = "off" if not use_nvml else "starting"
        self.events: queue.Queue[XidEvent] = queue.Queue()
        self.pending: list[XidEvent] = []  # NVML events whose drain failed: retried
        self.recent: dict[tuple[int | None, int], tuple[float, str]] = {}
        self.app_xids = 0
        self.drains = 0
        self.evictions: list[FaultEviction] = []  # flushed jobs followed until off the node
        self.evicted: dict[tuple[str, int], None] = {}  # (job, restarts) already made to leave, oldest first
        self.judged = 0
        self._stopping = False
        self.channel: Any = None  # actions/job_channel.ChannelServer, when one serves: its death ends the watch
        self._stopped = threading.Event()  # set by the main loop on its way out: wakes the NVML thread
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # NVML event or stop: wake the loop
        self._poller = select.poll()
        self._poller.register(self._wake_r, select.POLLIN)
        self._polled_fd: int | None = None
        self._said: set[str] = set()
        self._kernel_retry = _Retry(self.say, "kernel log")
        self._nvml_retry = _Retry(self.say, "NVML XID event(s)")
        self._thread: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------

    def stop(self, *_: Any) -> None:
        """Ask the loop to end (safe from a signal handler: a flag and a byte down a pipe)."""
        self._stopping = True
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full pipe: a wake-up is pending anyway
            os.write(self._wake_w, b"!")

    @property
    def stopping(self) -> bool:
        return self._stopping

    def say(self, text: str, once_key: str | None = None) -> None:
        if once_key is not None:
            if once_key in self._said:
                return
            self._said.add(once_key)
        print(f"slurmagent watch: {text}", file=self.stderr, flush=True)

    def run(self) -> int:
        """The main loop; returns 0 once stopped."""
        detector = change_detector(self.source) if self.source is not None else None
        if not self.cfg.health.snapshot:
            self.snapshot_reader.start()  # its forkserver starts before any thread of ours
        if self.use_nvml:
            self._thread = threading.Thread(target=self._nvml_loop, name="nvml-xid-events", daemon=True)
            self._thread.start()
        following = []
        if self.source is not None:
            following.append(f"kernel log ({self.source.name})")
        if self.use_nvml:
            following.append("NVML XID events")
        if not following:
            self.say("nothing to follow: [health] kernel_log_enabled is false and NVML is off", "nothing")
        self.say(f"node {self.node}: following {' and '.join(following) or 'nothing'}")
        self._say_expected()
        ping_every = watchdog_interval(self.env)
        next_ping = next_beat = 0.0
        first = True
        code = 0
        try:
            while not self._stopping:
                if self.channel is not None and not self.channel.alive():
                    self.say(f"the channel for wrapped jobs stopped ({self.channel.failure}): exiting for a restart")
                    code = 1
                    break
                self._poll_kernel(detector, force=first)
                if first:
                    sd_notify(f"READY=1\nSTATUS=following {' and '.join(following) or 'nothing'}", self.env)
                    first = False
                self._wait(detector)
                self._drain_queue()
                self._follow_evictions()
                if time.monotonic() >= next_beat:  # alive and looping: the heartbeat alert's series
                    metrics.for_node(self.cfg, self.node).heartbeat("watch")
                    next_beat = time.monotonic() + self.heartbeat_s
                if ping_every is not None and time.monotonic() >= next_ping:
                    sd_notify("WATCHDOG=1", self.env)
                    next_ping = time.monotonic() + ping_every
        finally:
            sd_notify("STOPPING=1", self.env)
            self._stopping = True
            self._stopped.set()
            if detector is not None:
                if self._polled_fd is not None:
                    with contextlib.suppress(KeyError, ValueError):
                        self._poller.unregister(self._polled_fd)
                    self._polled_fd = None
                detector.close()
            if self._thread is not None:
                self._thread.join(timeout=self.nvml_events.wait_ms / 1000 + 1)
        self.say(f"stopped ({self.judged} XID events judged, {self.drains} drains, {self.app_xids} application XIDs)")
        return code

    def _say_expected(self) -> None:
        """What the hooks and the health check will expect (files only, no network): said at
        start, so a node whose count is unknown is visible in the daemon's journal too."""
        exp = expected(self.cfg, self.node)
        if exp.count is None:
            self.say(f"warning: {count_unknown_finding(exp.tried).detail}")
        else:
            self.say(f"{exp.count} GPU(s) expected ({exp.source})")

    # --- NVML thread -------------------------------------------------------------------

    def _nvml_loop(self) -> None:
        ev = self.nvml_events
        last_problem = None
        while not self._stopping:
            try:
                self.nvml_gpus = ev.open()
            except Exception as exc:  # noqa: BLE001 - NVML (or a binding bug) must not end the watcher
                problem = str(exc) if isinstance(exc, NvmlUnavailable) else f"{type(exc).__name__}: {exc}"
                if problem != last_problem:  # said once, again only when the problem changes
                    self.say(f"NVML XID events unavailable: {problem}; following the kernel log only")
                    last_problem = problem
                self.nvml_state = "unavailable"
                self._sleep(self.nvml_retry_s)
                continue
            if ev.unsupported:
                self.say(f"GPU(s) {', '.join(map(str, ev.unsupported))} cannot deliver XID events "
                         "(NVML_ERROR_NOT_SUPPORTED); the kernel log covers them", "nvml-partial")
            if last_problem is not None or self.nvml_state == "starting":
                self.say(f"NVML XID events on ({len(ev.gpus) - len(ev.unsupported)} GPU(s))")
            self.nvml_state = "on"
            last_problem = None
            try:
                while not self._stopping:
                    event = ev.wait()
                    if event is not None:
                        self.events.put(event)
                        self._wake()
            except Exception as exc:  # noqa: BLE001
                if ev.gpu_lost(exc):
                    # The driver also logs Xid 79 with the GPU's address; the kernel log names it.
                    self.say("NVML event wait: a GPU is lost (NVML_ERROR_GPU_IS_LOST)")
                    last_problem = "gpu-lost"
                else:
                    last_problem = f"event wait failed ({ev.error(exc) if hasattr(exc, 'value') else exc})"
                    self.say(f"NVML XID events: {last_problem}; following the kernel log, retrying")
                self.nvml_state = "unavailable"
            finally:
                ev.close()
            self._sleep(self.nvml_retry_s)

    def _sleep(self, seconds: float) -> None:
        if not self._stopping:
            self._stopped.wait(seconds)

    # --- main thread: judging ------------------------------------------------------------

    def _wait(self, detector) -> None:
        """Sleep in poll(): an NVML event, a stop or a new /dev/kmsg record ends it at once.

        A file source is polled every `interval`; when every input can wake the loop (kmsg,
        NVML, or no kernel log) it sleeps EVENT_WAIT_S, for the watchdog and retries only."""
        fd = detector.fd if detector is not None else None
        if fd != self._polled_fd:
            if self._polled_fd is not None:
                self._poller.unregister(self._polled_fd)
            if fd is not None:
                self._poller.register(fd, select.POLLIN)
            self._polled_fd = fd
        event_driven = detector is None or fd is not None
        timeout = EVENT_WAIT_S if event_driven else self.interval
        if self.evictions:
            timeout = min(timeout, FOLLOW_S)
        try:
            ready = self._poller.poll(timeout * 1000)
        except InterruptedError:
            return
        if any(f == self._wake_r for f, _ in ready):
            with contextlib.suppress(OSError):
                os.read(self._wake_r, 4096)

    def _drain_queue(self) -> None:
        """Judge the NVML events that arrived (and failed ones once their retry is due)."""
        new: list[XidEvent] = []
        while True:
            try:
                new.append(self.events.get_nowait())
            except queue.Empty:
                break
        if self._nvml_retry.failing and not self._nvml_retry.due():
            self.pending.extend(new)  # acted on together at the next retry
            return
        batch, self.pending = self.pending + new, []
        if not batch:
            return
        try:
            self.judge(batch)
            self._nvml_retry.ok()
        except Exception as exc:  # noqa: BLE001 - keep the events, say why, retry with backoff
            self.pending = batch
            self._nvml_retry.failed(exc)

    def _poll_kernel(self, detector, force: bool = False) -> None:
        if self.source is None:
            return
        if not (detector.changed() or force or self._kernel_retry.due()):
            return
        try:
            with kernlog.locked(self.state_dir, self.cfg.health.timeout_s):
                batch = kernlog.read_since(self.source, self.state_dir)
                if batch.xids:
                    gpus = self.gpu_refs()
                    self.judge([
                        XidEvent(xid=k.xid, gpu=g, source="kernel_log", detail=k.detail, raw=k.raw, pci=k.pci)
                        for g, k in map_to_gpus(batch.xids, gpus)
                    ])
                saved = kernlog.load_cursor(self.state_dir)
                if saved != batch.cursor:
                    kernlog.commit_cursor(self.state_dir, batch.cursor)  # after the decision was acted on
            self._kernel_retry.ok()
        except Exception as exc:  # noqa: BLE001 - the cursor stays put: judged again on the retry
            self._kernel_retry.failed(exc)

    def gpu_refs(self) -> list[Any]:
        """Index and PCI address of each GPU: the replay snapshot, else NVML's view."""
        if self.cfg.health.snapshot or not self.nvml_gpus:
            try:
                return list(read_snapshot(self.cfg, self.node, self.snapshot_reader).gpus)
            except Exception as exc:  # noqa: BLE001 - the XID is judged anyway, as "gpu ?"
                self.say(f"cannot map XIDs to GPU indices: {exc}", "gpu-map")
                return list(self.nvml_gpus)
        return list(self.nvml_gpus)

    def _duplicate(self, event: XidEvent) -> bool:
        """The same XID already seen through the other input moments ago (NVML + NVRM line)."""
        now = event.seen
        for key, (when, _) in list(self.recent.items()):
            if now - when > DUPLICATE_WINDOW_S:
                del self.recent[key]
        key = (event.gpu, event.xid)
        prior = self.recent.get(key)
        self.recent[key] = (now, event.source)
        return prior is not None and prior[1] != event.source and now - prior[0] <= DUPLICATE_WINDOW_S

    def judge(self, events: list[XidEvent]) -> str | None:
        """Decide and act on a batch of XID events; one decision line per event.

        Raises SlurmagentError when the drain failed (the caller keeps the events)."""
        judged: list[tuple[XidEvent, Finding, bool]] = []
        if not catalogue.runs("gpu-xid", "watch", self.cfg.checks.on, self.cfg.checks.off):
            return None  # `[checks] off = ["gpu-xid"]`: the watch judges nothing
        for e in events:
            judged.append((e, xid_finding(e.xid, e.gpu, e.detail), self._duplicate(e)))
        drains = [f for _, f, _ in judged if f.severity is Severity.DRAIN]
        action = reason = response = None
        if drains:
            response = respond_to_fault(JournalExecutor(self.cfg, self.slurm, self.node), Report(findings=drains),
                                        source="watch")
            if response.drain.action.startswith("drain-failed"):
                raise SlurmError(response.drain.action)  # keep the events: retried here, and by the journal
            action, reason = response.action, response.reason
        for e, f, dup in judged:
            if dup and (f.severity is not Severity.DRAIN or action != "drained"):
                continue  # already judged through the other input
            self.judged += 1
            fields: dict[str, Any] = dict(node=self.node, source=e.source, rule=f.rule, gpu=e.gpu, xid=e.xid,
                                          observed=e.xid, meaning=f.detail)
            if f.severity is Severity.DRAIN:
                self.drains += action == "drained"
                fields.update(verdict="unhealthy", reason=reason, action=action)
            else:
                self.app_xids += 1
                fields.update(verdict="warning", action="none (application xid)", app_xid_count=self.app_xids)
            if e.raw:
                fields["line"] = e.raw[-300:]
            self.log.started = e.seen  # duration_ms: from the event seen to the decision logged
            self.log.write("watch", **fields)
            if f.severity is Severity.DRAIN:
                self.say(f"{f.summary}: {action} ({reason})")
        if response is not None and response.evicts:  # right after the drain (and its decision line)
            self._evict(response, min(e.seen for e, f, _ in judged if f.severity is Severity.DRAIN))
        return action


    # --- running jobs on a failed GPU ---------------------------------------------------------

    def _evict(self, response: FaultResponse, fault_at: float) -> None:
        """Right after the drain: the node's running jobs leave it (never raises: the drain stands)."""
        eviction = response.eviction(fault_at, self.log)
        try:
            leaves = eviction.start(skip=self.evicted)
        except Exception as exc:  # noqa: BLE001 - said; the drain keeps new jobs off, Slurm's own timeouts remain
            self.say(f"cannot make the running jobs leave {self.node}: {_describe(exc)}")
            return
        for leave in leaves:
            self.evicted[(leave.job.job_id, leave.job.restarts)] = None
            while len(self.evicted) > EVICTED_KEPT:
                del self.evicted[next(iter(self.evicted))]
            self.say(f"job {leave.job.job_id} on a failed GPU: {leave.action}")
        if not eviction.done:
            self.evictions.append(eviction)

    def _follow_evictions(self) -> None:
        for eviction in list(self.evictions):
            try:
                for leave in eviction.poll():
                    took = f" ({leave.left_after_s:.1f} s after the fault)" if leave.left_after_s is not None else ""
                    self.say(f"job {leave.job.job_id}: {leave.action}{took}")
            except Exception as exc:  # noqa: BLE001 - keep following; said once
                self.say(f"following the jobs off {self.node}: {_describe(exc)}", "follow-evictions")
            if eviction.done:
                self.evictions.remove(eviction)


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, SlurmagentError) else f"{type(exc).__name__}: {exc}"


def run_watch(cfg: Config, node: str, *, interval: float = DEFAULT_INTERVAL_S, use_nvml: bool = True,
              nvml: Any = None, stderr: TextIO = sys.stderr) -> int:
    """`slurmagent watch`: run until SIGTERM/SIGINT, then exit 0."""
    watcher = Watcher(cfg, node, nvml=nvml, use_nvml=use_nvml, interval=interval, stderr=stderr)
    previous: dict[int, Callable | int | None] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, watcher.stop)
    channel = None
    if cfg.watch.channel_socket:  # the node's wrapped jobs ask root here (per-job metrics, hang drains)
        from ..actions.job_channel import ChannelServer  # only where a channel is configured: start-up speed

        channel = ChannelServer(cfg, node, watcher.slurm, watcher.log, say=watcher.say)
        try:
            channel.start()
            watcher.channel = channel
        except OSError as exc:
            watcher.say(f"no channel for wrapped jobs at {channel.path}: {exc.strerror or exc} (their per-job "
                        "metrics and hang drains are not taken; the watch goes on)")
            channel = None
    try:
        return watcher.run()
    finally:
        if channel is not None:
            channel.stop()
        for sig, handler in previous.items():
            with contextlib.suppress(Exception):
                signal.signal(sig, handler)

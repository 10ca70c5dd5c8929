"""`slurmagent watch`: NVML XID events (fake pynvml, in-process) and the kernel log on a real cluster.

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_watch_slurm.py.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from support import healthy_snapshot_dict, wait_for, write_json
from support.fakes import nvml_readers
from support.fakes.slurm import FakeSlurm
from slurmagent.gpu import kernlog
from slurmagent.state.config import parse
from slurmagent.state.decisionlog import read_records
from slurmagent.slurm.commands import Slurm
from slurmagent.state.host import sd_notify, watchdog_interval
from slurmagent.gpu.nvml import NvmlXidEvents
from slurmagent.gpu.nvml_deadline import ThreadSafeReader
from slurmagent.commands.watch import Watcher

GPU3_PCI = "0000:48:00"  # healthy_gpu(3): 00000000:48:00.0


def nvrm(xid: int, pci: str = GPU3_PCI, detail: str = "GPU has fallen off the bus.") -> str:
    """A kernel-log line as the NVIDIA driver writes it."""
    return f"[ 8123.456789] NVRM: Xid (PCI:{pci}): {xid}, pid='<unknown>', name=<unknown>, {detail}\n"


def append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text)


# --- fakes ------------------------------------------------------------------------------


class FakeHandle:
    def __init__(self, index: int):
        self.index = index


class FakeEventNvml(SimpleNamespace):
    """The pynvml event calls: events are queued by the test; a wait without one times out."""

    def __init__(self, n: int = 8, init_error: int | None = None, unsupported: tuple[int, ...] = ()):
        consts = {k: getattr(pynvml, k) for k in dir(pynvml) if k.startswith(("NVML_", "nvmlEventType"))}
        super().__init__(**consts, NVMLError=pynvml.NVMLError)
        self.n = n
        self.init_error = init_error
        self.unsupported = unsupported
        self.queue: queue.Queue = queue.Queue()
        self.inits = self.shutdowns = self.frees = 0
        self.registered: list[tuple[int, int]] = []

    def push(self, xid: int, gpu: int, event_type: int = pynvml.nvmlEventTypeXidCriticalError) -> None:
        self.queue.put(SimpleNamespace(device=FakeHandle(gpu), eventType=event_type, eventData=xid,
                                       gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF))

    def raise_in_wait(self, value: int) -> None:
        self.queue.put(pynvml.NVMLError(value))

    def nvmlInit(self):
        self.inits += 1
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i):
        return FakeHandle(i)

    def nvmlDeviceGetIndex(self, h):
        return h.index

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=f"00000000:{0x18 + 0x10 * h.index:02X}:00.0".encode())

    def nvmlEventSetCreate(self):
        return object()

    def nvmlDeviceRegisterEvents(self, h, types, event_set):
        if h.index in self.unsupported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self.registered.append((h.index, types))

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        try:
            item = self.queue.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise pynvml.NVMLError_Timeout() from None
        if isinstance(item, BaseException):
            raise item
        return item

    def nvmlEventSetFree(self, event_set):
        self.frees += 1


class Harness:
    """A Watcher in a thread, with a fake NVML, a fake scontrol and real files."""

    def __init__(self, tmp: Path, nvml: Any = None, snapshot: bool = True, use_nvml: bool = True, **kw: Any):
        self.tmp = tmp
        self.kern = tmp / "kern.log"
        self.kern.touch()
        health: dict[str, Any] = {"kernel_log": str(self.kern), "timeout_s": 2}
        if snapshot:
            health["snapshot"] = str(write_json(tmp / "snap.json", healthy_snapshot_dict()))
        self.cfg = parse({"state_dir": str(tmp / "state"), "health": health, "hooks": {"syslog": False}})
        self.scontrol = FakeSlurm()
        self.stderr = io.StringIO()
        self.nvml = nvml
        self.watcher = Watcher(self.cfg, "n1", Slurm(runner=self.scontrol), nvml=nvml, use_nvml=use_nvml,
                               interval=0.05, stderr=self.stderr, env=kw.pop("env", {}), nvml_wait_ms=50, **kw)
        self.thread: threading.Thread | None = None
        self.rc: int | None = None

    def __enter__(self) -> Harness:
        def target():
            self.rc = self.watcher.run()

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.watcher.stop()
        self.thread.join(5)
        assert not self.thread.is_alive()
        assert self.rc == 0

    def decisions(self) -> list[dict]:
        return [r for r in read_records(self.tmp / "state" / "hooks.log") if r["event"] == "watch"]

    def wait_nvml_on(self) -> None:
        wait_for(lambda: self.watcher.nvml_state == "on", 5, "NVML events on")

    def wait_decisions(self, n: int) -> list[dict]:
        return wait_for(lambda: len(self.decisions()) >= n and self.decisions(), 5, f"{n} decision line(s)")


# --- NVML events, in-process ------------------------------------------------------------


def test_nvml_drain_class_xid_drains_with_the_checks_reason(tmp_path):
    nv = FakeEventNvml()
    with Harness(tmp_path, nv) as h:
        h.wait_nvml_on()
        assert [i for i, _ in nv.registered] == list(range(8))
        assert all(t == pynvml.nvmlEventTypeXidCriticalError for _, t in nv.registered)
        nv.push(79, gpu=3)
        (d,) = h.wait_decisions(1)
    assert h.scontrol.reason == "slurmagent: xid 79 on gpu 3 (fallen off the bus)"
    assert len(h.scontrol.drains) == 1
    assert d["source"] == "nvml" and d["verdict"] == "unhealthy" and d["action"] == "drained"
    assert d["xid"] == 79 and d["gpu"] == 3 and d["reason"] == h.scontrol.reason
    assert nv.frees == 1 and nv.shutdowns == nv.inits == 1  # released on stop


def test_nvml_application_xid_is_counted_and_logged_not_drained(tmp_path):
    nv = FakeEventNvml()
    with Harness(tmp_path, nv) as h:
        h.wait_nvml_on()
        nv.push(13, gpu=1)
        nv.push(31, gpu=2)
        nv.push(8, gpu=2, event_type=pynvml.nvmlEventTypePState)  # not an XID event: ignored
        d1, d2 = h.wait_decisions(2)
        time.sleep(0.2)
    assert h.scontrol.drains == []
    assert (d1["verdict"], d1["xid"], d1["gpu"], d1["app_xid_count"]) == ("warning", 13, 1, 1)
    assert (d2["xid"], d2["app_xid_count"]) == (31, 2)
    assert h.watcher.app_xids == 2 and len(h.decisions()) == 2


def test_nvml_event_and_its_kernel_line_are_one_event(tmp_path):
    nv = FakeEventNvml()
    with Harness(tmp_path, nv) as h:
        h.wait_nvml_on()
        nv.push(48, gpu=3)
        nv.push(13, gpu=0)
        h.wait_decisions(2)
        append(h.kern, nvrm(48, detail="An uncorrectable double bit error (DBE) has been detected."))
        append(h.kern, nvrm(13, pci="0000:18:00", detail="Graphics SM Warp Exception"))
        wait_for(lambda: (kernlog.load_cursor(tmp_path / "state") or SimpleNamespace(position=0)).position
                 == h.kern.stat().st_size, 5, "kernel lines judged")
        time.sleep(0.2)
    assert len(h.scontrol.drains) == 1
    assert [(d["source"], d["xid"]) for d in h.decisions()] == [("nvml", 48), ("nvml", 13)]
    assert h.watcher.app_xids == 1


def test_nvml_not_supported_keeps_following_kernel_log_and_says_so_once(tmp_path):
    nv = FakeEventNvml(n=2, unsupported=(0, 1))  # older parts: NVML_ERROR_NOT_SUPPORTED
    with Harness(tmp_path, nv, nvml_retry_s=0.05) as h:
        wait_for(lambda: nv.inits >= 3, 5, "NVML retried")
        append(h.kern, nvrm(79))
        (d,) = h.wait_decisions(1)
    assert d["source"] == "kernel_log" and d["gpu"] == 3 and d["action"] == "drained"
    assert "NVRM: Xid (PCI:0000:48:00): 79" in d["line"]
    assert h.scontrol.reason == "slurmagent: xid 79 on gpu 3 (fallen off the bus)"
    said = h.stderr.getvalue()
    assert said.count("not supported") == 1, said
    assert nv.shutdowns == nv.inits  # every attempt cleaned up


def test_nvml_partly_supported_registers_the_rest(tmp_path):
    nv = FakeEventNvml(n=4, unsupported=(2,))
    with Harness(tmp_path, nv) as h:
        h.wait_nvml_on()
        nv.push(95, gpu=1)
        (d,) = h.wait_decisions(1)
    assert [i for i, _ in nv.registered] == [0, 1, 3]
    assert "GPU(s) 2 cannot deliver XID events" in h.stderr.getvalue()
    assert d["reason"] == "slurmagent: xid 95 on gpu 1 (uncontained memory error)"


@pytest.mark.parametrize("nvml", ["driver-not-loaded", "no-pynvml", "binding-without-events"])
def test_nvml_missing_keeps_following_kernel_log(tmp_path, monkeypatch, nvml):
    nv: Any = None
    if nvml == "driver-not-loaded":
        nv = FakeEventNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    elif nvml == "no-pynvml":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` fails
    else:
        nv = SimpleNamespace(NVMLError=pynvml.NVMLError, nvmlInit=lambda: None, nvmlShutdown=lambda: None)
    with Harness(tmp_path, nv, nvml_retry_s=0.05) as h:
        wait_for(lambda: h.watcher.nvml_state == "unavailable", 5, "NVML unavailable")
        time.sleep(0.2)  # several retries
        append(h.kern, nvrm(13, pci="0000:18:00", detail="Graphics Exception"))
        (d,) = h.wait_decisions(1)
    said = h.stderr.getvalue()
    assert said.count("NVML XID events unavailable") == 1, said
    assert d["verdict"] == "warning" and d["gpu"] == 0 and h.scontrol.drains == []


def test_kernel_xid_mapped_through_nvml_without_a_replay_snapshot(tmp_path):
    nv = FakeEventNvml()
    with Harness(tmp_path, nv, snapshot=False) as h:
        h.wait_nvml_on()
        append(h.kern, nvrm(119, pci="0000:88:00", detail="Timeout waiting for RPC from GSP!"))
        (d,) = h.wait_decisions(1)
    assert d["gpu"] == 7 and d["reason"] == "slurmagent: xid 119 on gpu 7 (gsp rpc timeout)"


def test_kernel_xid_mapped_through_a_forkserver_read_never_a_fork(tmp_path, monkeypatch):
    """No NVML events and no replay snapshot: the GPU of a kernel-log XID comes from a snapshot
    read under a deadline. The daemon runs threads, so that read never forks this process."""
    forks: list[int] = []

    def no_fork() -> int:
        forks.append(1)
        raise AssertionError("os.fork() in the threaded watch daemon")

    monkeypatch.setattr(os, "fork", no_fork)
    nv = FakeEventNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    reader = ThreadSafeReader(nvml_readers.healthy)
    with Harness(tmp_path, nv, snapshot=False, nvml_retry_s=0.05, snapshot_reader=reader) as h:
        wait_for(lambda: h.watcher.nvml_state == "unavailable", 5, "NVML unavailable")
        append(h.kern, nvrm(79, pci="0000:88:00"))
        (d,) = h.wait_decisions(1)
    assert d["gpu"] == 7 and d["reason"] == "slurmagent: xid 79 on gpu 7 (fallen off the bus)"
    assert forks == [] and "cannot map XIDs" not in h.stderr.getvalue()


def test_gpu_lost_in_event_wait_is_said_and_retried(tmp_path):
    nv = FakeEventNvml()
    with Harness(tmp_path, nv, nvml_retry_s=0.05) as h:
        h.wait_nvml_on()
        nv.raise_in_wait(pynvml.NVML_ERROR_GPU_IS_LOST)
        wait_for(lambda: nv.inits >= 2, 5, "NVML reopened")
        h.wait_nvml_on()
        nv.push(79, gpu=5)
        (d,) = h.wait_decisions(1)
    assert "GPU is lost" in h.stderr.getvalue()
    assert d["gpu"] == 5 and d["action"] == "drained"


def test_admin_drain_is_never_overridden(tmp_path):
    nv = FakeEventNvml()
    with Harness(tmp_path, nv) as h:
        h.scontrol.state, h.scontrol.reason = "IDLE+DRAIN", "admin: swap PSU"
        h.wait_nvml_on()
        nv.push(79, gpu=3)
        (d,) = h.wait_decisions(1)
    assert h.scontrol.drains == [] and h.scontrol.reason == "admin: swap PSU"
    assert d["action"] == "kept-admin-drain"


def test_kernel_cursor_committed_only_after_the_drain_succeeds(tmp_path):
    with Harness(tmp_path, use_nvml=False) as h:
        wait_for(lambda: kernlog.load_cursor(tmp_path / "state") is not None, 5, "first poll")
        h.scontrol.down = True  # slurmctld unreachable
        append(h.kern, nvrm(79))
        wait_for(lambda: "retrying" in h.stderr.getvalue(), 5, "drain failure said")
        assert kernlog.load_cursor(tmp_path / "state").position == 0
        assert h.decisions() == []
        h.scontrol.down = False
        (d,) = h.wait_decisions(1)
        wait_for(lambda: kernlog.load_cursor(tmp_path / "state").position == h.kern.stat().st_size, 5, "commit")
        time.sleep(0.3)
    # the drain happened exactly once: by the journal's replay or by the retry, whichever came first
    assert d["action"] in ("drained", "already-drained") and len(h.decisions()) == 1
    assert len(h.scontrol.drains) == 1
    assert "recovered" in h.stderr.getvalue()


def test_nvml_event_retried_after_failed_drain(tmp_path):
    nv = FakeEventNvml()
    with Harness(tmp_path, nv) as h:
        h.wait_nvml_on()
        h.scontrol.down = True
        nv.push(62, gpu=0)
        wait_for(lambda: "retrying" in h.stderr.getvalue(), 5, "drain failure said")
        h.scontrol.down = False
        (d,) = h.wait_decisions(1)
    assert d["action"] in ("drained", "already-drained") and d["xid"] == 62
    assert len(h.scontrol.drains) == 1


def test_idle_poll_reads_nothing_when_the_log_is_unchanged(tmp_path, monkeypatch):
    reads = []
    real = kernlog.FileSource.read

    def counting(self, position):
        reads.append(position)
        return real(self, position)

    monkeypatch.setattr(kernlog.FileSource, "read", counting)
    with Harness(tmp_path, use_nvml=False):
        time.sleep(0.5)  # ~10 polls at 0.05 s
    assert len(reads) == 1


def test_sd_notify_ready_watchdog_stopping(tmp_path):
    sock_dir = tempfile.mkdtemp(prefix="sa", dir="/tmp")
    path = os.path.join(sock_dir, "notify")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(path)
    srv.settimeout(5)
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval(env) == 0.1
    assert watchdog_interval({**env, "WATCHDOG_PID": "1"}) is None
    assert sd_notify("X=1", {}) is False
    try:
        with Harness(tmp_path, use_nvml=False, env=env):
            got = [srv.recv(4096).decode() for _ in range(3)]
        while "STOPPING=1" not in got:
            got.append(srv.recv(4096).decode())
    finally:
        srv.close()
        os.unlink(path)
        os.rmdir(sock_dir)
    assert got[0].startswith("READY=1\nSTATUS=following kernel log")
    assert got[1:3] == ["WATCHDOG=1", "WATCHDOG=1"]


def test_event_wrapper_handles_older_binding_without_wait_v2():
    nv = FakeEventNvml(n=1)
    nv.nvmlEventSetWait = nv.nvmlEventSetWait_v2
    nv.nvmlEventSetWait_v2 = None
    ev = NvmlXidEvents(nv, wait_ms=10)
    assert [g.index for g in ev.open()] == [0]
    assert ev.gpus[0].pci_bus_id == "00000000:18:00.0"
    assert ev.wait() is None
    nv.push(74, gpu=0)
    e = ev.wait()
    assert (e.xid, e.gpu, e.source) == (74, 0, "nvml")
    ev.close()
    assert nv.shutdowns == 1 and nv.frees == 1

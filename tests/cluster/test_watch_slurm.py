"""`slurmagent watch`: NVML XID events (fake pynvml, in-process) and the kernel log on a real cluster.

The same subject without a cluster, emulator or fake server: tests/unit/test_watch.py.

Timing (parallel lanes): nothing here is in the serial group; the drain "at once" is waited for
with a bound (DRAIN_AT_ONCE_S) that holds on a loaded machine and is still far below any
periodic check that could drain the node instead.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from support import REPO, wait_for
from slurmagent.gpu import kernlog
from test_watch import append, nvrm


# --- the real cluster, the watcher as a process -----------------------------------------


class WatchProcess:
    """`python -m slurmagent.entry watch --node N` as systemd would run it (Type=notify)."""

    def __init__(self, slurm, node: str, config=None):
        self.slurm, self.node = slurm, node
        self.config = config or slurm.config
        self.dir = tempfile.mkdtemp(prefix="sa", dir="/tmp")
        self.sock_path = os.path.join(self.dir, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.sock_path)
        self.proc: subprocess.Popen | None = None
        self.err = Path(self.dir) / "stderr"

    def start(self) -> WatchProcess:
        env = dict(self.slurm.cluster.env, SLURMAGENT_CONFIG=str(self.config), PYTHONPATH=str(REPO),
                   NOTIFY_SOCKET=self.sock_path)
        env.pop("SLURMD_NODENAME", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "slurmagent.entry", "watch", "--node", self.node],
                                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=open(self.err, "ab"))
        self.sock.settimeout(60)  # READY=1 after its start (imports, NVML reader) on a loaded machine
        while True:
            msg = self.sock.recv(4096).decode()
            if msg.startswith("READY=1"):
                return self
            assert self.proc.poll() is None, self.stderr()

    def stderr(self) -> str:
        return self.err.read_text(errors="replace") if self.err.exists() else ""

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(5)

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)

    def close(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.sock.close()
        for p in Path(self.dir).iterdir():
            p.unlink()
        os.rmdir(self.dir)


@pytest.fixture
def watcher(slurm):
    """Starts watchers on demand; at the end stops them and leaves no unjudged line behind."""
    started: list[WatchProcess] = []

    def start(node: str = "n1") -> WatchProcess:
        w = WatchProcess(slurm, node).start()
        started.append(w)
        return w

    yield start
    for w in started:
        w.close()
    for node in slurm.cluster.nodes:  # whatever a failed test appended must not drain a later test's node
        kernlog.read_new(kernlog.FileSource(slurm.kernel_log(node)), slurm.state_dir(node))


def watch_decisions(slurm, node: str = "n1", after: int = 0) -> list[dict]:
    return [d for d in slurm.decisions(node) if d["event"] == "watch"][after:]


def drained(slurm, node: str) -> dict | None:
    info = slurm.cluster.node(node)
    return info if "DRAIN" in info.get("State", "") else None


# The watcher stats the kernel log every 0.25 s and drains with one scontrol call: idle, it takes
# well under a second; a loaded machine (parallel lanes, 4 workers on 2 cores) may stretch that
# to seconds. 20 s still tells "at once" from "at the next health check or job".
DRAIN_AT_ONCE_S = 20.0


@pytest.mark.slurm
def test_drain_class_xid_drains_idle_node_at_once_and_next_job_runs_elsewhere(slurm, watcher, tmp_path):
    c = slurm.cluster
    w = watcher("n1")
    before = len(watch_decisions(slurm))
    append(slurm.kernel_log("n1"), nvrm(79))
    info = wait_for(lambda: drained(slurm, "n1"), DRAIN_AT_ONCE_S, "n1 DRAIN", interval=0.05)
    assert info["Reason"].startswith("slurmagent: xid 79 on gpu 3 (fallen off the bus)"), info
    job_id = c.sbatch("-o", str(tmp_path / "out"), "--wrap", "echo ran on $SLURMD_NODENAME")
    job = c.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED"), 30)
    assert job["JobState"] == "COMPLETED" and job["NodeList"] in ("n2", "n3") and job["Restarts"] == "0", job
    # the decision line follows the circuit breaker's check of concurrent drains (~1 s)
    (d,) = wait_for(lambda: watch_decisions(slurm, after=before), 30, "the watch decision")
    assert (d["verdict"], d["rule"], d["xid"], d["gpu"], d["action"]) == ("unhealthy", "xid", 79, 3, "drained")
    assert w.terminate() == 0, w.stderr()


@pytest.mark.slurm
def test_application_xid_is_logged_not_drained(slurm, watcher):
    w = watcher("n1")
    before = len(watch_decisions(slurm))
    append(slurm.kernel_log("n1"), nvrm(13, detail="Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0)"))
    (d,) = wait_for(lambda: watch_decisions(slurm, after=before), 30, "decision line")
    assert (d["verdict"], d["xid"], d["gpu"], d["action"]) == ("warning", 13, 3, "none (application xid)")
    time.sleep(0.3)
    assert drained(slurm, "n1") is None
    assert w.terminate() == 0


@pytest.mark.slurm
def test_events_judged_once_across_kill_and_restart(slurm, watcher):
    c = slurm.cluster
    w = watcher("n1")
    before = len(watch_decisions(slurm))
    w.kill()  # SIGKILL: no clean shutdown
    append(slurm.kernel_log("n1"), nvrm(79))  # logged while no watcher runs
    w2 = watcher("n1")  # judges it at start
    wait_for(lambda: drained(slurm, "n1"), DRAIN_AT_ONCE_S, "n1 DRAIN after restart")
    assert len(watch_decisions(slurm, after=before)) == 1
    c.resume("n1")  # the admin repaired the GPU
    wait_for(lambda: drained(slurm, "n1") is None, 30, "n1 resumed")
    w2.kill()
    w3 = watcher("n1")
    time.sleep(1.0)  # several polls
    assert drained(slurm, "n1") is None, "an event judged before the kill was judged again"
    assert len(watch_decisions(slurm, after=before)) == 1
    assert w3.terminate() == 0
    assert "following kernel log" in w3.stderr()

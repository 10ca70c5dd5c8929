"""Faults: malformed inputs and answers give one clear line and lose nothing; a full or
read-only state dir still gives a verdict; the wall clock stepping back does not reorder the
journal; slurmctld restarting mid-requeue; Compute 429/5xx storms and lost replies.

scontrol is the recording script of test_hostile (`[slurm] scontrol`), except where the real
session cluster is used. The hypothesis fuzz of the snapshot and kernel-log parsers lives in
tests/unit/test_snapshot.py and tests/unit/test_kernlog.py.

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_faults_cluster.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from support import healthy_snapshot_dict, xid_snapshot_dict
from support.fakes.slurm import FakeSlurm
from test_hostile import DRAIN_N1, XID79, Node

from slurmagent.state import host
from slurmagent.gpu import kernlog
from slurmagent.policy import breaker as breaker_policy, repair as repair_policy
from slurmagent.core import reasons
from slurmagent.state.config import parse
from slurmagent.gcp import metadata
from slurmagent.state.journal import Journal
from slurmagent.actions.executor import JournalExecutor
from slurmagent.slurm.model import node_from_kv
from slurmagent.slurm.commands import Slurm


@pytest.fixture
def node(tmp_path) -> Node:
    return Node(tmp_path)


def hook(node: Node, name: str = "prolog", job: str = "42", **env: str) -> subprocess.CompletedProcess:
    return node.slurmagent(name, env={"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": job, **env})


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


# --- malformed inputs: one line, nothing lost -------------------------------------------------


@pytest.mark.parametrize("content", [
    b'{"schema": 1, "gpus": [{"index": 0, ',  # torn write
    b'{"schema": 2, "gpus": []}',
    b"\xff\xfe not utf-8",
    b"[]",
    b'{"schema": 1, "gpus": [{"index": "zero"}]}',
    b"",
])
def test_malformed_snapshot_is_an_internal_error_not_a_gpu_fault(node, content):
    node.snapshot.write_bytes(content)
    proc = hook(node)
    assert proc.returncode == 0  # fail open: a broken agent must not drain the cluster
    line = one_line(proc.stderr)
    assert line.startswith("slurmagent prolog: internal error (not a GPU fault): ") and str(node.snapshot) in line
    assert node.calls() == []
    assert node.snapshot.read_bytes() == content  # nothing rewritten or removed
    decision = json.loads((node.state() / "hooks.log").read_text().splitlines()[-1])
    assert decision["verdict"] == "internal-error"

    closed = node.write_config(node.tmp / "closed.toml", hooks='on_internal_error = "closed"\n')
    proc = node.slurmagent("prolog", env={"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42"}, config=closed)
    assert proc.returncode == 1
    drain = node.calls()[-1]
    assert drain[:3] == ["update", "NodeName=n1", "State=DRAIN"]
    assert drain[3].startswith("Reason=slurmagent: internal error: ")


@pytest.mark.parametrize("text,key", [
    ('state_dir = "/x"\n[health\n', "not valid TOML"),
    ("[health]\ntimout_s = 3\n", "unknown key 'health.timout_s'"),
    ('[health]\ntimeout_s = "soon"\n', "'health.timeout_s' must be a number"),
    ("[hooks]\non_internal_error = \"maybe\"\n", "'hooks.on_internal_error' must be one of open, closed"),
])
def test_malformed_config_in_a_hook_is_one_line_and_the_file_is_kept(node, text, key):
    node.config.write_text(text)
    proc = hook(node)
    assert proc.returncode == 0
    line = one_line(proc.stderr)
    assert line.startswith(f"slurmagent prolog: internal error (not a GPU fault): config {node.config}") and key in line
    assert node.config.read_text() == text and node.calls() == []


class Canned:
    """An HTTP server answering every request with one canned reply (or, when hang, not before
    `hang` seconds). stop() ends every handler: a hung one returns without answering, so none
    outlives its test to write into a socket its client closed long ago, in another test."""

    def __init__(self, status: int = 200, body: bytes = b"", headers: dict[str, str] | None = None,
                 hang: float = 0.0):
        canned = self
        self.requests = 0
        self.stopping = threading.Event()
        self.connections: list[socket.socket] = []
        self.lock = threading.Lock()

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK wait

            def log_message(self, *a):
                pass

            def setup(self):
                super().setup()
                with canned.lock:
                    canned.connections.append(self.connection)
                    if canned.stopping.is_set():  # accepted as stop() began
                        canned.end(self.connection)

            def _reply(self):
                canned.requests += 1
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                if hang and canned.stopping.wait(hang):
                    self.close_connection = True  # stopped: the client gave up long ago
                    return
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _reply

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = False  # server_close() joins the handlers
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        self.url = f"http://{self.host}"

    def stop(self):
        with self.lock:
            self.stopping.set()
            for conn in self.connections:  # a kept-alive connection's handler waits for a next request
                self.end(conn)
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def end(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)


def drained_cluster(node: Node, *names: str) -> None:
    node.nodes_file.write_text(json.dumps({n: ["IDLE+DRAIN", XID79] for n in names}))


def repair_cfg(node: Node, endpoint: str, project_zone: bool = True, **repair: object) -> Path:
    cfg = node.write_config(node.tmp / "repair.toml", endpoint=endpoint, **repair)
    if not project_zone:
        cfg.write_text(cfg.read_text().replace('project = "p"\nzone = "z"\n', ""))
    return cfg


@pytest.mark.parametrize("reply", [
    dict(status=500, body=b"backend error", headers={"Metadata-Flavor": "Google"}),
    dict(status=200, body=b"<html>captive portal</html>", headers={"Content-Type": "text/html"}),
    dict(status=200, body=b"x", headers={"Metadata-Flavor": "Google"}, hang=60.0),
])
def test_malformed_metadata_answers_make_repair_fail_per_node_in_one_line(node, monkeypatch, capsys, reply):
    server = Canned(**reply)
    monkeypatch.setenv("GCE_METADATA_HOST", server.host)
    monkeypatch.setenv("SLURMD_NODENAME", "ctl")
    metadata.reset_cache()
    try:
        drained_cluster(node, "n1")
        from slurmagent.cli import main

        start = time.monotonic()
        code = main(["--config", str(repair_cfg(node, "http://127.0.0.1:9", project_zone=False)), "repair"])
        out, err = capsys.readouterr()
    finally:
        server.stop()
        metadata.reset_cache()
    # one metadata timeout (2 s), give or take a loaded machine; never the hung answer's 60 s
    assert time.monotonic() - start < 2 + 10 < 60 / 2
    assert code == 1
    line = one_line(err)
    assert line.startswith("repair: ") and "metadata server" in line
    assert not [c for c in node.calls() if c[0] == "update"]  # the node's reason is untouched


@pytest.mark.parametrize("body", [b"<html>502 Bad Gateway</html>", b"[]", b'{"metadata": "nope"}', b""])
def test_malformed_compute_answers_are_a_per_node_failure_not_a_traceback(node, monkeypatch, capsys, body):
    server = Canned(status=200, body=body, headers={"Content-Type": "application/json"})
    monkeypatch.setenv("SLURMD_NODENAME", "ctl")
    try:
        drained_cluster(node, "n1", "n2")
        from slurmagent.cli import main

        code = main(["--config", str(repair_cfg(node, server.url, operation_timeout_s=0.5)), "repair"])
        out, err = capsys.readouterr()
    finally:
        server.stop()
    assert code == 1, (out, err)
    lines = err.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["n1", "n2"], err
    assert all(": FAILED: " in ln for ln in lines), err
    if body in (b"", b"<html>502 Bad Gateway</html>"):
        assert all("cannot find its VM: instances.get: malformed response" in ln for ln in lines), err
    assert "Traceback" not in err
    assert not [c for c in node.calls() if c[0] == "update"]  # nothing marked repairing, nothing lost


# --- state dir full or read-only: the verdict stands -------------------------------------------


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "64k"):
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> None:
    with contextlib.suppress(OSError), open(path / "filler", "wb") as fh:
        while True:
            fh.write(b"\0" * 4096)
            fh.flush()
    with pytest.raises(OSError):  # really full now
        (path / "probe").write_bytes(b"\0" * 4096)


def seeded_state(node: Node) -> tuple[Path, bytes, Path]:
    """A judged kernel log (cursor at its end) and one pending journal entry, as before the disk filled."""
    state = node.state()
    node.kern.write_text("[ 1.0] NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=x, Graphics Exception\n")
    kernlog.commit_cursor(state, kernlog.Cursor(host.boot_id(), f"file:{node.kern}",
                                                node.kern.stat().st_size))
    entry = Journal(state / "journal").add("release", job_id="41", node="n1")
    return kernlog.cursor_path(state), kernlog.cursor_path(state).read_bytes(), state / "journal" / "pending" / entry.file


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_state_dir_full_or_read_only_hooks_still_give_their_verdict(node, fault):
    with tmpfs(node.state()):
        cursor, cursor_bytes, pending = seeded_state(node)
        pending_bytes = pending.read_bytes()
        if fault == "full":
            fill(node.state())
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(node.state())], check=True)
        # a new XID since the cursor, on GPU 3: unhealthy by the kernel log alone
        with node.kern.open("a") as fh:
            fh.write("[ 2.0] NVRM: Xid (PCI:0000:48:00): 79, pid=1, name=x, GPU has fallen off the bus.\n")
        node.set_snapshot(healthy_snapshot_dict(hostname="n1"))
        proc = hook(node)
        assert proc.returncode == 1, proc.stderr
        why = "No space left on device" if fault == "full" else "Read-only file system"
        assert why in proc.stderr and "kernel-log cursor not saved" in proc.stderr
        assert f"unhealthy: {XID79}" in proc.stderr
        assert DRAIN_N1 in node.calls()  # drained, unjournaled

        node.kern.write_text(node.kern.read_text().splitlines()[0] + "\n")  # the XID line gone again
        before = len(node.calls())
        proc = hook(node)
        assert proc.returncode == 0, proc.stderr  # healthy still runs the job
        assert cursor.read_bytes() == cursor_bytes and pending.read_bytes() == pending_bytes  # nothing lost
        assert not [p for p in node.state().rglob(".*.tmp")]  # no half-written temp files left
        assert all(c[0] != "update" for c in node.calls()[before:])

        node.set_snapshot(xid_snapshot_dict(79, gpu=3))  # unhealthy by the GPU state
        proc = hook(node, "epilog", job="43", SLURM_JOB_EXIT_CODE="1")
        assert proc.returncode == 0 and ["requeue", "43"] in node.calls(), proc.stderr


def test_short_writes_never_leave_a_torn_journal_entry_or_cursor(tmp_path, monkeypatch):
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))  # a nearly full disk
    entry = Journal(tmp_path / "journal").add("drain", node="n1", reason=XID79)
    kernlog.commit_cursor(tmp_path, kernlog.Cursor("boot", "file:/x", 123456))
    monkeypatch.undo()
    assert [e.payload for e in Journal(tmp_path / "journal").pending()] == [{"node": "n1", "reason": XID79}]
    assert Journal(tmp_path / "journal").pending()[0].id == entry.id
    assert kernlog.load_cursor(tmp_path) == kernlog.Cursor("boot", "file:/x", 123456)


# --- the wall clock steps back --------------------------------------------------------------


def test_clock_stepping_back_does_not_reorder_the_journal(tmp_path, monkeypatch):
    """drain then resume while slurmctld is down; the clock steps back 1 h in between (NTP).
    The replay must apply them in the order they were asked: the node ends resumed."""
    sc = FakeSlurm.cluster(4)
    cfg = parse({"state_dir": str(tmp_path / "state" / "%n"), "repair": {"max_drained_fraction": 1.0}})
    real_ns = time.time_ns
    step = [0]
    monkeypatch.setattr(time, "time_ns", lambda: real_ns() - step[0])
    sc.down = True
    assert JournalExecutor(cfg, Slurm(runner=sc), "n1").drain_fault(XID79).action.startswith("drain-failed: pending")
    step[0] = 3600 * 10**9
    assert JournalExecutor(cfg, Slurm(runner=sc), "n1").resume(XID79).startswith("pending")
    sc.down = False
    results = JournalExecutor(cfg, Slurm(runner=sc), "n1").replay()
    assert [(e.kind, o) for e, o in results] == [("drain", "drained"), ("resume", "resumed")]
    assert sc.nodes["n1"]["State"] == "IDLE" and sc.nodes["n1"]["Reason"] == ""


def test_entries_stamped_in_the_future_are_replayed_not_dropped(tmp_path):
    now = [1_000_000.0]
    j = Journal(tmp_path, max_age_s=60, clock=lambda: now[0])
    j.add("drain", node="n1", reason=XID79)
    now[0] -= 7200  # the clock went back two hours: the entry looks 2 h in the future
    ran = []
    results = j.replay({"drain": lambda e: ran.append(e.payload["node"]) or "drained"})
    assert ran == ["n1"] and [o for _, o in results] == ["drained"]


def test_breaker_and_repair_plan_with_marks_from_the_future():
    """slurmctld's clock ahead of ours (or ours stepped back): a suppression mark and a repair
    request stamped in the future still count, so nothing is drained or repaired twice."""
    future = time.time() + 3600
    nodes = [node_from_kv({"NodeName": "n1", "State": "IDLE",
                               "Comment": reasons.suppressed_comment(future, "xid 79 on gpu 3 (fallen off the bus)")}),
             node_from_kv({"NodeName": "n2", "State": "IDLE+DRAIN",
                               "Reason": f"{reasons.repairing_reason(XID79)} [root@{time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(future))}]"}),
             node_from_kv({"NodeName": "n3", "State": "IDLE"}), node_from_kv({"NodeName": "n4", "State": "IDLE"})]
    b = breaker_policy.breaker(nodes, 0.25, now=time.time())
    assert b.suppressed == ("n1",) and b.open
    plan = repair_policy.plan_repair(nodes, [], force=True, breaker_state=b, now=time.time())
    assert plan.todo == [] and plan.skipped["n2"].startswith("repair already requested")

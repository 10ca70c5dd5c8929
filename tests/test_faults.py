"""Faults: malformed inputs and answers give one clear line and lose nothing; a full or
read-only state dir still gives a verdict; the wall clock stepping back does not reorder the
journal; slurmctld restarting mid-requeue; Compute 429/5xx storms and lost replies.

scontrol is the recording script of test_hostile (`[slurm] scontrol`), except where the real
session cluster is used. The hypothesis fuzz of the snapshot and kernel-log parsers lives in
tests/test_snapshot.py and tests/test_kernlog.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import REPO, healthy_snapshot_dict, wait_for, xid_snapshot_dict
from fakes.slurm import FakeSlurm
from fake_gcp import FakeGcp
from test_hostile import DRAIN_N1, XID79, Node

from slurmagent.state import host
from slurmagent.gpu import kernlog
from slurmagent.policy import breaker as breaker_policy, repair as repair_policy
from slurmagent.core import reasons
from slurmagent.state.config import parse
from slurmagent.gcp import metadata
from slurmagent.gcp.compute import Compute
from slurmagent.state.journal import Journal
from slurmagent.actions.executor import JournalExecutor
from slurmagent.slurm.model import node_from_kv
from slurmagent.commands.repair import run_repair
from slurmagent.slurm.commands import Slurm

ZONE = "us-central1-a"
RECREATE = "instanceGroupManagers.recreateInstances"
RRECREATE = "regionInstanceGroupManagers.recreateInstances"


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


def test_malformed_remote_manifest_keeps_the_job_from_starting_and_the_checkpoint_intact(gcs_emulator, tmp_path,
                                                                                        monkeypatch):
    from google.cloud import storage

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.url)
    blob = storage.Client(project="test").bucket("ckpt").blob("jobs/t-task-0/manifest.json")
    blob.upload_from_string(b'{"schema": 1, "attempt": 0, "files": {"state.json": {"sha256": "zz"')
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}/state"\n[checkpoint]\nremote = "gs://ckpt/jobs"\n')
    started = tmp_path / "child-started"
    env = dict(os.environ, STORAGE_EMULATOR_HOST=gcs_emulator.url, SLURMAGENT_CONFIG=str(cfg), PYTHONPATH=str(REPO),
               CLOUD_RUN_JOB="t", CLOUD_RUN_TASK_INDEX="0", CLOUD_RUN_TASK_ATTEMPT="1")
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.run([sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(tmp_path / "ck"), "--",
                           sys.executable, "-c", f"open({str(started)!r}, 'w')"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr)
    assert "cannot restore the checkpoint" in line and "manifest" in line and "not starting" in line
    assert not started.exists()
    assert blob.download_as_bytes() == b'{"schema": 1, "attempt": 0, "files": {"state.json": {"sha256": "zz"'


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
    dict(status=200, body=b"x", headers={"Metadata-Flavor": "Google"}, hang=5.0),
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
    assert time.monotonic() - start < 5
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


# --- slurmctld restarts mid-requeue (real cluster) ----------------------------------------------


@pytest.mark.slurm
def test_epilog_requeue_journaled_while_slurmctld_is_down_is_done_after_it_is_back(slurm, tmp_path):
    c = slurm.cluster
    state = slurm.state_dir("n1")
    shutil.rmtree(state / "journal", ignore_errors=True)
    job = c.sbatch("-w", "n1", "-o", "/dev/null", "--requeue", "--wrap", "exit 3")
    c.wait_job(job, ("FAILED",), 30)
    slurm.set_snapshot("n1", xid_snapshot_dict(79, gpu=3))  # the GPU was bad while it ran
    env = dict(c.env, SLURMAGENT_CONFIG=str(slurm.config), PYTHONPATH=str(REPO), SLURMD_NODENAME="n1",
               SLURM_JOB_ID=job, SLURM_JOB_EXIT_CODE="3")
    c.stop_ctld()
    try:
        proc = subprocess.run([sys.executable, "-m", "slurmagent.entry", "epilog"], env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        pending = sorted(json.loads(p.read_text())["kind"] for p in (state / "journal" / "pending").glob("*.json"))
        assert pending == ["drain", "requeue"]
    finally:
        c.restart_ctld()
    slurm.set_snapshot("n1", healthy_snapshot_dict(hostname="n1"))
    wait_for(lambda: "NOT_RESPONDING" not in c.node("n1").get("State", "x"), 30, "n1 back")
    proc = subprocess.run([sys.executable, "-m", "slurmagent.entry", "journal", "--replay", "--node", "n1"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "requeue" in proc.stdout and "no pending actions" in proc.stdout
    info = c.job(job)
    assert info["Restarts"] == "1" and info["JobState"] in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")
    assert node_from_kv(c.node("n1")).reason == XID79


# --- Compute API storms -------------------------------------------------------------------------


@pytest.fixture
def gcp():
    fake = FakeGcp().start()
    for name in ("n1", "n2"):
        fake.add_instance(name, ZONE, mig="mig-a")
    fake.add_instance("n3", ZONE, mig="mig-r", region="us-central1")
    yield fake
    fake.stop()


def storm_cfg(tmp_path, deadline: float):
    return parse({"state_dir": str(tmp_path / "state" / "%n"),
                  "gcp": {"project": "test-proj", "zone": ZONE},
                  "repair": {"max_drained_fraction": 1.0, "operation_timeout_s": deadline}})


def test_429_500_storm_retried_within_the_deadline_reported_per_node_one_mutation(gcp, tmp_path):
    sc = FakeSlurm.cluster(3)
    for n in ("n1", "n2", "n3"):
        sc.nodes[n].update(State="IDLE+DRAIN", Reason=XID79)
    gcp.fail(RECREATE, 429, 500, 503)  # mig-a recovers on the 4th try
    gcp.fail(RRECREATE, *[500] * 500)  # mig-r never does
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    res = run_repair(storm_cfg(tmp_path, 3.0), [], slurm=Slurm(runner=sc), out=out, err=err, local_node="ctl",
                     compute_factory=lambda p: Compute(p, gcp.url, deadline_s=3.0, retries=1000, backoff_s=0.05))
    elapsed = time.monotonic() - start
    assert res.exit_code == 1 and elapsed < 8, (elapsed, out.getvalue(), err.getvalue())
    assert "n1: recreate requested via MIG zones/us-central1-a/instanceGroupManagers/mig-a" in out.getvalue()
    assert "n2: recreate requested via MIG" in out.getvalue()
    line = one_line(err.getvalue())
    assert line.startswith("n3: FAILED: regionInstanceGroupManagers.recreateInstances: HTTP 500")
    assert "deadline reached after" in line
    posts_a = gcp.calls_of(RECREATE)
    assert [c.status for c in posts_a] == [429, 500, 503, 200]
    assert len({c.query["requestId"] for c in posts_a}) == 1  # every retry the same request
    assert [gcp.instances[(ZONE, n)].recreated for n in ("n1", "n2", "n3")] == [1, 1, 0]
    assert sc.nodes["n3"]["Reason"] == XID79  # put back: the next run asks again
    assert sc.nodes["n1"]["Reason"] == reasons.repairing_reason(XID79)


def test_a_lost_reply_is_retried_with_the_same_request_id_and_acts_once(gcp, tmp_path):
    sc = FakeSlurm.cluster(3)
    sc.nodes["n1"].update(State="IDLE+DRAIN", Reason=XID79)
    slow = [1.5]

    def on_recreate(mig, names):  # the API acts, then its reply is too late for the client
        time.sleep(slow.pop() if slow else 0)

    gcp.on_recreate = on_recreate
    gcp._server.handle_error = lambda *a: None  # the late reply hits a closed socket: expected here
    out, err = io.StringIO(), io.StringIO()
    res = run_repair(storm_cfg(tmp_path, 10.0), ["n1"], slurm=Slurm(runner=sc), out=out, err=err, local_node="ctl",
                     compute_factory=lambda p: Compute(p, gcp.url, call_timeout_s=0.5, deadline_s=10.0,
                                                       backoff_s=0.05))
    assert res.exit_code == 0, err.getvalue()
    posts = gcp.calls_of(RECREATE)
    assert len(posts) >= 2 and len({c.query["requestId"] for c in posts}) == 1
    assert gcp.instances[(ZONE, "n1")].recreated == 1  # acted once

"""The wrapper -> root channel: a job's wrapper asks `watch` (root) for what it may not do itself.

Real Unix sockets and real uids (a child that drops to another uid connects, so SO_PEERCRED
tells the server who asks), the in-memory Slurm (tests/support/fakes/slurm.py) for the job's
owner, state and nodes, and the node's real metrics textfile.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import contextlib
from pathlib import Path

import pytest

from support.fakes.slurm import FakeSlurm
from slurmagent.actions.channel_client import ChannelMetrics, ask_root
from slurmagent.actions.job_channel import ChannelServer
from slurmagent.policy import job_requests
from slurmagent.policy.job_requests import RequestError, judge, parse_request
from slurmagent.slurm.commands import Slurm
from slurmagent.slurm.model import JobOwner
from slurmagent.state.config import parse
from slurmagent.state.decisionlog import DecisionLog, read_records

NOBODY = 65534


def req(**kw) -> bytes:
    return json.dumps({"op": "metrics", "job": "7", "node": "n1", **kw}).encode()


# --- the pure rules -----------------------------------------------------------------------------


@pytest.mark.parametrize("raw,why", [
    (b"x" * (job_requests.MAX_REQUEST_BYTES + 1), "request over 16384 bytes"),
    (b"not json", "request is not one JSON object"),
    (b"[1]", "request is not one JSON object"),
    (req(op="resume"), "unknown op 'resume' (metrics, drain, report, count, ping)"),
    (req(job="7; scontrol update"), "job must be a Slurm job id"),
    (req(set={"slurmagent_breaker_open": 0}), "'slurmagent_breaker_open' is not a job metric one may set"),
    (req(add={"slurmagent_checkpoint_lag_seconds": 1}), "'slurmagent_checkpoint_lag_seconds' is not a job metric one may add"),
    (req(set={"slurmagent_checkpoint_lag_seconds": -1}), "slurmagent_checkpoint_lag_seconds: value must be a number in [0, 1e+15]"),
    (req(set={"slurmagent_checkpoint_lag_seconds": "NaN"}), "slurmagent_checkpoint_lag_seconds: value must be a number in [0, 1e+15]"),
    (req(op="drain", rule="xid"), "drain rule must be one of hang, straggler"),
])
def test_a_malformed_request_is_refused_with_one_line(raw, why):
    with pytest.raises(RequestError) as exc:
        parse_request(raw)
    assert str(exc.value) == why


def test_only_a_running_job_of_the_asking_uid_on_this_node_is_granted():
    r = parse_request(req(set={"slurmagent_checkpoint_lag_seconds": 5}))
    mine = JobOwner("7", 1000, "RUNNING", ("n1", "n2"))
    assert judge(r, 1000, mine, "n1") == ""
    assert judge(r, 0, mine, "n1") == ""  # root's own wrapper
    assert judge(r, 1001, mine, "n1") == "job 7 does not belong to uid 1001"
    assert judge(r, 1000, None, "n1") == "job 7 is not known to Slurm"
    assert judge(r, 1000, JobOwner("7", 1000, "COMPLETING", ("n1",)), "n1") == "job 7 is COMPLETING, not RUNNING"
    assert judge(r, 1000, JobOwner("7", 1000, "RUNNING", ("n2",)), "n1") == "job 7 does not run on n1"
    assert judge(r, 1000, mine, "n2") == "node n1 is not this node (n2)"


def test_a_drain_may_name_another_node_of_the_job_never_one_outside_it():
    """A multi-node job's batch step asks its own node's root for the node its evidence names."""
    mine = JobOwner("7", 1000, "RUNNING", ("n1", "n2"))
    drain = parse_request(req(op="drain", node="n2", rule="hang", detail="rank 1 stopped at step 40"))
    assert judge(drain, 1000, mine, "n1") == ""
    outside = parse_request(req(op="drain", node="n9", rule="hang"))
    assert judge(outside, 1000, mine, "n1") == "node n9 is not one of job 7's"
    assert judge(drain, 1000, JobOwner("7", 1000, "RUNNING", ("n2", "n3")), "n1") == "job 7 does not run on n1"
    count = parse_request(req(op="count", node="n2", rule="hang"))
    assert judge(count, 1000, mine, "n1") == "node n2 is not this node (n1)"  # counted from the asker's node only
    with pytest.raises(RequestError, match="count rule must be one of hang"):
        parse_request(req(op="count", rule="straggler"))


def test_the_job_label_is_roots_and_a_drain_reason_is_cleaned():
    r = parse_request(req(set={"slurmagent_checkpoint_lag_seconds": 5}, add={"slurmagent_bytes_synced_total": 10}))
    set_, add, clear = job_requests.metric_update(r)
    assert set_ == {("slurmagent_checkpoint_lag_seconds", (("job_id", "7"),)): 5.0}
    assert add == {("slurmagent_bytes_synced_total", ()): 10.0} and clear is None
    d = parse_request(req(op="drain", rule="hang", detail="rank 1 stopped\nReason=evil State=RESUME"))
    assert job_requests.drain_reason(d) == "slurmagent: hang: job 7: rank 1 stopped Reason evil State RESUME"


# --- the server on a real socket ----------------------------------------------------------------


@pytest.fixture
def served(tmp_path):
    sc = FakeSlurm(("n1", "n2", "n3", "n4"))
    run = Path(tempfile.mkdtemp(prefix="sa-run-", dir="/tmp"))  # pytest's tmp_path is 0700: no other uid gets in
    run.chmod(0o755)
    cfg = parse({"state_dir": str(tmp_path / "state" / "%n"), "hooks": {"syslog": False},
                 "watch": {"channel_socket": str(run / "%n" / "channel.sock")},
                 "repair": {"max_drained_fraction": 0.5}})
    err = io.StringIO()
    server = ChannelServer(cfg, "n1", Slurm(runner=sc), DecisionLog(tmp_path / "state" / "n1" / "hooks.log"),
                           say=lambda line: err.write(line + "\n"), gpu_fault=lambda: "")  # a GPU check: healthy
    old = os.umask(0o027)  # the watch unit's
    try:
        server.start()
    finally:
        os.umask(old)
    yield server, sc, tmp_path
    server.stop()
    shutil.rmtree(run, ignore_errors=True)


def as_uid(uid: int, path, request: dict) -> dict:
    """Ask from a child process running as `uid` (the kernel tells the server who asks)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgid(uid)
            os.setuid(uid)
            os.write(w, json.dumps(ask_root(path, request)).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


@contextlib.contextmanager
def rank_process(job: str, uid: int = 0, stopped: bool = False, state: str = ""):
    """A rank of `job` on this node (its environment names the job, as under proctrack/linuxproc),
    running as `uid`, SIGSTOPped or not (or in `state` once there); its pid."""
    def become():  # pragma: no cover - in the child
        if uid:
            os.setgid(uid)
            os.setuid(uid)

    proc = subprocess.Popen(["sleep", "60"], env={"SLURM_JOB_ID": job, "PATH": os.environ["PATH"]},
                            preexec_fn=become)
    try:
        if stopped:
            os.kill(proc.pid, signal.SIGSTOP)
        want = "T" if stopped else state
        give_up = time.monotonic() + 5
        while want and open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != want:
            assert time.monotonic() < give_up, f"the rank did not reach {want}"
            time.sleep(0.01)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def prom(tmp_path) -> str:
    p = tmp_path / "state" / "n1" / "slurmagent.prom"
    return p.read_text() if p.exists() else ""


def test_the_socket_is_open_to_all_in_a_directory_only_root_changes(served):
    server, _, _ = served
    assert oct(server.path.stat().st_mode & 0o777) == "0o666"
    assert oct(server.path.parent.stat().st_mode & 0o777) == "0o755" and server.path.parent.stat().st_uid == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to ask as another uid")
def test_a_job_of_its_own_user_gets_its_metrics_into_the_node_textfile_another_user_does_not(served):
    server, sc, tmp_path = served
    sc.add_job("7", node="n[1-2]", Uid=str(NOBODY))
    sc.add_job("8", node="n1", Uid="1000")
    lag = {"op": "metrics", "job": "7", "node": "n1", "set": {"slurmagent_checkpoint_lag_seconds": 42.5}}
    assert as_uid(NOBODY, server.path, lag) == {"ok": True, "why": ""}
    assert 'slurmagent_checkpoint_lag_seconds{job_id="7"} 42.5\n' in prom(tmp_path)
    # another user's job: refused and logged, nothing written
    other = dict(lag, job="8", set={"slurmagent_checkpoint_lag_seconds": 1})
    assert as_uid(NOBODY, server.path, other) == {"ok": False, "why": f"job 8 does not belong to uid {NOBODY}"}
    assert 'job="8"' not in prom(tmp_path)
    [refused] = [r for r in read_records(tmp_path / "state" / "n1" / "hooks.log") if r["event"] == "job-request"]
    assert refused["verdict"] == "refused" and refused["uid"] == NOBODY and refused["job"] == "8"
    # the job ends: its own series goes, through the wrapper's sink
    sink = ChannelMetrics(server.path, "7", "n1", say=print)
    sink.update(replace_prefix='slurmagent_checkpoint_lag_seconds{job_id="7"}')
    assert "slurmagent_checkpoint_lag_seconds" not in prom(tmp_path)


def test_a_hang_drain_goes_through_the_breaker_once_per_job(served):
    server, sc, tmp_path = served
    sc.add_job("7", node="n[1-2]", Uid="0")
    with rank_process("7", stopped=True) as pid:
        ask = {"op": "drain", "job": "7", "node": "n1", "rule": "hang", "detail": "rank 1 stopped at step 40", "pid": pid}
        answer = ask_root(server.path, ask)
        assert answer["ok"] is True, answer
        assert sc.nodes["n1"]["Reason"] == "slurmagent: hang: job 7: rank 1 stopped at step 40"
        assert "DRAIN" in sc.nodes["n1"]["State"]
        again = ask_root(server.path, ask)
    assert again == {"ok": False, "why": "job 7 already asked for a drain from n1"}
    assert len(sc.of("scontrol", "update")) == 1
    [granted] = [r for r in read_records(tmp_path / "state" / "n1" / "hooks.log")
                 if r.get("op") == "drain" and r["verdict"] == "granted"]
    assert granted["evidence"] == f"root saw pid {pid} of job 7 stopped (T)"
    assert "slurmagent_hangs_total 1\n" in prom(tmp_path)  # root's own count of the hang it drained for


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to ask as another uid")
def test_a_users_word_drains_nothing_root_drains_on_what_it_sees_itself(served):
    """Before: any job's wrapper got a `drain` of its own node granted on its word alone (and the
    repair loop then recreated the VM, ending other jobs there)."""
    server, sc, tmp_path = served
    for job in ("7", "8", "9", "10"):
        sc.add_job(job, node="n[1-2]", Uid=str(NOBODY))

    def drain(job: str, pid: int) -> dict:
        return as_uid(NOBODY, server.path, {"op": "drain", "job": job, "node": "n1", "rule": "hang",
                                            "detail": "rank 0 stopped at step 9", "pid": pid})

    with rank_process("7", uid=NOBODY, state="S") as pid:  # a healthy rank, running (sleeping) as it should
        assert drain("7", pid) == {"ok": False, "why": f"root sees no fault on n1 (pid {pid} is running (S), no GPU "
                                                       "fault): a job's word alone drains nothing"}
    assert drain("8", 999999) == {"ok": False, "why": "root sees no fault on n1 (pid 999999 is not a process of job 8 "
                                                      "here, no GPU fault): a job's word alone drains nothing"}
    with rank_process("9", stopped=True) as pid:  # stopped, but root's own process: not nobody's rank
        assert drain("9", pid)["why"].startswith(f"root sees no fault on n1 (pid {pid} is not a process of job 9 here")
    assert "DRAIN" not in sc.nodes["n1"].get("State", "") and not sc.of("scontrol", "update")
    with rank_process("10", uid=NOBODY, stopped=True) as pid:  # the job's own rank, stopped
        assert drain("10", pid)["ok"] is True
    assert "DRAIN" in sc.nodes["n1"]["State"] and sc.nodes["n1"]["Reason"] == "slurmagent: hang: job 10: rank 0 stopped at step 9"


def test_a_zombie_rank_of_the_job_or_a_gpu_fault_root_sees_is_evidence(served):
    server, sc, tmp_path = served
    sc.add_job("7", node="n1", Uid="0")
    sc.add_job("8", node="n2", Uid="0")
    # a rank that exited and was not reaped: a zombie has no environment left, its parent names the job
    parent = subprocess.Popen([sys.executable, "-c", "import os, time\npid = os.fork()\nif pid == 0:\n    os._exit(0)\n"
                               "print(pid, flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE,
                              env={"SLURM_JOB_ID": "7", "PATH": os.environ["PATH"]}, text=True)
    try:
        zombie = int(parent.stdout.readline())
        give_up = time.monotonic() + 5
        while open(f"/proc/{zombie}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < give_up
            time.sleep(0.01)
        answer = ask_root(server.path, {"op": "drain", "job": "7", "node": "n1", "rule": "hang", "pid": zombie})
    finally:
        parent.kill()
        parent.wait()
    assert answer["ok"] is True, answer
    server.gpu_fault = lambda: "GPU 3: XID 79 (fallen off the bus)"  # root's own check, not the job's word
    sc.add_job("9", node="n1", Uid="0")
    sc.nodes["n1"]["State"] = "IDLE"
    assert ask_root(server.path, {"op": "drain", "job": "9", "node": "n1", "rule": "hang"})["ok"] is True
    [_, by_gpu] = [r for r in read_records(tmp_path / "state" / "n1" / "hooks.log") if r.get("op") == "drain"]
    assert by_gpu["evidence"] == "root's GPU check: GPU 3: XID 79 (fallen off the bus)"


def test_root_leaves_another_nodes_drain_to_that_nodes_root_and_counts_a_hang_against_its_own_node_once(served):
    from slurmagent.state import repair_state

    server, sc, tmp_path = served
    sc.add_job("7", node="n[1-2]", Uid="0")
    sc.add_job("8", node="n[1-3]", Uid="0")
    drain = {"op": "drain", "job": "7", "node": "n2", "rule": "hang", "detail": "rank 1 stopped at step 40", "pid": 4}
    assert ask_root(server.path, drain) == {
        "ok": False, "why": "root on n1 cannot see n2: that node's own root judges a drain of it"}
    assert "DRAIN" not in sc.nodes["n2"].get("State", "") and "DRAIN" not in sc.nodes["n1"].get("State", "")
    count = {"op": "count", "job": "8", "node": "n1", "rule": "hang", "detail": "rank 0 stuck outside the collective"}
    assert ask_root(server.path, count) == {"ok": False, "why": "no rank of job 8 named on n1 (pid none): a hang "
                                                                "counts only against the node its evidence names"}
    with rank_process("8") as pid:  # the job's rank here, which the evidence named (root sees it alive)
        assert ask_root(server.path, {**count, "pid": pid}) == {"ok": True, "why": "counted against n1"}
        assert ask_root(server.path, {**count, "pid": pid}) == {"ok": False, "why": "job 8 already counted a hang from n1"}
    hangs = repair_state.load_state(tmp_path / "state" / "n1")["hangs"]
    assert sorted(hangs) == ["n1"] and len(hangs["n1"]) == 1  # this node only, never the job's others
    [[_, why]] = repair_state.load_state(tmp_path / "state" / "n1")["hang_why"]["n1"]
    assert why == "job 8: rank 0 stuck outside the collective"  # the evidence that counted, for `report`
    assert "history" not in repair_state.load_state(tmp_path / "state" / "n1")  # not a repair: no repair budget spent
    assert "slurmagent_hangs_total 1\n" in prom(tmp_path)


def test_a_short_job_cannot_count_a_hang_against_its_nodes(served):
    """Before: a count was granted once per job per node: five one-second jobs made n1 a lemon."""
    from slurmagent.state import repair_state

    server, sc, tmp_path = served
    for job in ("1", "2", "3", "4", "5"):
        sc.add_job(job, node="n1", Uid="0", RunTime="0:01")
        with rank_process(job) as pid:
            answer = ask_root(server.path, {"op": "count", "job": job, "node": "n1", "rule": "hang", "pid": pid})
        assert answer == {"ok": False, "why": f"job {job} has run 1 s, less than hang_count_min_run_s (120 s): "
                                              "no hang counted"}
    assert "hangs" not in repair_state.load_state(tmp_path / "state" / "n1")
    sc.add_job("6", node="n1", Uid="0", RunTime="2:00")
    with rank_process("6") as pid:
        assert ask_root(server.path, {"op": "count", "job": "6", "node": "n1", "rule": "hang", "pid": pid})["ok"] is True


def test_a_flood_of_garbage_is_answered_and_the_server_still_serves(served):
    server, sc, tmp_path = served
    sc.add_job("7", node="n1", Uid="0")
    for raw in (b"x" * 20000, b"\xff\xfe\n", b"{}\n"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(server.path))
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
            answer = json.loads(s.makefile().readline())
            assert answer["ok"] is False and answer["why"]
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # connects and says nothing: timed out
    silent.connect(str(server.path))
    assert ask_root(server.path, {"op": "metrics", "job": "7", "node": "n1",
                                  "add": {"slurmagent_bytes_synced_total": 3}}, timeout_s=10)["ok"] is True
    silent.close()  # a hang-up without a word is idle, not a malformed request (no refusal line for it)
    assert "slurmagent_bytes_synced_total 3\n" in prom(tmp_path)
    give_up = time.monotonic() + 5
    while server.counts["idle"] < 1 and time.monotonic() < give_up:
        time.sleep(0.02)
    assert server.counts["idle"] == 1 and server.counts["malformed"] == 3


def test_no_watch_running_costs_the_job_one_line(tmp_path):
    said = []
    sink = ChannelMetrics(tmp_path / "absent.sock", "7", "n1", say=said.append)
    sink.update(set_={("slurmagent_flush_seconds", ()): 3.0})
    sink.update(set_={("slurmagent_flush_seconds", ()): 4.0})
    assert len(said) == 1 and "did not take this job's figures: no answer from" in said[0]


def test_a_straggler_report_goes_to_the_decision_log_only_and_is_bounded(served):
    server, sc, tmp_path = served
    sc.add_job("7", node="n[1-2]", Uid="0")
    ask = {"op": "report", "job": "7", "node": "n2", "rule": "straggler", "detail": "rank 3 straggles: 2.9x"}
    assert ask_root(server.path, ask) == {"ok": True, "why": "reported"}
    assert not sc.of("scontrol", "update") and "DRAIN" not in sc.nodes["n2"].get("State", "")
    [rec] = [r for r in read_records(tmp_path / "state" / "n1" / "hooks.log") if r.get("op") == "report"]
    assert rec["rule"] == "straggler" and rec["detail"] == "rank 3 straggles: 2.9x" and rec["job"] == "7"
    assert rec["about"] == "n2"  # the straggler's node, as the job named it (asked on the batch node n1)
    assert 'slurmagent_stragglers_total{node="n2"} 1\n' in prom(tmp_path)  # the batch node's textfile
    for _ in range(job_requests.MAX_REPORTS_PER_JOB - 1):
        assert ask_root(server.path, ask)["ok"] is True
    assert ask_root(server.path, ask) == {"ok": False, "why": f"job 7 already sent "
                                                              f"{job_requests.MAX_REPORTS_PER_JOB} reports to n1"}


def test_an_attempts_goodput_seconds_reach_the_node_by_part_and_a_made_up_part_does_not(served):
    from slurmagent.run.main import _record_goodput

    server, sc, tmp_path = served
    sc.add_job("7", node="n1", Uid="0")
    sink = ChannelMetrics(server.path, "7", "n1", say=print)
    # started 1000, restore 10 s, first progress 1030, last commit 1600, ended 1700 after a 5 s flush
    record = {"started": 1000.0, "restore_s": 10.0, "first_progress": 1030.0, "last_commit": 1600.0,
              "ended": 1700.0, "flush_s": 5.0, "end": "hang"}
    _record_goodput(sink, record)
    text = prom(tmp_path)
    for part, seconds in (("progress", 570), ("startup", 20), ("restore", 10), ("recompute", 95), ("flush", 5)):
        assert f'slurmagent_job_seconds_total{{part="{part}"}} {seconds}\n' in text, text
    assert "slurmagent_hangs_total" not in text  # a hang is root's to count (its drain or count), not the job's word
    bad = {"op": "metrics", "job": "7", "node": "n1", "add": {"slurmagent_job_seconds_total/idle": 5}}
    assert ask_root(server.path, bad) == {
        "ok": False, "why": "'slurmagent_job_seconds_total/idle' is not a job metric one may add"}


# --- against a hostile local user (issue 36) ----------------------------------------------------


def jreq(**kw) -> dict:
    return json.loads(req(**kw))


def raw_ask(path, raw: bytes, timeout: float = 5) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(raw)
        return json.loads(s.makefile().readline())


def test_a_deeply_nested_request_is_answered_and_the_channel_goes_on(served):
    """Before: json.loads raised RecursionError, nothing caught it and the channel thread died."""
    server, sc, tmp_path = served
    sc.add_job("7", node="n1", Uid="0")
    assert raw_ask(server.path, b"[" * 16000 + b"\n") == {"ok": False, "why": "request nested deeper than 3"}
    assert raw_ask(server.path, b'{"op": "metrics", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}\n")["ok"] is False
    assert server.alive()
    assert ask_root(server.path, jreq(add={"slurmagent_bytes_synced_total": 3}))["ok"] is True


def test_any_failure_inside_a_request_is_answered_counted_and_the_channel_goes_on(served):
    server, sc, tmp_path = served
    sc.add_job("7", node="n1", Uid="0")
    real = server.slurm.job_owner
    server.slurm.job_owner = lambda job: (_ for _ in ()).throw(KeyError("a bug"))
    answer = ask_root(server.path, jreq(op="drain", rule="hang"))
    assert answer == {"ok": False, "why": "root could not handle the request (KeyError); it was not taken"}
    assert server.counts["errors"] == 1 and server.alive()
    server.slurm.job_owner = real
    assert ask_root(server.path, jreq(add={"slurmagent_bytes_synced_total": 3}))["ok"] is True


def test_a_dead_serving_thread_is_seen_and_ends_the_watch_for_a_restart(tmp_path):
    from slurmagent.commands.watch import Watcher

    class Dead:
        failure = "RuntimeError: gone"

        def alive(self):
            return False

    cfg = parse({"state_dir": str(tmp_path / "state" / "%n"), "hooks": {"syslog": False},
                 "health": {"kernel_log_enabled": False}})
    err = io.StringIO()
    w = Watcher(cfg, "n1", use_nvml=False, interval=0.05, stderr=err)
    w.channel = Dead()
    assert w.run() == 1
    assert "the channel for wrapped jobs stopped (RuntimeError: gone): exiting for a restart" in err.getvalue()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to ask as another uid")
def test_a_flood_of_refusals_grows_roots_log_by_a_few_lines_with_their_count(served):
    """Before: one decision-log line per refused request (11.5 MB in 10 s from one uid)."""
    server, sc, tmp_path = served
    server.refusals.window_s = 0.5
    log = tmp_path / "state" / "n1" / "hooks.log"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: a uid with no job, asking as fast as it can for 2 s
        try:
            os.close(r)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            n, end = 0, time.monotonic() + 2.0
            while time.monotonic() < end:
                with contextlib.suppress(OSError, ValueError):
                    ask_root(server.path, {"op": "drain", "job": "99", "node": "n1", "rule": "hang"}, deadline_s=0.1)
                    n += 1
            os.write(w, str(n).encode())
        finally:
            os._exit(0)
    os.close(w)
    sent = int(os.read(r, 100) or b"0")
    os.close(r)
    os.waitpid(pid, 0)
    time.sleep(1.5)  # the window (0.5 s) ends and its summary is written
    records = [x for x in read_records(log) if x.get("uid") == NOBODY]
    assert sent > 100 and server.counts["refused"] == sent
    assert 2 <= len(records) <= 2 * 6  # the first at once, then one summary per window of 0.5 s over 2 s
    assert sum(x.get("count", 1) for x in records) == sent
    assert records[0]["why"] == "job 99 is not known to Slurm"
    assert log.stat().st_size < 8192


def test_a_job_that_ended_gets_no_drain_or_count_however_fresh_its_cached_trust(served):
    """Before: the owner was cached 30 s, so a cancelled job's id still drained and counted."""
    server, sc, tmp_path = served
    sc.add_job("7", node="n[1-2]", Uid="0")
    assert ask_root(server.path, jreq(set={"slurmagent_checkpoint_lag_seconds": 1}))["ok"] is True  # cached RUNNING
    sc.jobs["7"].update(JobState="CANCELLED")
    assert ask_root(server.path, jreq(op="drain", rule="hang")) == {"ok": False, "why": "job 7 is CANCELLED, not RUNNING"}
    assert ask_root(server.path, jreq(op="count", rule="hang")) == {"ok": False, "why": "job 7 is CANCELLED, not RUNNING"}
    assert "DRAIN" not in sc.nodes["n1"].get("State", "")


def test_a_requeued_job_still_sends_its_attempts_end_and_nothing_else(served):
    """After `scontrol requeue` the job is PENDING: root saw it running here, so its requeue count,
    flush seconds and series removal are taken; a lag, a drain, or another uid's ask are not."""
    server, sc, tmp_path = served
    sc.add_job("7", node="n1", Uid="0")
    assert ask_root(server.path, jreq(set={"slurmagent_checkpoint_lag_seconds": 4}))["ok"] is True
    sc.jobs["7"].update(JobState="PENDING", NodeList="(null)")
    server.owners.clear()  # as 30 s later
    end = jreq(add={"slurmagent_requeues_total": 1, "slurmagent_job_seconds_total/flush": 3},
              set={"slurmagent_flush_seconds": 3}, clear=True)
    assert ask_root(server.path, end) == {"ok": True, "why": ""}
    text = prom(tmp_path)
    assert "slurmagent_requeues_total 1\n" in text and 'slurmagent_checkpoint_lag_seconds{job_id="7"}' not in text
    assert ask_root(server.path, jreq(set={"slurmagent_checkpoint_lag_seconds": 4}))["ok"] is False
    assert ask_root(server.path, jreq(op="drain", rule="hang"))["ok"] is False
    assert ask_root(server.path, jreq(job="8", add={"slurmagent_requeues_total": 1}))["ok"] is False  # never seen here


@pytest.mark.parametrize("name,value", [("slurmagent_hangs_total", 2), ("slurmagent_requeues_total", 5),
                                        ("slurmagent_checkpoint_sync_errors_total", 1e15),
                                        ("slurmagent_job_seconds_total/flush", 1e9)])
def test_a_metric_delta_past_what_one_job_can_do_is_refused(served, name, value):
    """Before: up to 1e15 per request went into node-wide totals (3e15 after 3 requests)."""
    server, sc, tmp_path = served
    sc.add_job("7", node="n1", Uid="0")
    answer = ask_root(server.path, jreq(add={name: value}))
    assert answer["ok"] is False and "is more than one request may add" in answer["why"]
    assert name.split("/")[0] not in prom(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_forty_idle_connections_do_not_keep_a_wrapper_from_its_answer(served):
    """Before: one connection served at a time, up to 2 s each: ~40 idle ones from `nobody` made
    every legitimate request fail at once."""
    server, sc, tmp_path = served
    sc.add_job("7", node="n1", Uid="0")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: 40 connections as nobody, saying nothing
        try:
            os.close(r)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            held = []
            for _ in range(40):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(str(server.path))
                held.append(s)
            os.write(w, b"ready")
            time.sleep(30)
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 10) == b"ready"
        t = time.monotonic()
        assert ask_root(server.path, jreq(add={"slurmagent_bytes_synced_total": 3}))["ok"] is True
        assert time.monotonic() - t < 2.0  # answered before the idle ones even time out (a generous bound)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(r)


def test_past_its_connection_limit_a_uid_is_told_busy_and_its_wrapper_asks_again(served, monkeypatch):
    from slurmagent.actions import job_channel

    server, sc, tmp_path = served
    sc.add_job("7", node="n1", Uid="0")
    monkeypatch.setattr(job_channel, "MAX_PER_UID", 2)
    held = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
    for s in held:
        s.connect(str(server.path))
    time.sleep(0.3)  # both accepted
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as third:  # told at once, before it says anything
        third.settimeout(5)
        third.connect(str(server.path))
        assert json.loads(third.makefile().readline())["why"].startswith("busy:")
    for s in held:  # the limit frees as connections end: the retrying wrapper gets its answer
        s.close()
    assert ask_root(server.path, jreq(add={"slurmagent_bytes_synced_total": 3}), deadline_s=5)["ok"] is True
    assert server.counts["shed"] >= 1


def test_wrappers_side_by_side_each_get_their_answer_and_every_add_counts(served):
    import threading

    server, sc, tmp_path = served
    sc.add_job("7", node="n1", Uid="0")
    answers = []

    def one():
        answers.append(ask_root(server.path, jreq(add={"slurmagent_bytes_synced_total": 1}), deadline_s=10))

    threads = [threading.Thread(target=one) for _ in range(64)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert [a["ok"] for a in answers] == [True] * 64
    assert "slurmagent_bytes_synced_total 64\n" in prom(tmp_path)


def test_doctor_and_status_ask_the_channel_a_no_op_and_say_when_it_does_not_answer(served, tmp_path):
    """Before: a channel whose thread had died looked like one serving to every command."""
    from slurmagent.actions.channel_client import probe
    from slurmagent.commands.status import format_status, status_problems

    server, sc, _ = served
    state, detail = probe(server.cfg, "n1")
    assert state == "ok" and detail.startswith(f"{server.path} answers (serving") and not sc.calls
    server.stop()
    assert probe(server.cfg, "n1")[0] == "absent"
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # bound and listening, never answering
    stuck.bind(str(server.path))
    stuck.listen(4)
    try:
        state, detail = probe(server.cfg, "n1", timeout_s=0.5)
        assert state == "silent" and "does not answer" in detail
        st = {"nodes": [], "breaker": {"state": "closed", "summary": "closed"},
              "journal": {"journals": [], "unreadable": {}, "pending": 0}, "expiry": {},
              "channel": {"state": state, "detail": detail}, "slurm_error": None, "version": "x"}
        assert f"the job channel: {detail}" in status_problems(st)
        assert f"channel: {detail}" in format_status({**st, "problems": status_problems(st)})
    finally:
        stuck.close()


def test_a_retried_request_gets_its_first_answer_and_is_acted_on_once(served):
    """A wrapper whose answer was lost asks again with the same id: before, it was told 'already
    asked' (a drain) or counted twice (metrics); now it gets the first answer and nothing is done twice."""
    server, sc, tmp_path = served
    sc.add_job("7", node="n[1-2]", Uid="0")
    with rank_process("7", stopped=True) as pid:
        drain = {**jreq(op="drain", rule="hang", detail="rank 1 stopped"), "id": "a1", "pid": pid}
        first = ask_root(server.path, drain)
        assert first["ok"] is True
        assert ask_root(server.path, drain) == first  # the retry
        assert ask_root(server.path, {**drain, "id": "a2"}) == {
            "ok": False, "why": "job 7 already asked for a drain from n1"}
    assert len(sc.of("scontrol", "update")) == 1
    add = {**jreq(add={"slurmagent_bytes_synced_total": 5}), "id": "m1"}
    assert ask_root(server.path, add)["ok"] and ask_root(server.path, add)["ok"]
    assert "slurmagent_bytes_synced_total 5\n" in prom(tmp_path)  # counted once
    assert raw_ask(server.path, json.dumps({**add, "id": "no spaces"}).encode() + b"\n") == {
        "ok": False, "why": "id must be up to 64 letters, digits, - or _"}


def test_a_drain_of_another_node_is_asked_of_that_nodes_root_by_the_jobs_agent_there(served):
    """The batch step (on n2 here) names n1: root on n2 cannot see n1's processes, so the job's agent
    on n1 (`node-agent drain`) asks n1's root, which looks at the named rank itself."""
    from slurmagent.hang.remote import RemoteRanks
    from slurmagent.run.node_agent import ask_root_here

    server, sc, tmp_path = served
    sc.add_job("7", node="n[1-2]", Uid="0")
    asked = []

    def agents(args, deadline_s):  # the agent step: one task per node, each with its node name
        asked.append(args[:1])
        raw = args[args.index("--ask") + 1]
        return {0: ask_root_here(raw, "n1", 0), 1: ask_root_here(raw, "n2", 1)}

    batch = RemoteRanks("n2", tmp_path / "p", tmp_path / "ck", ask=agents)
    with rank_process("7", stopped=True) as pid:
        request = {"op": "drain", "job": "7", "node": "n1", "rule": "hang", "detail": "rank 1 stopped", "pid": pid,
                   "socket": str(server.path)}
        answer = batch.ask_root_there("n1", request)
    assert answer.startswith("granted: ") and asked == [["drain"]], answer
    assert "DRAIN" in sc.nodes["n1"]["State"] and sc.nodes["n1"]["Reason"] == "slurmagent: hang: job 7: rank 1 stopped"
    assert batch.ask_root_there("n3", {**request, "node": "n3"}) == "no answer from the job's agent on n3 within 60 s"


def test_a_straggler_drain_is_the_admins_choice_in_roots_own_config_not_the_jobs(served):
    """Slowness is a measure root cannot repeat: it drains a straggler's node only where its own
    config says `straggler_action = "drain"` (a job's config is its own to set)."""
    import dataclasses

    server, sc, tmp_path = served
    sc.add_job("7", node="n[1-2]", Uid="0")
    sc.add_job("8", node="n[1-2]", Uid="0")
    ask = {"op": "drain", "job": "7", "node": "n2", "rule": "straggler", "detail": "rank 3 straggles: 2.9x"}
    assert ask_root(server.path, ask) == {"ok": False, "why": "this node's config says straggler_action = report: "
                                                              "a straggler is reported, not drained"}
    assert "DRAIN" not in sc.nodes["n2"].get("State", "")
    server.cfg = dataclasses.replace(server.cfg, run=dataclasses.replace(server.cfg.run, straggler_action="drain"))
    assert ask_root(server.path, {**ask, "job": "8"})["ok"] is True
    assert sc.nodes["n2"]["Reason"] == "slurmagent: straggler: job 8: rank 3 straggles: 2.9x"


def test_each_job_of_a_user_has_its_own_budget_one_jobs_flood_spends_only_its_own(served):
    """Before: one budget per uid (16 requests waiting): a flood from one job of a user made the
    same user's other jobs on the node wait behind it (every worker held) or be told busy."""
    from slurmagent.actions import job_channel

    server, sc, tmp_path = served
    sc.add_job("7", node="n1", Uid="0")
    sc.add_job("8", node="n1", Uid="0")
    real = server.slurm.job_owner
    slurm_answers = threading.Event()

    def slow(job):  # Slurm slow to answer job 7: each request of its flood holds a worker until released
        if job == "7":
            slurm_answers.wait(10)
        return real(job)

    server.slurm.job_owner = slow
    flood = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(20)]
    try:
        for n, s in enumerate(flood):
            s.settimeout(10)
            s.connect(str(server.path))
            s.sendall(json.dumps({"op": "report", "job": "7", "node": "n1", "rule": "hang", "id": f"f{n}"}).encode() + b"\n")
        other = raw_ask(server.path, json.dumps({"op": "report", "job": "8", "node": "n1", "rule": "hang"}).encode()
                        + b"\n", timeout=10)
        slurm_answers.set()
        answers = [json.loads(s.makefile().readline()) for s in flood]
    finally:
        slurm_answers.set()
        for s in flood:
            s.close()
    assert other == {"ok": True, "why": "reported"}  # answered while job 7's flood held its own budget
    busy = [a for a in answers if a["why"].startswith("busy:")]
    assert len(busy) == 20 - job_channel.MAX_QUEUED_PER_JOB, answers


def test_an_array_tasks_rank_is_known_by_the_tasks_own_id(served):
    """An array task is `123_4` to squeue's %i, but its cgroup and SLURM_JOB_ID say its own id
    (%A, 127 here): root matches the rank by that, or every array job's drain was refused."""
    from slurmagent.slurm.model import owner_from_squeue

    assert owner_from_squeue("123_4|0|RUNNING|n1|1:00:00|127").own_id == "127"
    server, sc, tmp_path = served
    sc.add_job("123_4", node="n1", Uid="0", JobIdRaw="127")
    with rank_process("127", stopped=True) as pid:
        answer = ask_root(server.path, {"op": "drain", "job": "123_4", "node": "n1", "rule": "hang", "pid": pid})
    assert answer["ok"] is True, answer


def test_one_users_hangs_count_against_a_node_once_a_day_and_a_restart_of_watch_keeps_it(served, tmp_path):
    """Five hung jobs of one user on one bad day made a lemon of their node; now one count per
    user and node a day, kept in root's state: a new `watch` (a restart) still knows it."""
    from slurmagent.state import repair_state

    server, sc, tmp_path = served
    for job in ("11", "12"):
        sc.add_job(job, node="n1", Uid="0")
    with rank_process("11") as pid:
        assert ask_root(server.path, {"op": "count", "job": "11", "node": "n1", "rule": "hang", "pid": pid})["ok"]
    server.stop()  # watch restarts: a new server, the same state dir
    again = ChannelServer(server.cfg, "n1", server.slurm, server.log, say=lambda line: None, gpu_fault=lambda: "")
    again.start()
    try:
        with rank_process("12") as pid:
            answer = ask_root(again.path, {"op": "count", "job": "12", "node": "n1", "rule": "hang", "pid": pid})
        assert answer == {"ok": False, "why": "uid 0 already counted a hang against n1 in the last day"}
    finally:
        again.stop()
        server.start()  # the fixture stops it at the end
    assert len(repair_state.load_state(tmp_path / "state" / "n1")["hangs"]["n1"]) == 1

"""Faults: malformed inputs and answers give one clear line and lose nothing; a full or
read-only state dir still gives a verdict; the wall clock stepping back does not reorder the
journal; slurmctld restarting mid-requeue; Compute 429/5xx storms and lost replies.

scontrol is the recording script of test_hostile (`[slurm] scontrol`), except where the real
session cluster is used. The hypothesis fuzz of the snapshot and kernel-log parsers lives in
tests/unit/test_snapshot.py and tests/unit/test_kernlog.py.

The same subject without a cluster, emulator or fake server: tests/unit/test_faults.py.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from support import REPO, healthy_snapshot_dict, wait_for, xid_snapshot_dict
from support.fakes.slurm import FakeSlurm
from support.fake_gcp import FakeGcp
from test_hostile import XID79

from slurmagent.core import reasons
from slurmagent.state.config import parse
from slurmagent.gcp.compute import Compute
from slurmagent.slurm.model import node_from_kv
from slurmagent.commands.repair import run_repair
from slurmagent.slurm.commands import Slurm
from test_faults import one_line

ZONE = "us-central1-a"
RECREATE = "instanceGroupManagers.recreateInstances"
RRECREATE = "regionInstanceGroupManagers.recreateInstances"


# --- malformed inputs: one line, nothing lost -------------------------------------------------


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
    c.run(["scancel", job], check=False)  # requeued for n1 only: left pending, it would run (and fail) in a later test
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
    # each MIG's calls end at the 3 s deadline (idle: ~3-4 s in all); without it the 1000 retries of
    # mig-r, their backoff doubling to 30 s, would take hours: 20 s is room for a loaded machine
    assert res.exit_code == 3 and elapsed < 3.0 + 17, (elapsed, out.getvalue(), err.getvalue())  # 5xx to the end: no answer
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

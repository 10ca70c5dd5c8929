"""The repair loop on the real local Slurm cluster with a fake Compute API on 127.0.0.1.

The real google-cloud-compute and google-auth clients talk to tests/support/fake_gcp.py through
`[gcp] compute_endpoint`; Slurm is the session cluster n1..n3.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import pytest

from support import REPO, cluster_config_text, healthy_snapshot_dict, wait_for, xid_snapshot_dict
from support.fake_gcp import FakeGcp
from slurmagent.core import reasons
from slurmagent.slurm.model import node_from_kv

pytestmark = pytest.mark.slurm

ZONE = "us-central1-a"
XID79 = "slurmagent: xid 79 on gpu 3 (fallen off the bus)"
RECREATE = "instanceGroupManagers.recreateInstances"
RRECREATE = "regionInstanceGroupManagers.recreateInstances"


def clean_slurmagent_state(env) -> None:
    """No comment marks, journals or MIG caches leak between tests (or into others' tests)."""
    c = env.cluster
    c.run(["scontrol", "update", f"nodename={','.join(c.nodes)}", "comment="], check=False)
    for d in (env.root / "state").glob("*"):
        for name in ("journal", "repair-state.json", "breaker-suppressed", "expiry.json"):
            p = d / name
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists():
                p.unlink()


@pytest.fixture
def env(slurm):
    clean_slurmagent_state(slurm)
    yield slurm
    clean_slurmagent_state(slurm)


@pytest.fixture
def gcp():
    fake = FakeGcp().start()
    fake.add_instance("n1", ZONE, mig="mig-a")
    fake.add_instance("n2", ZONE, mig="mig-a")
    fake.add_instance("n3", ZONE, mig="mig-b")
    yield fake
    fake.stop()


def write_config(env, gcp, tmp_path, strategy="recreate", fraction=1.0) -> str:
    text = cluster_config_text(env.root)
    text += (f'[gcp]\nproject = "{gcp.project}"\nzone = "{ZONE}"\ncompute_endpoint = "{gcp.url}"\n'
             f'[repair]\nstrategy = "{strategy}"\nmax_drained_fraction = {fraction}\n')
    path = tmp_path / "repair.toml"
    path.write_text(text)
    return str(path)


@pytest.fixture
def cli(env, monkeypatch, capsys):
    """Run `slurmagent ARGS` in this process (the google import is paid once)."""
    from slurmagent.cli import main

    monkeypatch.setenv("SLURM_CONF", str(env.cluster.conf))
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)

    def run(config: str, *args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["--config", config, *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def drain(env, nodes: str, reason: str) -> None:
    env.cluster.run(["scontrol", "update", f"nodename={nodes}", "state=drain", f"reason={reason}"])


def reason(env, node: str) -> str:
    return node_from_kv(env.cluster.node(node)).reason


def requeued(job: dict[str, str]) -> bool:
    return job.get("JobState") == "PENDING" and int(job.get("Restarts", "0")) >= 1


# --- repair ------------------------------------------------------------------------------


def test_batches_one_call_per_mig_and_does_not_ask_twice(env, gcp, tmp_path, cli):
    cfg = write_config(env, gcp, tmp_path)
    drain(env, "n[1-3]", XID79)

    code, out, err = cli(cfg, "repair")

    assert code == 0, err
    recreates = gcp.calls_of(RECREATE)
    assert len(recreates) == 2  # 3 nodes in 2 MIGs
    by_mig = {c.path.rsplit("/", 2)[-2]: c.body["instances"] for c in recreates}
    assert by_mig == {"mig-a": [f"zones/{ZONE}/instances/n1", f"zones/{ZONE}/instances/n2"],
                      "mig-b": [f"zones/{ZONE}/instances/n3"]}
    assert all(c.query.get("requestId") for c in recreates)
    assert len(gcp.calls_of("instances.get")) == 3 and len(gcp.calls_of("zoneOperations.get")) == 2
    for n in ("n1", "n2", "n3"):
        assert reason(env, n) == "slurmagent: repairing: xid 79 on gpu 3 (fallen off the bus)"
        assert f"{n}: recreate requested via MIG zones/{ZONE}/instanceGroupManagers/mig-" in out

    code, out, err = cli(cfg, "repair")
    assert code == 0, err
    assert len(gcp.mutations) == 2  # nothing asked twice
    assert out.count("repair already requested") == 3


def test_regional_mig(env, gcp, tmp_path, cli):
    gcp.add_instance("n2", ZONE, mig="mig-r", region="us-central1")
    cfg = write_config(env, gcp, tmp_path)
    drain(env, "n2", "slurmagent: gpu-lost: gpu 1 GPU is lost (NVML_ERROR_GPU_IS_LOST)")

    code, out, err = cli(cfg, "repair", "n2")

    assert code == 0, err
    [call] = gcp.calls_of(RRECREATE)
    assert call.path == "/compute/v1/projects/test-proj/regions/us-central1/instanceGroupManagers/mig-r/recreateInstances"
    assert call.body == {"instances": [f"zones/{ZONE}/instances/n2"]}
    assert gcp.calls_of("regionOperations.get") and not gcp.calls_of("zoneOperations.get")
    assert "regions/us-central1/instanceGroupManagers/mig-r" in out


def test_regional_mig_in_two_zones_repaired_in_one_run(env, gcp, tmp_path, cli):
    gcp.add_instance("n1", ZONE, mig="mig-r", region="us-central1")
    gcp.add_instance("n2", "us-central1-b", mig="mig-r", region="us-central1")
    del gcp.instances[(ZONE, "n2")]
    cfg = write_config(env, gcp, tmp_path, strategy="auto")
    drain(env, "n[1-2]", XID79)

    code, out, err = cli(cfg, "repair")

    assert code == 0, err
    [call] = gcp.calls_of(RRECREATE)
    assert call.body == {"instances": [f"zones/{ZONE}/instances/n1", "zones/us-central1-b/instances/n2"]}
    assert len(gcp.calls_of("instances.aggregatedList")) == 1
    assert all(reason(env, n).startswith("slurmagent: repairing:") for n in ("n1", "n2"))


def test_an_admins_resume_cancels_our_pending_repair(env, gcp, tmp_path, cli):
    cfg = write_config(env, gcp, tmp_path, strategy="auto")
    drain(env, "n1", XID79)
    code, out, err = cli(cfg, "repair")
    assert code == 0 and len(gcp.mutations) == 1, err
    env.cluster.resume("n1")  # the admin: `scontrol update nodename=n1 state=resume`

    code, out, err = cli(cfg, "repair")

    assert code == 0, err
    assert "n1: repair cancelled: n1 resumed by hand" in out and len(gcp.mutations) == 1
    done = [json.loads(p.read_text()) for p in (env.root / "state").glob("*/journal/done/*.json")]
    assert [d["payload"]["node"] for d in done if d["kind"] == "repair_cancelled"] == ["n1"]


def test_opt_out_feature_keeps_slurmagent_off_the_node(env, gcp, tmp_path, cli):
    c = env.cluster
    c.run(["scontrol", "update", "nodename=n2", "availablefeatures=slurmagent_off", "activefeatures=slurmagent_off"])
    try:
        env.set_snapshot("n2", xid_snapshot_dict(79, gpu=3))
        out = tmp_path / "out"
        job = c.sbatch("-w", "n2", "-o", str(out), "--wrap", "echo ran on $SLURMD_NODENAME")
        assert c.wait_job(job, ("COMPLETED", "FAILED"), 60)["JobState"] == "COMPLETED"  # hands off: the job ran
        assert "DRAIN" not in c.node("n2")["State"]
        decision = [d for d in env.decisions("n2") if d.get("job") == job][-1]
        assert decision["action"].startswith("excluded (node feature slurmagent_off)")
    finally:
        c.run(["scontrol", "update", "nodename=n2", "availablefeatures=", "activefeatures="], check=False)
    assert "slurmagent_off" not in c.node("n2").get("AvailableFeatures", "")


def test_admin_drain_untouched(env, gcp, tmp_path, cli):
    cfg = write_config(env, gcp, tmp_path)
    drain(env, "n1", "admin: swap PSU")
    drain(env, "n2", XID79)

    code, out, err = cli(cfg, "repair")
    assert code == 0, err
    assert [c.body["instances"] for c in gcp.calls_of(RECREATE)] == [[f"zones/{ZONE}/instances/n2"]]
    assert reason(env, "n1") == "admin: swap PSU"

    code, out, err = cli(cfg, "repair", "n1")
    assert code == 1
    assert "n1: refused: drained by someone else (reason 'admin: swap PSU')" in err
    assert len(gcp.mutations) == 1 and reason(env, "n1") == "admin: swap PSU"


def test_dry_run_sends_nothing(env, gcp, tmp_path, cli):
    cfg = write_config(env, gcp, tmp_path)
    drain(env, "n1", XID79)

    code, out, err = cli(cfg, "repair", "--dry-run")

    assert code == 0, err
    assert "n1: would recreate via its MIG (looked up at run time) (xid 79 on gpu 3 (fallen off the bus))" in out
    assert gcp.calls == []
    assert reason(env, "n1") == XID79
    assert not list((env.root / "state").glob("*/journal/pending/*.json"))


def test_429_then_success_retries_with_the_same_request_id(env, gcp, tmp_path, cli):
    cfg = write_config(env, gcp, tmp_path)
    drain(env, "n3", XID79)
    gcp.fail(RECREATE, 429)

    code, out, err = cli(cfg, "repair")

    assert code == 0, err
    calls = gcp.calls_of(RECREATE)
    assert [c.status for c in calls] == [429, 200]
    assert calls[0].query["requestId"] == calls[1].query["requestId"]
    assert reason(env, "n3").startswith("slurmagent: repairing:")


def test_403_is_reported_not_retried_and_reason_restored(env, gcp, tmp_path, cli):
    cfg = write_config(env, gcp, tmp_path)
    drain(env, "n1", XID79)
    drain(env, "n3", XID79)
    gcp.fail(RECREATE, 403)  # the first MIG (mig-a, n1) is refused; mig-b goes through

    code, out, err = cli(cfg, "repair")

    assert code == 1
    assert "n1: FAILED: instanceGroupManagers.recreateInstances: HTTP 403" in err
    assert [c.status for c in gcp.calls_of(RECREATE)] == [403, 200]
    assert reason(env, "n1") == XID79  # not `repairing`: the next run asks again
    assert reason(env, "n3").startswith("slurmagent: repairing:")
    done = [json.loads(p.read_text()) for p in (env.root / "state").glob("*/journal/done/*.json")]
    assert sorted(d["outcome"].split(":")[0] for d in done if d["kind"] == "repair") == ["failed", "requested"]


def test_instance_lookup_404_is_reported(env, gcp, tmp_path, cli):
    cfg = write_config(env, gcp, tmp_path)
    del gcp.instances[(ZONE, "n2")]
    drain(env, "n2", XID79)
    code, out, err = cli(cfg, "repair")
    assert code == 1 and "n2: FAILED: cannot find its VM: instances.get: HTTP 404" in err
    assert gcp.mutations == []


def test_report_faulty_strategy(env, gcp, tmp_path, cli):
    cfg = write_config(env, gcp, tmp_path, strategy="report-faulty")
    for n in ("n1", "n2"):  # reservation-bound: Google takes the reports
        gcp.instances[(ZONE, n)].provisioning_model = "RESERVATION_BOUND"
    drain(env, "n1", XID79)
    drain(env, "n2", "slurmagent: hw-slowdown: gpu 0 clocks slowed by hw_power_brake_slowdown")

    code, out, err = cli(cfg, "repair")

    assert code == 0, err
    calls = {c.path.split("/")[-2]: c.body for c in gcp.calls_of("instances.reportHostAsFaulty")}
    assert calls["n1"]["disruptionSchedule"] == "IMMEDIATE"
    assert calls["n1"]["faultReasons"][0]["behavior"] == "UNRECOVERABLE_GPU_ERROR"
    assert calls["n2"]["faultReasons"][0]["behavior"] == "PERFORMANCE"
    assert gcp.calls_of("instances.get") == []  # report-faulty needs no MIG
    assert [m.kind for m in gcp.mutations] == ["instances.reportHostAsFaulty"] * 2


def test_auto_flex_vms_recreated_per_mig_reserved_a3_ultra_reported_refusal_falls_back(env, gcp, tmp_path, cli):
    """One run, real Slurm: two flex-start VMs of one MIG get ONE recreateInstances, a
    reservation-bound A3 Ultra VM gets reportHostAsFaulty; a refused report is recreated instead."""
    for n, facts in (("n1", {"provisioning_model": "FLEX_START"}), ("n2", {"provisioning_model": "FLEX_START"}),
                     ("n3", {"provisioning_model": "RESERVATION_BOUND", "reservation": "SPECIFIC_RESERVATION"})):
        for key, value in {"machine_type": "a3-ultragpu-8g", **facts}.items():
            setattr(gcp.instances[(ZONE, n)], key, value)
    cfg = write_config(env, gcp, tmp_path, strategy="auto")
    drain(env, "n[1-3]", XID79)

    code, out, err = cli(cfg, "repair")

    assert code == 0, err
    [rec] = gcp.calls_of(RECREATE)
    assert rec.path.endswith("/mig-a/recreateInstances")
    assert rec.body["instances"] == [f"zones/{ZONE}/instances/n1", f"zones/{ZONE}/instances/n2"]
    [rep] = gcp.calls_of("instances.reportHostAsFaulty")
    assert rep.path.split("/")[-2] == "n3" and rep.body["faultReasons"][0]["behavior"] == "UNRECOVERABLE_GPU_ERROR"
    assert "n3: reported host as faulty (UNRECOVERABLE_GPU_ERROR)" in out
    assert all(reason(env, n).startswith("slurmagent: repairing:") for n in ("n1", "n2", "n3"))

    # the next fault on n3: Google refuses the report now; the run recreates it instead
    env.cluster.resume("n3")
    gcp.instances[(ZONE, "n3")].refuse = "INSTANCES_WITHOUT_RESERVATION_NOT_SUPPORTED"
    drain(env, "n3", XID79)
    code, out, err = cli(cfg, "repair", "n3")
    assert code == 0, err
    assert [c.path.rsplit("/", 2)[-2] for c in gcp.calls_of(RECREATE)] == ["mig-a", "mig-b"]
    assert "n3: reportHostAsFaulty refused" in out and "recreate requested via MIG" in out
    assert reason(env, "n3").startswith("slurmagent: repairing:")


def test_strategy_none_drains_only(env, gcp, tmp_path, cli):
    cfg = write_config(env, gcp, tmp_path, strategy="none")
    drain(env, "n1", XID79)
    code, out, err = cli(cfg, "repair")
    assert code == 0 and "drained only" in out and gcp.calls == []


def test_open_breaker_suppresses_repairs_and_force_overrides(env, gcp, tmp_path, cli):
    cfg = write_config(env, gcp, tmp_path, fraction=0.25)  # 3 nodes: 1 may be drained
    drain(env, "n[1-2]", XID79)

    code, out, err = cli(cfg, "repair")
    assert code == 0
    assert "CIRCUIT BREAKER OPEN" in err and "suppressed" in err
    assert gcp.calls == []

    code, out, err = cli(cfg, "repair", "--force")
    assert code == 0, err
    assert len(gcp.calls_of(RECREATE)) == 1 and len(gcp.calls_of(RECREATE)[0].body["instances"]) == 2


# --- resume-if-healthy, status --------------------------------------------------------------


def test_resume_if_healthy(env, gcp, tmp_path, cli):
    cfg = write_config(env, gcp, tmp_path)
    drain(env, "n1", reasons.repairing_reason(XID79))
    drain(env, "n2", "admin: swap PSU")

    code, out, err = cli(cfg, "resume-if-healthy", "--node", "n1", "--wait", "10")
    assert code == 0, err
    assert "n1: healthy; resumed" in out
    assert "DRAIN" not in env.cluster.node("n1")["State"]

    code, out, err = cli(cfg, "resume-if-healthy", "--node", "n2", "--wait", "10")
    assert code == 0 and "left alone" in out
    assert reason(env, "n2") == "admin: swap PSU"

    code, out, err = cli(cfg, "resume-if-healthy", "--node", "n3", "--wait", "10")
    assert code == 0 and "nothing to do" in out


def test_a_static_node_recreated_after_its_flex_expiry_resumes_by_itself(env, gcp, tmp_path, cli):
    """The expiry watch drained n1 ahead of its flex end; the VM went away and the MIG made a new
    one: slurmd of the new boot registers and resume-if-healthy (at boot) resumes it."""
    cfg = write_config(env, gcp, tmp_path)
    expiry = "slurmagent: expiry: flex expiry at 2026-11-30T10:00:00Z"
    drain(env, "n1", expiry)
    state = env.root / "state" / "n1" / "expiry.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"schema": 1, "boot_id": "the-old-vm", "termination_time": "2026-11-30T10:00:00Z",
                                 "drained": True, "drain_reason": expiry}))
    c = env.cluster
    c.stop_node("n1")  # the flex VM is gone ...
    c.start_node("n1")  # ... and the MIG's new VM boots

    code, out, err = cli(cfg, "resume-if-healthy", "--node", "n1", "--wait", "60")

    assert code == 0, err
    assert f"n1: healthy; resumed (was: {expiry})" in out
    wait_for(lambda: "DRAIN" not in c.node("n1")["State"], 10, "n1 resumed")
    assert gcp.calls == []  # nothing recreated by slurmagent: the expiry drain is never repaired


def test_resume_if_healthy_unhealthy_stays_drained_with_new_reason(env, gcp, tmp_path, cli):
    cfg = write_config(env, gcp, tmp_path)
    drain(env, "n1", reasons.repairing_reason(XID79))
    env.set_snapshot("n1", xid_snapshot_dict(48, gpu=5))

    code, out, err = cli(cfg, "resume-if-healthy", "--node", "n1", "--wait", "10")

    assert code == 1
    assert "UNHEALTHY" in out
    node = env.cluster.node("n1")
    assert "DRAIN" in node["State"] and node_from_kv(node).reason.startswith("slurmagent: xid 48 on gpu 5")


def test_status_table_and_json(env, gcp, tmp_path, cli):
    cfg = write_config(env, gcp, tmp_path)
    drain(env, "n1", XID79)
    drain(env, "n2", reasons.repairing_reason("slurmagent: gpu-lost: gpu 1 GPU is lost"))
    expiry = env.root / "state" / "n1" / "expiry.json"
    expiry.parent.mkdir(parents=True, exist_ok=True)
    # 3 h 5 min ahead: the two status runs below may take minutes on a loaded machine and still
    # read "in 3h0Xm" (an hour's error, a sign or a time zone would not)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3 * 3600 + 300))
    expiry.write_text(json.dumps({"termination_time": when}))

    code, out, err = cli(cfg, "status")
    assert code == 1, err  # n1 is drained for a fault: a problem (n2 too)
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["NODE", "STATE", "RULE", "SINCE", "REPAIR"]
    n1 = next(line for line in lines if line.startswith("n1 "))
    n2 = next(line for line in lines if line.startswith("n2 "))
    assert "xid 79" in n1 and " drained " in n1 and re.search(r"in 3h0[0-5]m", n1), n1
    assert "gpu-lost" in n2 and "repairing" in n2
    assert "breaker: off" in out and "journal: no pending actions" in out
    assert f"expiry: n1 terminates {when}" in out

    code, out, err = cli(cfg, "status", "--json")
    st = json.loads(out)
    assert code == st["exit_code"] == 1 and st["problems"] == ["2 node(s) drained by slurmagent for a fault: n[1-2]"]
    rows = {r["node"]: r for r in st["nodes"]}
    assert rows["n1"]["rule"] == "xid 79" and rows["n1"]["repair"] == "drained" and 0 <= rows["n1"]["for_s"] < 600
    assert 3 * 3600 <= rows["n1"]["expiry"]["in_s"] <= 3 * 3600 + 300
    assert rows["n2"]["repair"] == "repairing" and st["journal"]["pending"] == 0


# --- journal: slurmctld down while the prolog drains ---------------------------------------


def hook(env, hook_name: str, node: str, job: str = "990001", timeout: float = 60) -> subprocess.CompletedProcess:
    e = dict(env.cluster.env, SLURMAGENT_CONFIG=str(env.config), PYTHONPATH=str(REPO), SLURMD_NODENAME=node,
             SLURM_JOB_ID=job)
    return subprocess.run([sys.executable, "-m", "slurmagent.entry", hook_name], env=e, capture_output=True,
                          text=True, timeout=timeout)


def test_prolog_with_slurmctld_down_journals_the_drain(env):
    c = env.cluster
    env.set_snapshot("n1", xid_snapshot_dict(79, gpu=3))
    pending = env.root / "state" / "n1" / "journal" / "pending"
    c.stop_ctld()
    try:
        start = time.monotonic()
        proc = hook(env, "prolog", "n1")
        elapsed = time.monotonic() - start
        assert proc.returncode == 1, proc.stderr  # the job still may not run here
        # one MessageTimeout (10 s) on the dead controller, then the journal: idle, ~10 s in all.
        # The bound is what slurmd allows a prolog (the cluster's PrologEpilogTimeout, 60 s),
        # less a margin: a loaded machine stretches the run, a prolog retrying the controller
        # would pass it.
        assert elapsed < 45, elapsed
        entries = [json.loads(p.read_text()) for p in pending.glob("*.json")]
        assert [(e["kind"], e["payload"]["node"], e["payload"]["reason"]) for e in entries] == [("drain", "n1", XID79)]
        assert "unreachable" in entries[0]["last_error"]
        decision = [d for d in env.decisions("n1") if d.get("job") == "990001"][-1]
        assert decision["verdict"] == "unhealthy" and decision["action"].startswith("drain-failed: pending in the journal")
    finally:
        c.restart_ctld()
    wait_for(lambda: "NOT_RESPONDING" not in c.node("n1").get("State", "x"), 30, "n1 back")
    assert "DRAIN" not in c.node("n1")["State"]

    env.set_snapshot("n1", healthy_snapshot_dict(hostname="n1"))  # the next job's prolog: healthy now
    proc = hook(env, "prolog", "n1", job="990002")

    assert proc.returncode == 0, proc.stderr
    node = c.node("n1")
    assert "DRAIN" in node["State"] and node_from_kv(node).reason == XID79
    assert not list(pending.glob("*.json"))
    done = [json.loads(p.read_text()) for p in (pending.parent / "done").glob("*.json")]
    assert [d["outcome"] for d in done if d["kind"] == "drain"] == ["drained"]


# --- the full loop ---------------------------------------------------------------------------


@pytest.mark.slow
def test_full_loop_drain_repair_recreate_resume_runs_pending_job(env, gcp, tmp_path):
    c = env.cluster
    cfg = write_config(env, gcp, tmp_path, fraction=0.25)
    e = dict(c.env, SLURMAGENT_CONFIG=cfg, PYTHONPATH=str(REPO))
    e.pop("SLURMD_NODENAME", None)

    def slurmagent(*args, node=None, timeout=60):
        env_ = dict(e, SLURMD_NODENAME=node) if node else e
        return subprocess.run([sys.executable, "-m", "slurmagent.entry", *args], env=env_, capture_output=True,
                              text=True, timeout=timeout)

    env.set_snapshot("n1", xid_snapshot_dict(79, gpu=3))
    out = tmp_path / "out"
    job = c.sbatch("-w", "n1", "-o", str(out), "--wrap", "echo ran on $SLURMD_NODENAME")
    # PENDING alone is also the state before the first start: wait for the requeue itself.
    wait_for(lambda: requeued(c.job(job)), 60, "the failed prolog to requeue the job")
    assert node_from_kv(c.node("n1")).ours and reason(env, "n1") == XID79

    recreated = []
    gcp.on_recreate = lambda mig, names: recreated.extend(names)
    proc = slurmagent("repair")
    assert proc.returncode == 0, proc.stderr
    assert recreated == ["n1"] and len(gcp.mutations) == 1
    assert reason(env, "n1") == reasons.repairing_reason(XID79)

    # The MIG recreates the VM: slurmd goes away and comes back on a healthy machine. Its
    # boot time stays the host's, so wait for the new slurmd's registration here as the
    # boot-time check in resume-if-healthy would on a real VM.
    registered_at = c.node("n1")["SlurmdStartTime"]
    c.stop_node("n1")
    env.set_snapshot("n1", healthy_snapshot_dict(hostname="n1"))
    time.sleep(1)  # SlurmdStartTime has a 1 s resolution
    c.start_node("n1")
    wait_for(lambda: c.node("n1").get("SlurmdStartTime") not in (registered_at, None), 60, "the new slurmd")
    proc = slurmagent("resume-if-healthy", node="n1")  # what slurmagent-resume.service runs at boot
    assert proc.returncode == 0, proc.stderr
    assert "n1: healthy; resumed" in proc.stdout

    done = c.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED"), 90)
    assert done["JobState"] == "COMPLETED" and done["NodeList"] == "n1"
    assert "ran on n1" in out.read_text()
    assert len(gcp.mutations) == 1

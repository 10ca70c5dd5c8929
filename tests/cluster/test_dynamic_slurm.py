"""Dynamic (CLOUD) nodes on a real local Slurm cluster with power saving: slurmctld powers a
node up for a job (ResumeProgram starts its slurmd, like a fresh VM) and down when told
(SuspendProgram kills it). A node our prolog drains is powered down by `repair`
(POWER_DOWN_ASAP with our reason), never recreated through the Compute API, and the pending
job gets a node; the powered-down node comes back fresh for a later job.

This module starts its own cluster (c1, c2 CLOUD; s1 static, kept drained), not the session's.
"""

from __future__ import annotations


import pytest

from support import healthy_snapshot_dict, hook_shim, need_slurm, wait_for, write_json, xid_snapshot_dict
from support.fake_gcp import FakeGcp
from slurmagent.core import reasons
from slurmagent.devtools.localcluster import LocalSlurmCluster
from slurmagent.slurm.model import node_from_kv

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

XID79 = "slurmagent: xid 79 on gpu 3 (fallen off the bus)"


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    need_slurm()
    root = tmp_path_factory.mktemp("cloud")
    root.chmod(0o755)
    for node in ("s1", "c1", "c2"):
        write_json(root / "snap" / f"{node}.json", healthy_snapshot_dict(hostname=node))
        (root / "kern").mkdir(exist_ok=True)
        (root / "kern" / f"{node}.log").touch()
    config = root / "config.toml"
    config.write_text(f'state_dir = "{root}/state/%n"\n[health]\nsnapshot = "{root}/snap/%n.json"\n'
                      f'kernel_log = "{root}/kern/%n.log"\nexpected_gpus = 8\ntimeout_s = 5\n'
                      '[hooks]\nsyslog = false\n')
    (root / "hooks").mkdir()
    cluster = LocalSlurmCluster(root / "slurm", nodes=["s1", "c1", "c2"], cloud_nodes=["c1", "c2"],
                                prolog=str(hook_shim(root / "hooks" / "prolog", "prolog", config)))
    cluster.start()
    cluster.run(["scontrol", "update", "nodename=s1", "state=drain", "reason=test: jobs go to the cloud nodes"])
    yield cluster, root, config
    cluster.stop()


def state(cluster, node: str) -> set[str]:
    return set(cluster.node(node).get("State", "").split("+"))


def test_a_dynamic_node_drained_by_the_prolog_is_powered_down_not_recreated(cloud, tmp_path, monkeypatch, capsys):
    from slurmagent.cli import main

    cluster, root, config = cloud
    assert {"CLOUD", "POWERED_DOWN"} <= state(cluster, "c1") and {"CLOUD", "POWERED_DOWN"} <= state(cluster, "c2")
    write_json(root / "snap" / "c1.json", xid_snapshot_dict(79, gpu=3))  # the VM c1 gets has a dead GPU
    gcp = FakeGcp().start()
    try:
        repair_config = tmp_path / "repair.toml"
        repair_config.write_text(config.read_text() + f'[gcp]\nproject = "{gcp.project}"\nzone = "us-central1-a"\n'
                                 f'compute_endpoint = "{gcp.url}"\n[repair]\nmax_drained_fraction = 1.0\n')
        out = tmp_path / "out"
        job = cluster.sbatch("-o", str(out), "--wrap", "echo ran on $SLURMD_NODENAME")

        wait_for(lambda: node_from_kv(cluster.node("c1")).reason == XID79, 120, "the prolog on c1 to drain it")
        assert "DRAIN" in state(cluster, "c1")

        write_json(root / "snap" / "c1.json", healthy_snapshot_dict(hostname="c1"))  # the NEXT VM behind c1 is fine
        monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
        capsys.readouterr()
        assert main(["--config", str(repair_config), "repair"]) == 0
        said = capsys.readouterr().out
        assert "c1: powered down (POWER_DOWN_ASAP): c1" in said
        assert gcp.calls == []  # never recreated, nor looked up: Slurm owns a dynamic node's VM

        wait_for(lambda: "POWERED_DOWN" in state(cluster, "c1") and "POWERING_DOWN" not in state(cluster, "c1"),
                 60, "c1 powered down")
        assert "DRAIN" not in state(cluster, "c1") and "DOWN" not in state(cluster, "c1")
        assert node_from_kv(cluster.node("c1")).reason == reasons.repairing_reason(XID79)

        done = cluster.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED"), 180)  # the pending job gets a node
        assert done["JobState"] == "COMPLETED" and int(done["Restarts"]) >= 1
        assert f"ran on {done['NodeList']}" in out.read_text()
        log = cluster.power_log()
        assert log[:2] == ["resume c1", "suspend c1"]  # c1's first VM is gone; a later one is a fresh VM

        # a job asking for c1 gets it, powered up afresh if it was down
        again = cluster.sbatch("-w", "c1", "-o", str(tmp_path / "out2"), "--wrap", "echo ran on $SLURMD_NODENAME")
        try:
            done = cluster.wait_job(again, ("COMPLETED", "FAILED", "CANCELLED"), 90)
        except TimeoutError:
            log = [line for line in (cluster.base / "ctld.log").read_text().splitlines() if "c1" in line]
            raise AssertionError(f"{cluster.node('c1')}\n" + "\n".join(log[-30:])) from None
        assert done["JobState"] == "COMPLETED" and done["NodeList"] == "c1"
        assert cluster.power_log().count("resume c1") >= 2 and "DRAIN" not in state(cluster, "c1")
    finally:
        gcp.stop()


def test_a_dynamic_node_whose_vm_went_away_is_not_left_down(cloud, tmp_path, monkeypatch, capsys):
    """c2 drained ahead of its flex end by the expiry watch, then its VM deleted: Slurm holds it
    DOWN. `repair` powers it down, and once powered down (still DOWN) resumes it: a job asking
    for c2 powers up a fresh VM and runs."""
    from slurmagent.cli import main

    cluster, root, config = cloud
    first = cluster.sbatch("-w", "c2", "-o", "/dev/null", "--wrap", "true")
    assert cluster.wait_job(first, ("COMPLETED", "FAILED"), 180)["JobState"] == "COMPLETED"
    expiry = "slurmagent: expiry: flex expiry at 2026-11-30T10:00:00Z"
    cluster.run(["scontrol", "update", "nodename=c2", "state=drain", f"reason={expiry}"])
    cluster.run(["sh", "-c", f"kill -9 $(cat {cluster.base}/cloud-c2.pid)"])  # the flex VM is deleted
    # what slurmctld does after SlurmdTimeout (the reason stays ours), without waiting for it
    cluster.run(["scontrol", "update", "nodename=c2", "state=down", f"reason={expiry}"])
    assert "DOWN" in state(cluster, "c2")

    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    capsys.readouterr()
    assert main(["--config", str(config), "repair"]) == 0
    assert "c2: dynamic node down after expiry" in capsys.readouterr().out
    wait_for(lambda: "POWERED_DOWN" in state(cluster, "c2") and "POWERING_DOWN" not in state(cluster, "c2"), 60,
             "c2 powered down")
    assert main(["--config", str(config), "repair"]) == 0
    out = capsys.readouterr().out
    if out.startswith("nothing to repair"):  # Slurm 24.11 at times clears DOWN and the reason itself once
        assert "DOWN" not in state(cluster, "c2"), out  # the node is powered down: nothing left to resume
    else:
        assert "c2: powered down but DOWN in Slurm: resumed" in out
    wait_for(lambda: "DOWN" not in state(cluster, "c2"), 10, "c2 no longer DOWN")

    again = cluster.sbatch("-w", "c2", "-o", "/dev/null", "--wrap", "true")
    done = cluster.wait_job(again, ("COMPLETED", "FAILED", "CANCELLED"), 180)
    assert done["JobState"] == "COMPLETED" and done["NodeList"] == "c2"

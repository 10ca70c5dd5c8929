"""Hostile input: values a job or a non-root user controls never reach a shell, never widen an
scontrol call, and never make a root hook read or replay something the user wrote.

scontrol is `[slurm] scontrol` = a recording script that appends its argv as JSON: every call
the product makes is checked element by element. Each hostile value would create MARK if any
shell ever saw it.

The same subject without a cluster, emulator or fake server: tests/unit/test_hostile.py.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from support import wait_for, xid_snapshot_dict
from slurmagent.slurm.model import node_from_kv
from test_hostile import XID79, cli, needs_root, node  # noqa: F401 (fixtures)


# --- state a user could have written is not trusted by root -----------------------------------


@needs_root
def test_a_user_written_mig_cache_cannot_redirect_a_repair(node, cli, monkeypatch):
    from support.fake_gcp import FakeGcp

    fake = FakeGcp().start()
    try:
        fake.add_instance("n1", "z", mig="mig-a")
        fake.add_instance("n9", "z", mig="victim-mig")
        cfg = node.write_config(node.tmp / "repair.toml", endpoint=fake.url)
        node.nodes_file.write_text(json.dumps({"n1": ["IDLE+DRAIN", XID79]}))
        monkeypatch.setenv("SLURMD_NODENAME", "ctl")
        ctl = node.state("ctl")
        ctl.mkdir(parents=True)
        state = ctl / "repair-state.json"
        state.write_text(json.dumps({"migs": {"n1": {"zone": "z", "mig": {
            "project": fake.project_number, "scope": "zones", "location": "z", "name": "victim-mig"}}}}))
        os.chown(state, 65534, 65534)
        code, out, err = cli("--config", str(cfg), "repair", "n1")
        assert f"ignoring {state}: owned by uid 65534" in err
        posts = [c.path for c in fake.mutations]
        assert posts and all("/instanceGroupManagers/mig-a/" in p for p in posts), (posts, out, err)
        assert code == 0, err
    finally:
        fake.stop()


# --- on the real cluster: hostile job names, comments and environment ------------------------


@pytest.mark.slurm
def test_hostile_job_name_comment_and_env_on_a_bad_node(slurm, tmp_path):
    mark = tmp_path / "MARK"
    c = slurm.cluster
    slurm.set_snapshot("n1", xid_snapshot_dict(79, gpu=3))
    env = dict(c.env, EVIL=f"$(touch {mark})", SLURM_EVIL=f"`touch {mark}`; touch {mark}")
    job = subprocess.run(
        ["sbatch", "--parsable", "-w", "n1", "-o", "/dev/null",
         "-J", f"x'; touch {mark}; echo '$(touch {mark})`touch {mark}`",
         f"--comment=a\"; touch {mark} #\n$(touch {mark})", "--wrap", "true"],
        env=env, capture_output=True, text=True, timeout=30, check=True).stdout.strip().split(";")[0]
    wait_for(lambda: "DRAIN" in c.node("n1").get("State", ""), 30, "the prolog to drain n1")
    assert node_from_kv(c.node("n1")).reason == XID79  # our clean reason, nothing of the job's
    def requeued():
        j = c.job(job)
        return j if j.get("Restarts") == "1" and j.get("JobState") == "PENDING" else None

    info = wait_for(requeued, 30, "the requeue")
    assert "Held" not in info.get("Reason", "")  # PENDING to run elsewhere, not held
    decision = [d for d in slurm.decisions("n1") if d.get("job") == job][-1]
    assert decision["verdict"] == "unhealthy" and decision["reason"] == XID79
    assert not mark.exists()

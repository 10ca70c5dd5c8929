"""`slurmagent healthcheck` (Slurm's HealthCheckProgram): check between jobs, drain, never resume.

The same subject without a cluster, emulator or fake server: tests/unit/test_healthcheck.py.

Timing (parallel lanes): nothing here is in the serial group; the skip after a recent
Prolog/Epilog is asserted by what the check did (no read, no drain, no decision line).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import REPO, cluster_config_text, healthy_snapshot_dict, wait_for, write_json, xid_snapshot_dict
from slurmagent.state.decisionlog import read_records
from slurmagent.devtools.localcluster import LocalSlurmCluster


def run_healthcheck(slurm, node: str, *args: str, config: Path | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """As slurmd runs HealthCheckProgram: root, an environment holding SLURMD_NODENAME and little else
    (no PATH); the admin's shim adds the config and the slurm.conf."""
    env = {"SLURMD_NODENAME": node, "SLURMAGENT_CONFIG": str(config or slurm.config),
           "SLURM_CONF": str(slurm.cluster.conf), "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "slurmagent.entry", "healthcheck", *args], env=env,
                          capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - start


def healthchecks(slurm, node: str) -> list[dict]:
    return [d for d in slurm.decisions(node) if d["event"] == "healthcheck"]


# --- the session cluster, invoked exactly as slurmd would -----------------------------------


@pytest.mark.slurm
def test_healthy_node_exits_0_and_stays_up(slurm):
    proc, _ = run_healthcheck(slurm, "n2", "--skip-recent", "0")
    assert proc.returncode == 0, proc.stderr
    assert "DRAIN" not in slurm.cluster.node("n2")["State"]
    assert healthchecks(slurm, "n2")[-1]["verdict"] == "healthy"


@pytest.mark.slurm
def test_node_gone_bad_between_jobs_is_drained_and_next_job_avoids_it(slurm, tmp_path):
    c = slurm.cluster
    first = c.sbatch("-w", "n2", "-o", "/dev/null", "--wrap", "true")
    assert c.wait_job(first, ("COMPLETED", "FAILED"), 30)["JobState"] == "COMPLETED"
    wait_for(lambda: any(d["event"] == "epilog" and d.get("job") == first for d in slurm.decisions("n2")), 10, "epilog")
    slurm.set_snapshot("n2", xid_snapshot_dict(79, gpu=3))  # the GPU falls off the bus while n2 is idle

    # The epilog checked n2 moments ago: the next health check returns at once, without a read:
    # it neither saw the XID (no drain) nor logged a check (asserted on what it did, not in wall
    # seconds, which a loaded machine stretches).
    checks_before = len(healthchecks(slurm, "n2"))
    proc, _ = run_healthcheck(slurm, "n2")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "DRAIN" not in c.node("n2")["State"]
    assert len(healthchecks(slurm, "n2")) == checks_before

    # The next one past the window (here: window 0) checks, drains, and says why.
    proc, _ = run_healthcheck(slurm, "n2", "--skip-recent", "0")
    assert proc.returncode == 1, proc.stderr
    assert "unhealthy: slurmagent: xid 79 on gpu 3" in proc.stderr
    node = c.node("n2")
    assert "DRAIN" in node["State"] and node["Reason"].startswith("slurmagent: xid 79 on gpu 3 (fallen off the bus)")
    d = healthchecks(slurm, "n2")[-1]
    assert (d["verdict"], d["rule"], d["gpu"], d["action"]) == ("unhealthy", "xid", 3, "drained")

    jobs = [c.sbatch("-o", "/dev/null", "--wrap", "echo $SLURMD_NODENAME") for _ in range(3)]
    for job_id in jobs:
        job = c.wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED"), 30)
        assert job["JobState"] == "COMPLETED" and job["NodeList"] in ("n1", "n3") and job["Restarts"] == "0", job


@pytest.mark.slurm
def test_never_resumes_and_never_overrides_an_admin(slurm):
    c = slurm.cluster
    c.run(["scontrol", "update", "nodename=n3", "state=drain", "reason=slurmagent: xid 79 on gpu 3 (fallen off the bus)"])
    proc, _ = run_healthcheck(slurm, "n3", "--skip-recent", "0")  # healthy again: still not resumed
    assert proc.returncode == 0, proc.stderr
    assert "DRAIN" in c.node("n3")["State"]

    c.resume("n3")
    c.run(["scontrol", "update", "nodename=n3", "state=drain", "reason=admin: swap PSU"])
    slurm.set_snapshot("n3", xid_snapshot_dict(48, gpu=1))
    proc, _ = run_healthcheck(slurm, "n3", "--skip-recent", "0")
    assert proc.returncode == 1
    assert c.node("n3")["Reason"].startswith("admin: swap PSU")
    assert healthchecks(slurm, "n3")[-1]["action"] == "kept-admin-drain"


@pytest.mark.slurm
def test_internal_error_is_not_a_gpu_fault(slurm, tmp_path):
    bad = tmp_path / "config.toml"
    bad.write_text("[health]\nno_such_key = 1\n")
    proc, _ = run_healthcheck(slurm, "n1", config=bad)
    assert proc.returncode == 0  # fail open, loudly
    assert "internal error (not a GPU fault)" in proc.stderr and "no_such_key" in proc.stderr
    assert "DRAIN" not in slurm.cluster.node("n1")["State"]


# --- Slurm's own mechanism: a small second cluster with HealthCheckProgram set --------------


@pytest.mark.slurm
def test_slurmd_health_check_program_drains_a_node_gone_bad(slurm_env, tmp_path):
    """slurmd itself runs `slurmagent healthcheck` every HealthCheckInterval (ANY,CYCLE)."""
    root = tmp_path
    root.chmod(0o755)
    config = root / "config.toml"
    config.write_text(cluster_config_text(root))
    for node in ("h1", "h2"):
        write_json(root / "snap" / f"{node}.json", healthy_snapshot_dict(hostname=node))
    shim = root / "healthcheck"
    shim.write_text(
        "#!/bin/sh\n"
        f"export SLURMAGENT_CONFIG='{config}' SLURM_CONF='{root}/slurm/slurm.conf' PYTHONPATH='{REPO}'\n"
        f"exec {sys.executable} -m slurmagent.entry healthcheck\n"
    )
    shim.chmod(0o755)
    cluster = LocalSlurmCluster(root / "slurm", nodes=["h1", "h2"], extra_conf=[
        f"HealthCheckProgram={shim}", "HealthCheckInterval=2", "HealthCheckNodeState=ANY,CYCLE"])
    try:
        cluster.start()
        wait_for(lambda: any(d["event"] == "healthcheck" for d in read_records(root / "state/h1/hooks.log")),
                 10, "slurmd ran the health check on h1")
        write_json(root / "snap" / "h1.json", xid_snapshot_dict(95, gpu=2))
        node = wait_for(lambda: (lambda n: n if "DRAIN" in n.get("State", "") else None)(cluster.node("h1")),
                        15, "h1 drained by slurmd's health check")
        assert node["Reason"].startswith("slurmagent: xid 95 on gpu 2 (uncontained memory error)")
        job_id = cluster.sbatch("-o", "/dev/null", "--wrap", "true")
        job = cluster.wait_job(job_id, ("COMPLETED", "FAILED"), 30)
        assert job["JobState"] == "COMPLETED" and job["NodeList"] == "h2" and job["Restarts"] == "0"
        assert "DRAIN" not in cluster.node("h2")["State"]
    finally:
        cluster.stop()


@pytest.mark.slurm
def test_a_node_resumed_right_after_an_unhealthy_prolog_is_checked_and_drained_again(slurm):
    """The prolog drained n1; an admin resumed it at once. The next health check, inside the
    skip window of that prolog, does not skip: it sees the fault and drains n1 again."""
    c = slurm.cluster
    slurm.set_snapshot("n1", xid_snapshot_dict(79, gpu=2))
    job = c.sbatch("-w", "n1", "-o", "/dev/null", "--wrap", "true")
    try:
        wait_for(lambda: "DRAIN" in c.node("n1")["State"], 30, "the prolog to drain n1")
        # the prolog drains first and writes its decision line after: wait for the line, not only the drain
        wait_for(lambda: any(d["event"] == "prolog" and d["verdict"] == "unhealthy" for d in slurm.decisions("n1")),
                 30, "the prolog's unhealthy decision in n1's log")
        # and slurmctld has handled the failed prolog (requeued the job; its own "Prolog error" drain
        # comes with that): an admin resume before it would be undone by Slurm, not by the check
        wait_for(lambda: int(c.job(job).get("Restarts", "0") or 0) >= 1, 30, "slurmctld to requeue the job")
        c.run(["scancel", job])
        c.resume("n1")  # the admin's resume, seconds after the verdict
        assert "DRAIN" not in c.node("n1")["State"]
        proc, _ = run_healthcheck(slurm, "n1")  # the default window: the prolog's line is within it
        assert proc.returncode == 1, proc.stderr
        assert "DRAIN" in c.node("n1")["State"] and c.node("n1")["Reason"].startswith("slurmagent: xid 79 on gpu 2")
    finally:
        c.run(["scancel", job], check=False)
        slurm.set_snapshot("n1", healthy_snapshot_dict(hostname="n1"))
        c.resume("n1")

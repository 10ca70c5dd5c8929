"""Prolog/Epilog on a real local Slurm cluster: drain with a precise reason, job stays PENDING."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from support import REPO, cluster_config_text, healthy_snapshot_dict, wait_for, xid_snapshot_dict

pytestmark = pytest.mark.slurm


def watch_job(cluster, job_id: str, until: tuple[str, ...], timeout: float) -> tuple[dict, list[tuple[str, str]]]:
    """Poll the job, recording every (state, reason) seen, until it reaches a final state."""
    seen: list[tuple[str, str]] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        job = cluster.job(job_id)
        pair = (job.get("JobState", ""), job.get("Reason", ""))
        if not seen or seen[-1] != pair:
            seen.append(pair)
        if pair[0] in until:
            return job, seen
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} never reached {until}; seen {seen}")


def test_xid79_job_requeued_pending_and_completes_elsewhere(slurm, tmp_path):
    c = slurm.cluster
    slurm.set_snapshot("n1", xid_snapshot_dict(79, gpu=3))
    out = tmp_path / "out"
    # n2 and n3 are held back until the job has met n1, so the scheduler has no other choice
    c.run(["scontrol", "update", "nodename=n2,n3", "state=drain", "reason=test: hold"])
    job_id = c.sbatch("-o", str(out), "--wrap", "echo ran on $SLURMD_NODENAME")
    wait_for(lambda: "DRAIN" in c.node("n1")["State"], 30, "the prolog to drain n1")
    c.resume("n2", "n3")

    job, seen = watch_job(c, job_id, ("COMPLETED", "FAILED", "CANCELLED"), timeout=90)

    assert job["JobState"] == "COMPLETED", seen
    assert job["NodeList"] in ("n2", "n3")
    assert int(job["Restarts"]) >= 1
    assert not any("held" in reason.lower() for _, reason in seen), seen
    assert "ran on n" in out.read_text()
    node = c.node("n1")
    assert "DRAIN" in node["State"]
    assert node["Reason"].startswith("slurmagent: xid 79 on gpu 3 (fallen off the bus)")
    prolog = [d for d in slurm.decisions("n1") if d.get("job") == job_id and d["event"] == "prolog"]
    assert prolog and prolog[0]["verdict"] == "unhealthy" and prolog[0]["rule"] == "xid" and prolog[0]["gpu"] == 3
    prom = (slurm.state_dir("n1") / "slurmagent.prom").read_text()  # node_exporter textfile
    assert re.search(r'slurmagent_gpu_healthy\{UUID="GPU-[^"]+",gpu="3",pci_bus_id="[^"]+"\} 0\n', prom) and 'slurmagent_drains_total{rule="xid"}' in prom


def test_healthy_cluster_runs_jobs_without_drain(slurm):
    c = slurm.cluster
    jobs = [c.sbatch("-o", "/dev/null", "--wrap", "true") for _ in range(4)]
    for job_id in jobs:
        assert c.wait_job(job_id, ("COMPLETED", "FAILED"), 60)["JobState"] == "COMPLETED"
    for n in c.nodes:
        assert "DRAIN" not in c.node(n)["State"]
    verdicts = {d["verdict"] for n in c.nodes for d in slurm.decisions(n) if d.get("job") in jobs}
    assert verdicts == {"healthy"}


def test_admin_drain_keeps_its_reason(slurm, tmp_path):
    c = slurm.cluster
    flag = tmp_path / "go"
    job_id = c.sbatch("-w", "n2", "-o", "/dev/null", "--wrap", f"while [ ! -e {flag} ]; do sleep 0.2; done; exit 1")
    c.wait_job(job_id, ("RUNNING",), 30)
    c.run(["scontrol", "update", "nodename=n2", "state=drain", "reason=admin: swap PSU"])
    slurm.set_snapshot("n2", xid_snapshot_dict(48, gpu=1))
    flag.touch()
    c.wait_job(job_id, ("FAILED", "COMPLETED", "PENDING"), 30)
    wait_for(lambda: any(d["event"] == "epilog" and d.get("job") == job_id for d in slurm.decisions("n2")), 20, "epilog")
    node = c.node("n2")
    assert node["Reason"].startswith("admin: swap PSU")
    epilog = [d for d in slurm.decisions("n2") if d["event"] == "epilog" and d.get("job") == job_id][0]
    assert epilog["verdict"] == "unhealthy"
    assert "kept-admin-drain" in epilog["action"]


def test_epilog_drains_and_requeues_job_that_failed_on_bad_node(slurm, tmp_path):
    c = slurm.cluster
    flag = tmp_path / "go"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then\n'
        f"  while [ ! -e {flag} ]; do sleep 0.2; done; exit 7\n"
        "fi\n"
        "echo second run on $SLURMD_NODENAME\n"
    )
    out = tmp_path / "out"
    job_id = c.sbatch("-o", str(out), "--open-mode=append", str(script))
    job = c.wait_job(job_id, ("RUNNING",), 30)
    first = job["NodeList"]
    slurm.set_snapshot(first, xid_snapshot_dict(95, gpu=0))  # uncontained ECC error while the job runs
    flag.touch()

    job, seen = watch_job(c, job_id, ("COMPLETED", "FAILED", "CANCELLED"), timeout=90)

    assert job["JobState"] == "COMPLETED", seen
    assert int(job["Restarts"]) == 1
    assert job["NodeList"] != first
    assert "second run" in out.read_text()
    node = c.node(first)
    assert "DRAIN" in node["State"] and node["Reason"].startswith("slurmagent: xid 95 on gpu 0")


def test_hung_nvml_read_returns_within_deadline(slurm, tmp_path):
    """A prolog whose NVML read hangs answers within `[health] timeout_s` and drains the node."""
    fake = tmp_path / "fakenvml"
    fake.mkdir()
    (fake / "pynvml.py").write_text(
        "import time\n"
        "class NVMLError(Exception):\n    pass\n"
        "def nvmlInit():\n    time.sleep(3600)\n"
    )
    root = slurm.root
    config = tmp_path / "config.toml"
    config.write_text(cluster_config_text(root, timeout_s=2, snapshot=None))
    env = dict(slurm.cluster.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=f"{fake}:{REPO}",
               SLURMD_NODENAME="n3", SLURM_JOB_ID="999999")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "slurmagent.entry", "prolog"], env=env, capture_output=True,
                          text=True, timeout=30)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    # the 2 s deadline, the interpreter's start and one drain: idle ~3 s; 20 s is room for a
    # loaded machine, and nowhere near the hung read (an hour) or the subprocess timeout (30 s)
    assert elapsed < 2 + 18, elapsed
    assert "nvml-timeout" in proc.stderr
    node = slurm.cluster.node("n3")
    assert "DRAIN" in node["State"] and node["Reason"].startswith("slurmagent: nvml-timeout")


def test_leftover_gpu_process_drains_n1_at_the_next_prolog_and_the_job_completes_on_n2(slurm, tmp_path):
    """A previous job's process still on n1's GPU 2 (in n1's `%n` snapshot; its pid belongs to no
    job here): the next job's prolog drains n1 naming the GPU and the pid, and the job runs on n2."""
    c = slurm.cluster
    leftover = healthy_snapshot_dict(hostname="n1")
    leftover["gpus"][2]["processes"] = [{"pid": 4194000, "used_mib": 4000, "name": "python", "user": "alice"}]
    leftover["gpus"][2]["memory"] = {"total_mib": 81559, "used_mib": 4001, "reserved_mib": 544}
    slurm.set_snapshot("n1", leftover)
    out = tmp_path / "out"
    c.run(["scontrol", "update", "nodename=n2,n3", "state=drain", "reason=test: hold"])
    job_id = c.sbatch("-o", str(out), "--wrap", "echo ran on $SLURMD_NODENAME")
    wait_for(lambda: "DRAIN" in c.node("n1")["State"], 60, "the prolog to drain n1")  # after the 10 s grace
    c.resume("n2")

    job, seen = watch_job(c, job_id, ("COMPLETED", "FAILED", "CANCELLED"), timeout=90)

    assert job["JobState"] == "COMPLETED", seen
    assert job["NodeList"] == "n2"
    assert "ran on n2" in out.read_text()
    assert c.node("n1")["Reason"].startswith(
        "slurmagent: gpu-leftover-processes: gpu 2 pid 4194000 (python, alice) holds 4000 MiB")
    prolog = [d for d in slurm.decisions("n1") if d.get("job") == job_id and d["event"] == "prolog"]
    assert prolog and prolog[0]["rule"] == "gpu-leftover-processes" and prolog[0]["gpu"] == 2

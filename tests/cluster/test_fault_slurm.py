"""A GPU that fails under a running job, on the real local cluster (n1..n3) with `watch`
running as a process and the kernel-log file as the XID source: the job leaves the node at
once and runs elsewhere, requeued once; an application XID changes nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO, SUPPORT, cluster_config_text, wait_for, xid_snapshot_dict
from test_watch import append, nvrm
from test_watch_slurm import drained, watcher  # noqa: F401 (the watcher fixture)

pytestmark = pytest.mark.slurm

TOY = str(SUPPORT / "toy_trainer.py")


def evictions(slurm, node: str, jobs: tuple[str, ...] | None = None) -> list[dict]:
    """This test's `fault-evict` lines (the session cluster's logs hold earlier tests' too)."""
    return [d for d in slurm.decisions(node) if d["event"] == "fault-evict" and (jobs is None or d["job"] in jobs)]


def land_on(c, nodes: str, submit):
    """Submit with every node but `nodes` held back, so the job is sure to start there."""
    others = ",".join(n for n in c.nodes if n not in nodes.split(","))
    c.run(["scontrol", "update", f"nodename={others}", "state=drain", "reason=test: hold"])
    try:
        job_id = submit()
        job = c.wait_job(job_id, ("RUNNING",), 60)
    finally:
        c.resume(*others.split(","))
    return job_id, job


def restarts(c, job_id: str) -> int:
    return int(c.job(job_id).get("Restarts", 0))


def finished(c, job_id: str, timeout: float = 120) -> dict:
    return wait_for(lambda: (lambda j: j if j["JobState"] in ("COMPLETED", "FAILED", "CANCELLED") else None)(
        c.job(job_id)), timeout, f"job {job_id} to end")


def first_run_then_done(tmp_path: Path) -> Path:
    """A job that would run 10 minutes on its first start and ends at once after a restart.

    Its sleep killed, the shell stops (Slurm may kill the sleep a moment before the shell)."""
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\n"
                      'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then echo first on $SLURMD_NODENAME; sleep 600 || exit 1; fi\n'
                      "echo done on $SLURMD_NODENAME restart ${SLURM_RESTART_COUNT:-0}\n")
    return script


def test_xid79_under_an_unwrapped_job_requeues_it_and_it_completes_elsewhere(slurm, watcher, tmp_path):
    c = slurm.cluster
    out = tmp_path / "out"
    job_id, _ = land_on(c, "n1", lambda: c.sbatch("--requeue", "-o", str(out), "--open-mode=append",
                                                  str(first_run_then_done(tmp_path))))
    w = watcher("n1")
    slurm.set_snapshot("n1", xid_snapshot_dict(79, gpu=3))  # what the job's epilog will read on n1
    append(slurm.kernel_log("n1"), nvrm(79))

    wait_for(lambda: restarts(c, job_id) >= 1, 15, "the watch to requeue the job")
    assert drained(slurm, "n1")["Reason"].startswith("slurmagent: xid 79 on gpu 3 (fallen off the bus)")
    assert c.job(job_id)["JobState"] in ("PENDING", "REQUEUED", "COMPLETING")  # off n1, long before its 600 s
    job = finished(c, job_id)

    assert job["JobState"] == "COMPLETED" and job["NodeList"] in ("n2", "n3"), job
    assert int(job["Restarts"]) == 1  # requeued once: the epilog on the drained n1 did not do it again
    lines = out.read_text().splitlines()
    assert [x for x in lines if x.startswith(("first", "done"))] == ["first on n1", f"done on {job['NodeList']} restart 1"]
    assert any("DUE TO JOB REQUEUE" in x for x in lines), lines
    (ev,) = evictions(slurm, "n1", (job_id,))
    assert (ev["job"], ev["action"], ev["requeued_by"], ev["wrapped"]) == (job_id, "requeued", "slurmagent", False)
    assert ev["fault_to_leave_s"] < 600
    epilog = wait_for(lambda: [d for d in slurm.decisions("n1") if d["event"] == "epilog" and d.get("job") == job_id],
                      30, "the epilog on n1")
    assert epilog[0]["verdict"] == "unhealthy" and "requeue" not in epilog[0]["action"], epilog
    prom = (slurm.state_dir("n1") / "slurmagent.prom").read_text()
    assert 'slurmagent_jobs_requeued_on_fault_total{by="slurmagent"}' in prom
    assert w.terminate() == 0, w.stderr()


def test_application_xid_under_a_running_job_changes_nothing(slurm, watcher, tmp_path):
    c = slurm.cluster
    job_id, _ = land_on(c, "n1", lambda: c.sbatch("--requeue", "-o", "/dev/null", "--wrap", "sleep 600"))
    w = watcher("n1")
    before = len([d for d in slurm.decisions("n1") if d["event"] == "watch"])
    for code, text in ((13, "Graphics SM Warp Exception"), (31, "MMU Fault"), (43, "Ch 00000010"), (45, "Ch 8")):
        append(slurm.kernel_log("n1"), nvrm(code, detail=text))
    wait_for(lambda: len([d for d in slurm.decisions("n1") if d["event"] == "watch"]) >= before + 4, 10,
             "four decision lines")
    job = c.job(job_id)
    assert (job["JobState"], job["NodeList"], job["Restarts"]) == ("RUNNING", "n1", "0"), job
    assert drained(slurm, "n1") is None and evictions(slurm, "n1", (job_id,)) == []
    c.run(["scancel", job_id])
    assert w.terminate() == 0, w.stderr()


@pytest.mark.slow
def test_xid79_under_a_wrapped_job_flushes_requeues_once_and_resumes_elsewhere(slurm, watcher, gcs_emulator, tmp_path):
    c = slurm.cluster
    job_config = tmp_path / "job.toml"
    job_config.write_text(cluster_config_text(slurm.root) + '[checkpoint]\nremote = "gs://ckpt/fault"\n'
                          'sync_interval_s = 1.0\ngrace_s = 300.0\n[expiry]\npublish_run_file = false\n')
    env = dict(c.env, SLURMAGENT_CONFIG=str(job_config), PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=gcs_emulator.url)
    ledger, out = tmp_path / "ledger", tmp_path / "out"

    def submit() -> str:
        sub = subprocess.run(
            [sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-o", str(out), "--open-mode=append",
             "--", "--ckpt-dir", str(tmp_path / "ckpt-%n"), "--", sys.executable, TOY, "300", str(ledger), "0.05"],
            env=env, capture_output=True, text=True, timeout=30)
        assert sub.returncode == 0, sub.stderr
        return sub.stdout.strip().split(";")[0]

    job_id, _ = land_on(c, "n1", submit)
    wait_for(lambda: ledger.exists() and ledger.read_text().count("step ") >= 10, 60, "10 steps")
    w = watcher("n1")
    append(slurm.kernel_log("n1"), nvrm(79))

    wait_for(lambda: restarts(c, job_id) >= 1, 60, "the wrapper's requeue")
    job = finished(c, job_id, 180)
    log = out.read_text()
    assert job["JobState"] == "COMPLETED" and job["NodeList"] != "n1", log
    assert int(job["Restarts"]) == 1, log  # the wrapper's requeue only: not the watch's, not the epilog's
    assert "SIGPWR: asking the job to checkpoint (SIGUSR1, grace 5 s: a GPU failed under the job" in log, log
    assert "requeued job" in log and "restored checkpoint of attempt 0" in log, log
    steps = [int(line.split()[1]) for line in ledger.read_text().splitlines() if line.startswith("step ")]
    assert steps == list(range(1, 301))  # the fault flush checkpointed: nothing lost, nothing done twice
    evs = wait_for(lambda: [d for d in evictions(slurm, "n1", (job_id,)) if d.get("fault_to_leave_s") is not None], 10,
                   "the job followed off n1")
    assert (evs[0]["job"], evs[0]["action"], evs[0]["requeued_by"]) == (
        job_id, "flushed and requeued by its wrapper", "wrapper")
    assert w.terminate() == 0, w.stderr()


@pytest.mark.slow
def test_two_node_job_with_one_node_faulting_is_requeued_once_and_restarts(slurm, watcher, tmp_path):
    c = slurm.cluster
    out = tmp_path / "out"
    job_id, job = land_on(c, "n1,n2", lambda: c.sbatch("-N", "2", "--requeue", "-o", str(out), "--open-mode=append",
                                                       str(first_run_then_done(tmp_path))))
    assert job["NodeList"] == "n[1-2]", job
    w1, w2 = watcher("n1"), watcher("n2")
    append(slurm.kernel_log("n2"), nvrm(79))  # n2 is not the batch host: the whole job goes

    wait_for(lambda: restarts(c, job_id) >= 1, 15, "the requeue")
    job = finished(c, job_id)
    assert job["JobState"] == "COMPLETED" and int(job["Restarts"]) == 1, job
    assert "n2" not in job["NodeList"], job  # n1 and n3
    assert drained(slurm, "n2") and drained(slurm, "n1") is None
    (ev,) = evictions(slurm, "n2", (job_id,))
    assert (ev["job"], ev["job_nodes"], ev["action"]) == (job_id, 2, "requeued")
    assert evictions(slurm, "n1", (job_id,)) == []
    assert w1.terminate() == 0 and w2.terminate() == 0

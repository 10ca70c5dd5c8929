#!/usr/bin/env python3
"""Slurm 25.11+'s --requeue=expedite against a plain --requeue: requeue -> running again.

Usage: python bench/expedite_requeue.py [--runs 2] [--slurmd-timeout 30]   (as root, Slurm >= 25.11:
the forky chroot, `ci/forky-lane.sh --run python bench/expedite_requeue.py`)

Starts its own LocalSlurmCluster (n1..n3, SlurmctldParameters=enable_expedited_requeue,
cred_expire=20 as every test cluster) and, for each option, submits `sleep 600` and measures
(polling `scontrol show job` every 0.1 s):

* `scontrol requeue JOB` (what the wrapper runs after a flush) -> the job RUNNING again;
* its node dying (slurmd, its slurmstepds and the job's processes SIGKILLed) -> the job RUNNING
  on another node; Slurm notices the node after --slurmd-timeout.

A plain requeued job waits requeue_delay (= cred_expire: 20 s here, 120 s by default) as
Reason=BeginTime; an expedited one is eligible at once, with the highest priority.
Leaves nothing running.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slurmagent.devtools.localcluster import LocalSlurmCluster  # noqa: E402

OPTIONS = ("--requeue=expedite", "--requeue")


def running_again(cluster: LocalSlurmCluster, job_id: str, restarts: int, timeout: float = 300) -> float:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        job = cluster.job(job_id)
        if job.get("JobState") == "RUNNING" and int(job.get("Restarts", 0)) >= restarts:
            return time.monotonic()
        time.sleep(0.1)
    raise SystemExit(f"job {job_id} not running again after {timeout:g} s: {cluster.job(job_id)}")


def one(cluster: LocalSlurmCluster, option: str, how: str) -> float:
    job_id = cluster.sbatch(option, "-o", "/dev/null", "--wrap", "sleep 600")
    running_again(cluster, job_id, 0, 60)
    node = cluster.job(job_id)["NodeList"]
    t0 = time.monotonic()
    if how == "scontrol requeue":
        cluster.run(["scontrol", "requeue", job_id])
    else:
        cluster.kill_node(node, job_id)
    seconds = running_again(cluster, job_id, 1) - t0
    cluster.run(["scancel", job_id], check=False)
    if how != "scontrol requeue":
        cluster.start_node(node)
    cluster.reset_nodes(120)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--slurmd-timeout", type=int, default=30)
    args = ap.parse_args()
    cluster = LocalSlurmCluster(Path(tempfile.mkdtemp(prefix="sa-bench-expedite-")), nodes=["n1", "n2", "n3"],
                                ctld_params=["enable_expedited_requeue"],
                                extra_conf=[f"SlurmdTimeout={args.slurmd_timeout}"]).start()
    try:
        version = cluster.run(["scontrol", "--version"]).stdout.strip()
        print(f"{version}, cred_expire={cluster.cred_expire}, SlurmdTimeout={args.slurmd_timeout}, runs={args.runs}")
        print(f"{'event -> running again':<40}{'option':<22}{'median s':>10}{'min':>8}{'max':>8}")
        for how in ("scontrol requeue", "node death"):
            for option in OPTIONS:
                values = [one(cluster, option, how) for _ in range(args.runs)]
                print(f"{how:<40}{option:<22}{statistics.median(values):10.1f}{min(values):8.1f}{max(values):8.1f}",
                      flush=True)
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()

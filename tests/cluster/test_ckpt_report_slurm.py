"""The job's owner sees their checkpoint: the wrapper says the last commit, the sync's
duration and the lag on the job's stderr at a low rate (and when the bucket falls behind or
catches up), and `slurmagent status --job ID` shows the committed checkpoint (from the
bucket) and the running attempt's view (from the wrapper's record).

The same subject without a cluster, emulator or fake server: tests/unit/test_ckpt_report.py.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading

import pytest

from support import REPO, cluster_config_text, wait_for
from slurmagent.checkpoint.report import CheckpointReport, read_record, record_path
from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
from slurmagent.run.job import JobIdentity, RunOptions
from slurmagent.run.supervisor import Supervisor


def test_wrapper_says_the_checkpoint_state_on_stderr_once_not_at_every_commit(emu, tmp_path):
    err = io.StringIO()
    stop = tmp_path / "stop"
    writer = ('i=0; while [ ! -e "$1" ]; do i=$((i+1)); printf "%s" "$i" > "$SLURMAGENT_CKPT_DIR/.s.tmp"; '
              'mv "$SLURMAGENT_CKPT_DIR/.s.tmp" "$SLURMAGENT_CKPT_DIR/state"; sleep 0.2; done')
    opts = RunOptions(cmd=["sh", "-c", writer, "sh", str(stop)], ckpt_dir=tmp_path / "ckpt",
                      remote="gs://ckpt/jobs/rep", sync_interval_s=0.3)
    record = tmp_path / "rec.json"
    sup = Supervisor(opts, JobIdentity("cloud-run", "rep", "rep-task-0", 0), GcsCheckpointStore(opts.remote), None,
                     dict(os.environ), err=err)
    sup.report = CheckpointReport(sup.say, job="rep", attempt=0, remote=opts.remote, ckpt_dir=str(opts.ckpt_dir),
                                  record=record, interval_s=3600)
    store = GcsCheckpointStore(opts.remote)
    commits: set[str] = set()

    def scenario() -> None:  # several commits of a changing file, then the job ends
        wait_for(lambda: (m := store.latest_manifest()) and commits.add(m.created) or len(commits) >= 4, 60,
                 "four commits", interval=0.1)
        stop.touch()

    t = threading.Thread(target=scenario, daemon=True)
    t.start()
    outcome = sup.run()
    t.join(5)
    text = err.getvalue()
    assert outcome.exit_code == 0 and outcome.synced, text
    lines = [line for line in text.splitlines() if "checkpoint: " in line and "final sync" not in line]
    assert len(lines) == 1, text  # the first commit, not one line per commit
    assert lines[0].startswith("slurmagent run: checkpoint: last commit: attempt 0, 1 file(s)")
    assert "last sync " in lines[0] and "; lag " in lines[0]
    rec = read_record(record)
    assert rec["last_commit"]["files"] == 1 and rec["remote"] == "gs://ckpt/jobs/rep"
    assert rec["last_sync"]["seconds"] >= 0 and rec["error"] is None


@pytest.mark.slurm
def test_status_job_shows_the_committed_checkpoint_and_the_running_attempt(slurm, gcs_emulator, tmp_path):
    c = slurm.cluster
    config = tmp_path / "c.toml"
    config.write_text(cluster_config_text(slurm.root) + '[checkpoint]\nremote = "gs://ckpt/jobs"\n'
                      "sync_interval_s = 0.5\ngrace_s = 10.0\n")
    env = dict(c.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=gcs_emulator.url,
               TMPDIR=str(tmp_path))
    job_cmd = ('printf %s 0123456789 > "$SLURMAGENT_CKPT_DIR/.w.tmp" && mv "$SLURMAGENT_CKPT_DIR/.w.tmp" '
               '"$SLURMAGENT_CKPT_DIR/weights" && sleep 120')
    sub = subprocess.run([sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-o", str(tmp_path / "out"),
                          "--", "sh", "-c", job_cmd], env=env, capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    try:
        c.wait_job(job, ("RUNNING",), 60)
        rec = record_path({"TMPDIR": str(tmp_path)}, os.geteuid(), job)
        wait_for(lambda: (read_record(rec) or {}).get("last_commit"), 60, "a commit")

        def status(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "slurmagent.entry", "status", "--job", job, *args], env=env,
                                  capture_output=True, text=True, timeout=60)

        shown = status()
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert lines[0].startswith(f"job {job}: RUNNING, restarts 0"), shown.stdout
        assert lines[1].startswith(f"checkpoint: gs://ckpt/jobs/{job}: last commit by attempt 0 at "), shown.stdout
        assert "1 file(s), 10 B" in lines[1]
        assert lines[2].startswith("this node: attempt 0 on ") and "last sync took" in lines[2] and "lag" in lines[2]
        as_json = json.loads(status("--json").stdout)
        assert as_json["commit"]["files"] == 1 and as_json["commit"]["bytes"] == 10
        # on a login node (no record here) the bucket still answers
        elsewhere = subprocess.run([sys.executable, "-m", "slurmagent.entry", "status", "--job", job], capture_output=True,
                                   env={**env, "TMPDIR": str(tmp_path / "login")}, text=True, timeout=60)
        assert "last commit by attempt 0" in elsewhere.stdout and "this node" not in elsewhere.stdout
    finally:
        c.run(["scancel", job])

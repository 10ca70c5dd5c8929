"""Real PyTorch Lightning (examples/lightning_train.py) under the wrapper.

Auto-requeue on: Lightning saves `hpc_ckpt_N.ckpt` on SIGUSR1 and calls `scontrol requeue`
itself, then trains on. The wrapper holds that requeue until its final sync is done (with a
checkpoint whose upload outlasts the cluster's KillWait=5), stops the trainer and requeues
once; the job resumes at the saved global step. Auto-requeue off: the trainer helper and a
callback save `last.ckpt`, passed back as `ckpt_path`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO, cluster_config_text, manifest, need_module, wait_for

need_module("lightning")

LIGHTNING_TRAIN = str(REPO / "examples" / "lightning_train.py")


def ledger(path: Path, word: str) -> list[int]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [int(line.split()[1]) for line in lines if line.startswith(word + " ")]


def test_lightning_without_auto_requeue_resumes_from_last_ckpt(emu, tmp_path):
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n[checkpoint]\nremote = "gs://ckpt/jobs"\n'
                                     "sync_interval_s = 60\ngrace_s = 120.0\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURMAGENT_CONFIG=str(tmp_path / "c.toml"),
               CLOUD_RUN_JOB="pl", CLOUD_RUN_TASK_INDEX="0", CLOUD_RUN_TASK_ATTEMPT="0")
    for key in ("SLURM_JOB_ID", "SLURM_NTASKS"):
        env.pop(key, None)
    log = tmp_path / "log"
    args = ["--", sys.executable, LIGHTNING_TRAIN, "--auto-requeue", "off", "--max-steps", "400", "--log", str(log)]
    first = subprocess.Popen([sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(tmp_path / "a"),
                              *args], env=env, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: ledger(log, "step") and max(ledger(log, "step")) >= 20, 180, "20 steps")
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 143, err
    saved = ledger(log, "save")
    assert len(saved) == 1 and saved[0] >= 20 and "last.ckpt" in manifest("jobs/pl-task-0")["files"]
    retry = subprocess.run([sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(tmp_path / "b"), *args],
                           env={**env, "CLOUD_RUN_TASK_ATTEMPT": "1"}, capture_output=True, text=True, timeout=300)
    assert retry.returncode == 0, retry.stderr
    assert ledger(log, "start") == [0, saved[0]]  # resumed at the saved global step


@pytest.mark.slurm
@pytest.mark.slow
def test_lightning_auto_requeue_held_until_the_upload_outlasting_killwait_is_done(slurm, emu, tmp_path):
    c = slurm.cluster
    assert "KillWait=5" in c.conf.read_text()
    config = tmp_path / "c.toml"
    config.write_text(cluster_config_text(slurm.root) + '[checkpoint]\nremote = "gs://ckpt/jobs"\n'
                      "sync_interval_s = 3600\ngrace_s = 300.0\n")
    out, log = tmp_path / "out", tmp_path / "log"
    env = dict(c.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=emu.url)
    sub = subprocess.run([sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-n", "1", "-o", str(out),
                          "--open-mode=append", "--", "--ckpt-dir", str(tmp_path / "ckpt-%n"), "--", sys.executable,
                          LIGHTNING_TRAIN, "--auto-requeue", "on", "--mib", "400", "--max-steps", "300",
                          "--log", str(log)], env=env, capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    first = c.wait_job(job_id, ("RUNNING",), 60)["NodeList"]
    wait_for(lambda: ledger(log, "step") and max(ledger(log, "step")) >= 20, 300, "20 steps")
    c.run(["scancel", "--batch", "--signal=TERM", job_id])
    c.run(["scontrol", "update", f"nodename={first}", "state=drain", "reason=test: node gone"])
    job = wait_for(lambda: (lambda j: j if j["JobState"] in ("COMPLETED", "FAILED") else None)(c.job(job_id)), 600,
                   "job end")
    text = out.read_text()
    assert job["JobState"] == "COMPLETED", text
    assert job["Restarts"] == "1", text  # requeued exactly once (Lightning's own request was held)
    assert f"requeue of job {job_id} held until the checkpoint is synced" in text
    assert "asked for its requeue (held until the checkpoint is synced): stopping the job" in text
    assert f"exit 143: checkpoint flushed, job {job_id} requeued" in text
    assert "Job is pending execution" not in text
    assert any(name.startswith("hpc_ckpt_") for name in manifest(f"jobs/{job_id}")["files"])
    saved = ledger(log, "save")
    assert len(saved) == 1 and saved[0] >= 20
    assert ledger(log, "start") == [0, saved[0]]  # resumed at the global step Lightning saved
    assert max(ledger(log, "step")) >= 290  # and trained to the end

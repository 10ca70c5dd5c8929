"""A real torch.distributed.checkpoint (DCP) training loop (examples/dcp_train.py) under the
wrapper: SIGTERMed mid-run, restored into an EMPTY directory elsewhere, DCP loads it and the
final parameters are bit-identical to an uninterrupted run with the same seed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO, cluster_config_text, manifest, need_module, wait_for

need_module("torch")

DCP_TRAIN = str(REPO / "examples" / "dcp_train.py")
STEPS, EVERY = 60, 10


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> bytes:
    """The final parameters of an uninterrupted run (no wrapper), seed 0."""
    d = tmp_path_factory.mktemp("reference")
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURMAGENT_CKPT_DIR=str(d / "ckpt"))
    env.pop("SLURMAGENT_RESUMED", None)
    subprocess.run([sys.executable, DCP_TRAIN, "--steps", str(STEPS), "--every", str(EVERY),
                    "--params-out", str(d / "params.bin")], env=env, check=True, timeout=300)
    return (d / "params.bin").read_bytes()


def train_args(tmp_path: Path, layout: str) -> list[str]:
    return [sys.executable, DCP_TRAIN, "--steps", str(STEPS), "--every", str(EVERY), "--layout", layout,
            "--step-seconds", "0.1", "--params-out", str(tmp_path / "params.bin"), "--log", str(tmp_path / "log")]


def log_lines(tmp_path: Path) -> list[str]:
    p = tmp_path / "log"
    return p.read_text().splitlines() if p.exists() else []


@pytest.mark.parametrize("layout", ["rename", "torchtitan"])
def test_dcp_cloud_run_sigterm_then_restore_into_empty_dir_is_bit_identical(emu, tmp_path, reference, layout):
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n[checkpoint]\nremote = "gs://ckpt/jobs"\n'
                                     "sync_interval_s = 1.0\ngrace_s = 60.0\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURMAGENT_CONFIG=str(tmp_path / "c.toml"),
               CLOUD_RUN_JOB="dcp", CLOUD_RUN_TASK_INDEX="0", CLOUD_RUN_TASK_ATTEMPT="0")
    env.pop("SLURM_JOB_ID", None)
    first_dir = tmp_path / "task-vm-1"
    first = subprocess.Popen([sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(first_dir), "--",
                              *train_args(tmp_path, layout)], env=env, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: any((p / ".metadata").exists() for p in first_dir.glob("step-*")), 180, "a first DCP checkpoint")
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 143, err
    saved = [line for line in log_lines(tmp_path) if line.startswith("ckpt ")]
    assert len(saved) == 1 and 0 < int(saved[0].split()[1]) < STEPS, log_lines(tmp_path)
    files = manifest("jobs/dcp-task-0")["files"]
    assert any(name.endswith("/.metadata") for name in files), sorted(files)  # DCP's index is synced

    second_dir = tmp_path / "task-vm-2"  # another VM: an empty directory
    retry = subprocess.run([sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(second_dir), "--",
                            *train_args(tmp_path, layout)], env={**env, "CLOUD_RUN_TASK_ATTEMPT": "1"},
                           capture_output=True, text=True, timeout=300)
    assert retry.returncode == 0, retry.stderr
    starts = [line for line in log_lines(tmp_path) if line.startswith("start ")]
    assert starts[1] == f"start {saved[0].split()[1]} resumed=1 restart=1"  # from the flushed step, not 0
    assert (tmp_path / "params.bin").read_bytes() == reference


@pytest.mark.slurm
@pytest.mark.slow
def test_dcp_on_slurm_sigterm_requeue_resume_on_another_node_is_bit_identical(slurm, emu, tmp_path, reference):
    c = slurm.cluster
    config = tmp_path / "c.toml"
    config.write_text(cluster_config_text(slurm.root) + '[checkpoint]\nremote = "gs://ckpt/jobs"\n'
                      "sync_interval_s = 1.0\ngrace_s = 60.0\n")
    out = tmp_path / "out"
    env = dict(c.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=emu.url)
    sub = subprocess.run([sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-o", str(out),
                          "--open-mode=append", "--", "--ckpt-dir", str(tmp_path / "ckpt-%n"), "--",
                          *train_args(tmp_path, "torchtitan")], env=env, capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    first = c.wait_job(job_id, ("RUNNING",), 60)["NodeList"]
    wait_for(lambda: any((p / ".metadata").exists() for p in (tmp_path / f"ckpt-{first}").glob("step-*")), 180,
             "a first DCP checkpoint")
    c.run(["scancel", "--batch", "--signal=TERM", job_id])
    c.run(["scontrol", "update", f"nodename={first}", "state=drain", "reason=test: node gone"])
    job = wait_for(lambda: (lambda j: j if j["JobState"] in ("COMPLETED", "FAILED") else None)(c.job(job_id)), 300,
                   "job end")
    log = out.read_text()
    assert job["JobState"] == "COMPLETED", log
    assert job["Restarts"] == "1" and job["NodeList"] != first
    assert "requeued job" in log and "restored checkpoint of attempt 0" in log
    starts = [line for line in log_lines(tmp_path) if line.startswith("start ")]
    saved = [line.split()[1] for line in log_lines(tmp_path) if line.startswith("ckpt ")]
    assert starts[-1] == f"start {saved[0]} resumed=1 restart=1"
    assert (tmp_path / "params.bin").read_bytes() == reference

"""`slurmagent run`: flush on signal, sync to a GCS emulator, requeue, restore on restart.

The same subject without a cluster, emulator or fake server: tests/unit/test_wrapper.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import REPO, SUPPORT, cluster_config_text, manifest, wait_for
from test_wrapper import write_config

TOY = str(SUPPORT / "toy_trainer.py")


def ledger_steps(ledger: Path) -> list[int]:
    return [int(line.split()[1]) for line in ledger.read_text().splitlines() if line.startswith("step ")]


def start_wrapper(tmp_path: Path, config: Path, env_extra: dict, args: list[str], trainer_args: list[str]):
    env = dict(os.environ, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), **env_extra)
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURMAGENT_RESUMED") if "SLURM_JOB_ID" not in env_extra else ():
        env.pop(key, None)
    err = open(tmp_path / f"wrapper-{time.monotonic_ns()}.err", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurmagent.entry", "run", *args, "--", sys.executable, TOY, *trainer_args],
        env=env, stderr=err, stdout=subprocess.DEVNULL,
    )
    proc.err_file = err  # type: ignore[attr-defined]
    return proc


def stderr_of(proc) -> str:
    proc.err_file.seek(0)
    return proc.err_file.read()


def test_cloud_run_task_flushes_exits_143_and_retry_resumes(emu, tmp_path):
    config = write_config(tmp_path / "c.toml", "gs://ckpt/jobs", tmp_path / "state")
    ledger = tmp_path / "ledger"
    run_env = {"CLOUD_RUN_JOB": "train", "CLOUD_RUN_TASK_INDEX": "2", "CLOUD_RUN_TASK_ATTEMPT": "0"}
    first = start_wrapper(tmp_path, config, run_env, ["--ckpt-dir", str(tmp_path / "a")], ["60", str(ledger), "0.05"])
    wait_for(lambda: len(ledger_steps(ledger)) >= 12 if ledger.exists() else False, 30, "12 steps")
    first.send_signal(signal.SIGTERM)
    assert first.wait(30) == 143, stderr_of(first)
    assert "Cloud Run retries" in stderr_of(first)
    saved = manifest("jobs/train-task-2")
    assert saved is not None and saved["attempt"] == 0

    retry = start_wrapper(tmp_path, config, {**run_env, "CLOUD_RUN_TASK_ATTEMPT": "1"},
                          ["--ckpt-dir", str(tmp_path / "b")], ["60", str(ledger), "0.01"])
    assert retry.wait(60) == 0, stderr_of(retry)
    assert "restored checkpoint of attempt 0" in stderr_of(retry)
    assert ledger_steps(ledger) == list(range(1, 61))  # none lost, none done twice
    starts = [line for line in ledger.read_text().splitlines() if line.startswith("start")]
    resumed_at = int(starts[1].split()[1])
    assert resumed_at > 0 and "resumed=1" in starts[1] and "restart=1" in starts[1]


def test_child_ignoring_signal_is_killed_after_grace_and_previous_checkpoint_stays(emu, tmp_path):
    config = write_config(tmp_path / "c.toml", "gs://ckpt/jobs", tmp_path / "state", grace_s=2.0)
    ledger = tmp_path / "ledger"
    env = {"CLOUD_RUN_JOB": "ign", "CLOUD_RUN_TASK_INDEX": "0"}
    # a save every 2.5 s: quiet for whole sync rounds in between, so periodic commits happen
    proc = start_wrapper(tmp_path, config, env, ["--ckpt-dir", str(tmp_path / "a")], ["1000", str(ledger), "0.5", "ignore"])
    wait_for(lambda: (manifest("jobs/ign-task-0") or {}).get("files", {}).get("state.json"), 30, "a synced checkpoint")
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 143
    # the configured grace (2 s), the kill and the last sync: idle a few seconds; the bound is room
    # for a loaded machine and half the default grace (90 s) the wrapper would wait if it ignored it
    assert time.monotonic() - started < 90 / 2
    err = stderr_of(proc)
    assert "did not exit within 2 s" in err
    restored = tmp_path / "restored"
    retry = start_wrapper(tmp_path, config, {**env, "CLOUD_RUN_TASK_ATTEMPT": "1"}, ["--ckpt-dir", str(restored)],
                          ["0", str(tmp_path / "ledger2"), "0"])
    assert retry.wait(30) == 0
    step = json.loads((restored / "state.json").read_text())["step"]
    assert step % 5 == 0 and step > 0  # a periodic checkpoint, whole


def test_kill9_mid_upload_restores_a_complete_checkpoint(emu, tmp_path):
    config = write_config(tmp_path / "c.toml", "gs://ckpt/jobs", tmp_path / "state", sync_interval_s=0.5)
    ledger = tmp_path / "ledger"
    env = {"CLOUD_RUN_JOB": "k9", "CLOUD_RUN_TASK_INDEX": "0"}
    # a save every 2 s: quiet for whole sync rounds in between, so periodic commits happen
    proc = start_wrapper(tmp_path, config, env, ["--ckpt-dir", str(tmp_path / "a")], ["100000", str(ledger), "0.4", "-", "24"])
    wait_for(lambda: manifest("jobs/k9-task-0"), 60, "first checkpoint")
    time.sleep(1.3)  # somewhere inside later syncs of the 24 MiB shard
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    subprocess.run(["pkill", "-KILL", "-f", str(ledger)], check=False)  # the orphaned trainer
    restored = tmp_path / "restored"
    retry = start_wrapper(tmp_path, config, {**env, "CLOUD_RUN_TASK_ATTEMPT": "1"}, ["--ckpt-dir", str(restored)],
                          ["0", str(tmp_path / "ledger2"), "0"])
    assert retry.wait(60) == 0, stderr_of(retry)
    shard = (restored / "shard.bin").read_bytes()
    assert len(shard) == 24 * 1024 * 1024
    assert shard == shard[:8] * (len(shard) // 8)  # one whole version, never a mix
    assert json.loads((restored / "state.json").read_text())["step"] > 0


@pytest.mark.parametrize("comes_back", [True, False])
def test_storage_down_during_final_sync(gcs_emulator_factory, monkeypatch, tmp_path, comes_back):
    emu = gcs_emulator_factory()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emu.url)
    config = write_config(tmp_path / "c.toml", "gs://ckpt/jobs", tmp_path / "state", grace_s=6.0)
    ledger = tmp_path / "ledger"
    ckpt = tmp_path / "a"
    env = {"CLOUD_RUN_JOB": "down", "CLOUD_RUN_TASK_INDEX": "0"}
    proc = start_wrapper(tmp_path, config, env, ["--ckpt-dir", str(ckpt)], ["100000", str(ledger), "0.4"])
    wait_for(lambda: manifest("jobs/down-task-0"), 30, "first checkpoint")  # a save every 2 s: quiet rounds
    emu.stop()
    proc.send_signal(signal.SIGTERM)
    if comes_back:
        time.sleep(2)
        emu.start()
    assert proc.wait(60) == 143
    err = stderr_of(proc)
    final_step = json.loads((ckpt / "state.json").read_text())["step"]  # local checkpoint kept
    if comes_back:
        assert "final sync:" in err, err
        assert manifest("jobs/down-task-0")["files"]["state.json"]
        restored = tmp_path / "restored"
        retry = start_wrapper(tmp_path, config, {**env, "CLOUD_RUN_TASK_ATTEMPT": "1"}, ["--ckpt-dir", str(restored)],
                              ["0", str(tmp_path / "l2"), "0"])
        assert retry.wait(30) == 0
        assert json.loads((restored / "state.json").read_text())["step"] == final_step
    else:
        assert "final sync failed" in err and "local checkpoint" in err and "kept" in err


# --- on the real Slurm cluster ----------------------------------------------------------------


@pytest.mark.slurm
@pytest.mark.slow
def test_sigterm_requeues_and_resumes_on_another_node_from_bucket(slurm, emu, tmp_path):
    c = slurm.cluster
    config = tmp_path / "c.toml"
    config.write_text(cluster_config_text(slurm.root) + '[checkpoint]\nremote = "gs://ckpt/jobs"\nsync_interval_s = 1.0\ngrace_s = 10.0\n')
    ledger = tmp_path / "ledger"
    out = tmp_path / "out"
    env = dict(c.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=emu.url)
    sub = subprocess.run(
        [sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-o", str(out), "--open-mode=append",
         "--", "--ckpt-dir", str(tmp_path / "ckpt-%n"), "--", sys.executable, TOY, "400", str(ledger), "0.05"],
        env=env, capture_output=True, text=True, timeout=30,
    )
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    job = c.wait_job(job_id, ("RUNNING",), 60)
    first = job["NodeList"]
    assert job["Requeue"] == "1"
    wait_for(lambda: ledger.exists() and len(ledger_steps(ledger)) >= 20, 60, "20 steps")
    c.run(["scancel", "--batch", "--signal=TERM", job_id])
    c.run(["scontrol", "update", f"nodename={first}", "state=drain", "reason=test: node gone"])

    job = wait_for(lambda: (lambda j: j if j["JobState"] in ("COMPLETED", "FAILED") else None)(c.job(job_id)), 150, "job end")
    assert job["JobState"] == "COMPLETED", out.read_text()
    assert int(job["Restarts"]) >= 1
    assert job["NodeList"] != first
    log = out.read_text()
    assert "requeued job" in log and "restored checkpoint of attempt 0" in log
    assert ledger_steps(ledger) == list(range(1, 401))
    starts = [l for l in ledger.read_text().splitlines() if l.startswith("start")]
    assert "resumed=1" in starts[-1] and f"node={first}" not in starts[-1]


def sbatch_wrapped(slurm, tmp_path: Path, emu, run_opts: list[str], cmd: list[str], out: Path) -> str:
    c = slurm.cluster
    config = tmp_path / "c.toml"
    config.write_text(cluster_config_text(slurm.root) + '[checkpoint]\nremote = "gs://ckpt/jobs"\nsync_interval_s = 3600\n'
                      "grace_s = 10.0\n")
    env = dict(c.env, SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO), STORAGE_EMULATOR_HOST=emu.url)
    sub = subprocess.run([sys.executable, "-m", "slurmagent.entry", "sbatch", "--parsable", "-o", str(out),
                          "--open-mode=append", "--", *run_opts, "--ckpt-dir", str(tmp_path / "ckpt-%n"), "--", *cmd],
                         env=env, capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0]


def signal_each_attempt(slurm, job_id: str, ledger: Path, attempts: int) -> dict:
    """SIGTERM the batch step of attempts 0..attempts-1, each once it has started and until it has left."""
    c = slurm.cluster
    for restart in range(attempts):
        wait_for(lambda: ledger.exists() and f"start restart={restart}" in ledger.read_text(), 180,
                 f"attempt {restart}")
        c.run(["scancel", "--batch", "--signal=TERM", job_id])
        wait_for(lambda: c.job(job_id)["JobState"] not in ("RUNNING", "COMPLETING") or
                 int(c.job(job_id)["Restarts"]) > restart, 120, f"attempt {restart} to end")
    return c.job(job_id)


# Each attempt: "start restart=N" to LEDGER, then a checkpoint holding CONTENT (or, with "-", one
# that holds the attempt's restart count, i.e. progress), then a loop; SIGUSR1 ends it cleanly.
ATTEMPT = ('echo "start restart=$SLURMAGENT_RESTART_COUNT" >> "$1"; c="$2"; [ "$c" = - ] && c=$SLURMAGENT_RESTART_COUNT; '
           'printf "%s" "$c" > "$SLURMAGENT_CKPT_DIR/state"; trap "exit 0" USR1; while :; do sleep 0.1; done')


@pytest.mark.slurm
@pytest.mark.slow
def test_progressing_attempts_are_requeued_past_max_requeues_on_the_cluster(slurm, emu, tmp_path):
    ledger, out = tmp_path / "ledger", tmp_path / "out"
    job_id = sbatch_wrapped(slurm, tmp_path, emu, ["--max-requeues", "1"], ["sh", "-c", ATTEMPT, "sh", str(ledger), "-"],
                            out)
    signal_each_attempt(slurm, job_id, ledger, 4)  # SLURM_RESTART_COUNT 0..3, cap 1
    wait_for(lambda: "start restart=4" in ledger.read_text(), 180, "a 5th attempt")
    slurm.cluster.run(["scancel", job_id])
    log = out.read_text()
    assert log.count(f"exit 143: checkpoint flushed, job {job_id} requeued") == 4, log
    assert "not requeueing" not in log


@pytest.mark.slurm
@pytest.mark.slow
def test_attempts_without_progress_stop_within_max_requeues_plus_one_on_the_cluster(slurm, emu, tmp_path):
    ledger, out = tmp_path / "ledger", tmp_path / "out"
    job_id = sbatch_wrapped(slurm, tmp_path, emu, ["--max-requeues", "1"],
                            ["sh", "-c", ATTEMPT, "sh", str(ledger), "same"], out)
    signal_each_attempt(slurm, job_id, ledger, 3)  # 0: first checkpoint; 1, 2: nothing new
    job = wait_for(lambda: (lambda j: j if j["JobState"] in ("FAILED", "COMPLETED") else None)(slurm.cluster.job(job_id)),
                   120, "the job's end")
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "75:0" and job["Restarts"] == "2", job
    log = out.read_text()
    assert f"not requeueing job {job_id}: 2 attempts in a row committed no new checkpoint (--max-requeues 1)" in log
    assert log.strip().splitlines()[-1].startswith(f"slurmagent run: exit 75: checkpoint flushed, job {job_id} NOT requeued")

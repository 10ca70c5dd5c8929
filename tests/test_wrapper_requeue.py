"""The wrapper's requeue: the budget counts restarts without progress, the job's own requeue is
held until the final sync, exit codes and the last stderr line say what happened.

The supervisor runs in-process against a real Cloud Storage emulator; Slurm's requeue is the
injected callable (the cluster tests in test_wrapper_slurm.py use the real one)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, wait_for
from slurmagent.errors import SlurmError
from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
from slurmagent.run.child import RequeueHold
from slurmagent.run.job import JobIdentity, RunOptions
from slurmagent.run.supervisor import EXIT_FLUSHED, EXIT_REQUEUE_REFUSED, Supervisor

# A trainer in sh: writes CONTENT as its checkpoint, says READY, checkpoints again on SIGUSR1.
SH_TRAINER = 'trap "exit 0" USR1; [ -n "$1" ] && printf "%s" "$1" > "$SLURMAGENT_CKPT_DIR/state"; : > "$2"; ' \
             'while :; do sleep 0.02; done'


@pytest.fixture
def emu(gcs_emulator, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.url)
    return gcs_emulator


class Requeues(list):
    """Slurm's requeue, recorded (or refused, like `scontrol requeue` of a Requeue=0 job)."""

    refuse = ""

    def __call__(self, job_id: str) -> None:
        if self.refuse:
            raise SlurmError(f"scontrol requeue {job_id}: {self.refuse}")
        self.append(job_id)


def attempt(tmp_path: Path, restart: int, content: str, *, store=True, max_requeues: int = 3, ckpt_dir=None,
            requeues: Requeues | None = None, cmd=None, flush: bool = True, hold=None, grace_s: float = 20.0,
            ready: Path | None = None, before_flush=None, submission: str = "", **options):
    """One attempt of job 77 on a fresh node (empty dir) unless `ckpt_dir` is given: the trainer
    writes `content`, then the wrapper gets SIGTERM (when `flush`). Returns (outcome, stderr)."""
    ckpt = ckpt_dir or tmp_path / f"node-{restart}" / "ckpt"
    ready = ready or tmp_path / f"ready-{restart}-{time.monotonic_ns()}"
    ident = JobIdentity("slurm", "77", "77", restart, ("77",), submission)
    opts = RunOptions(cmd=cmd or ["sh", "-c", SH_TRAINER, "sh", content, str(ready)], ckpt_dir=ckpt,
                      remote="gs://ckpt/jobs/77" if store else "", grace_s=grace_s, max_requeues=max_requeues,
                      sync_interval_s=3600, stop_wait_s=5, **options)
    err = io.StringIO()
    sup = Supervisor(opts, ident, GcsCheckpointStore(opts.remote) if store else None,
                     requeues if requeues is not None else Requeues(), dict(os.environ), err=err, hold=hold)
    if flush:
        def signal_when_ready() -> None:
            wait_for(ready.exists, 30, "trainer start", interval=0.02)
            if before_flush is not None:
                before_flush()
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=signal_when_ready, daemon=True).start()
    outcome = sup.run()
    return outcome, err.getvalue()


def test_six_progressing_attempts_are_all_requeued(emu, tmp_path):
    requeues = Requeues()
    for restart in range(6):  # SLURM_RESTART_COUNT 0..5, each attempt on another node
        outcome, err = attempt(tmp_path, restart, f"step {restart * 100}", max_requeues=1, requeues=requeues)
        assert outcome.exit_code == EXIT_FLUSHED and outcome.requeued, err
        assert outcome.no_progress == 0
        assert outcome.resumed == (restart > 0)
    assert requeues == ["77"] * 6
    assert "it made progress" in err


def test_attempts_without_progress_stop_within_max_requeues_plus_one(emu, tmp_path):
    requeues = Requeues()
    outcome, _ = attempt(tmp_path, 0, "step 100", requeues=requeues)  # progress: a first checkpoint
    assert outcome.requeued and outcome.no_progress == 0
    codes = []
    for restart in range(1, 10):
        outcome, err = attempt(tmp_path, restart, "", requeues=requeues)  # restores, adds nothing
        codes.append(outcome.exit_code)
        if not outcome.requeued:
            break
    assert codes == [EXIT_FLUSHED] * 3 + [EXIT_REQUEUE_REFUSED]  # --max-requeues 3: the 4th stops
    assert outcome.no_progress == 4 and len(requeues) == 4
    assert "not requeueing job 77: 4 attempts in a row committed no new checkpoint (--max-requeues 3)" in err
    assert outcome.summary.startswith(f"exit {EXIT_REQUEUE_REFUSED}: ") and "NOT requeued" in outcome.summary


def test_progress_resets_the_streak(emu, tmp_path):
    requeues = Requeues()
    for restart, content in enumerate(["a", "", "", "b", "", "", "c"]):
        outcome, err = attempt(tmp_path, restart, content, max_requeues=2, requeues=requeues)
        assert outcome.requeued, (restart, err)
    assert attempt(tmp_path, 7, "", max_requeues=2)[0].no_progress == 1  # counted again from 0


def test_a_job_that_never_checkpoints_stops_within_max_requeues_plus_one(emu, tmp_path):
    results = [attempt(tmp_path, restart, "", max_requeues=2)[0] for restart in range(3)]
    assert [o.requeued for o in results] == [True, True, False]
    assert results[-1].exit_code == EXIT_REQUEUE_REFUSED


def test_without_a_bucket_progress_is_seen_in_a_shared_dir(tmp_path):
    shared = tmp_path / "shared" / "ckpt"
    requeues = Requeues()
    outcomes = [attempt(tmp_path, r, c, store=False, ckpt_dir=shared, max_requeues=1, requeues=requeues)[0]
                for r, c in enumerate(["a", "b", "c", "d", "", ""])]
    assert [o.requeued for o in outcomes] == [True, True, True, True, True, False]
    assert [o.no_progress for o in outcomes] == [0, 0, 0, 0, 1, 2]
    assert all(o.resumed for o in outcomes[1:])  # bucket or not, the dir held a checkpoint


def test_requeue_refused_by_slurm_is_exit_75_and_said_last(emu, tmp_path):
    requeues = Requeues()
    requeues.refuse = "Requested operation is presently disabled"
    outcome, err = attempt(tmp_path, 0, "a", requeues=requeues)
    assert outcome.exit_code == EXIT_REQUEUE_REFUSED and not outcome.requeued
    assert "presently disabled" in outcome.summary and outcome.synced


def test_child_exit_code_summary_and_final_sync(emu, tmp_path):
    outcome, err = attempt(tmp_path, 0, "", flush=False,
                           cmd=["sh", "-c", 'echo x > "$SLURMAGENT_CKPT_DIR/m.pt"; exit 7'])
    assert outcome.exit_code == 7 and outcome.synced and not outcome.flushed
    assert outcome.summary == "exit 7: the job's own exit code (it ended by itself)"


# --- the job's own `scontrol requeue`, held --------------------------------------------------


def fake_scontrol(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in for the real scontrol the shim passes other commands to (records its argv)."""
    log = tmp_path / "real-scontrol.log"
    real = tmp_path / "bin" / "scontrol"
    real.parent.mkdir()
    real.write_text(f'#!/bin/sh\necho "$@" >> {log}\necho "JobId=$3 JobState=RUNNING"\n')
    real.chmod(0o755)
    return real, log


# Lightning's SIGUSR1 handler in sh: save, `scontrol requeue $SLURM_JOB_ID`, then GO ON training.
# It ignores the wrapper's SIGTERM (sent as soon as the requeue is held, maybe before the trap's
# echo ran) and trains on, as Lightning does after requeueing itself: the wrapper's KILL ends it.
SELF_REQUEUER = ('trap "" TERM; trap \'printf saved > "$SLURMAGENT_CKPT_DIR/hpc_ckpt_1.ckpt"; scontrol requeue 77; '
                 'echo "requeue rc=$?" >> "$2"\' USR1; scontrol show job 77 >> "$2"; : > "$1"; '
                 'while :; do sleep 0.02; done')


def test_own_requeue_is_held_child_stopped_without_waiting_grace_requeued_once(emu, tmp_path):
    real, real_log = fake_scontrol(tmp_path)
    hold = RequeueHold(("77",), str(real))
    ready, log = tmp_path / "ready", tmp_path / "child.log"
    requeues = Requeues()
    started = time.monotonic()
    outcome, err = attempt(tmp_path, 0, "", requeues=requeues, hold=hold, grace_s=600, ready=ready,
                           cmd=["sh", "-c", SELF_REQUEUER.replace('"$1"', str(ready)).replace('"$2"', str(log)),
                                "sh", str(ready), str(log)])
    assert time.monotonic() - started < 600  # not the grace: stopped once it asked for its requeue
    assert outcome.held_requeue and outcome.requeued and requeues == ["77"], err
    assert outcome.exit_code == EXIT_FLUSHED and outcome.synced
    assert "requeue rc=0" in log.read_text()  # the trainer was told its requeue worked
    assert real_log.read_text().splitlines() == ["show job 77"]  # other subcommands pass through; no requeue
    assert "asked for its requeue" in err and "stopping the job" in err
    assert not hold.dir.exists()  # cleaned up


def test_a_trainer_that_requeues_itself_unasked_is_flushed_once(emu, tmp_path):
    real, real_log = fake_scontrol(tmp_path)
    hold = RequeueHold(("77", "70_7"), str(real))
    requeues = Requeues()
    cmd = ["sh", "-c", 'printf s > "$SLURMAGENT_CKPT_DIR/step"; scontrol requeue 70_7; scontrol requeue 70_7; '
           'scontrol requeue 12; exit 0']
    outcome, err = attempt(tmp_path, 0, "", requeues=requeues, hold=hold, flush=False, cmd=cmd)
    assert outcome.flush_cause == "the job requeued itself" and outcome.held_requeue
    assert requeues == ["77"] and outcome.exit_code == EXIT_FLUSHED
    assert real_log.read_text().splitlines() == ["requeue 12"]  # another job's requeue is not ours to hold


def test_shim_argv_is_data_not_code(tmp_path):
    real, real_log = fake_scontrol(tmp_path)
    hold = RequeueHold(("77",), str(real))
    env = dict(os.environ, PATH=hold.child_path(os.environ["PATH"]))
    for args in (["requeue", "77;touch x"], ["requeue", "$(touch x)"], ["requeue", "*"]):
        subprocess.run(["scontrol", *args], env=env, cwd=tmp_path, check=True, timeout=10)
    assert not hold.requested() and not (tmp_path / "x").exists()
    assert len(real_log.read_text().splitlines()) == 3
    with pytest.raises(ValueError):
        RequeueHold(("77; rm -rf /",), str(real))
    hold.cleanup()


def test_cli_last_line_says_the_exit_code(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURMAGENT_CONFIG=str(tmp_path / "c.toml"))
    for key in ("SLURM_JOB_ID", "CLOUD_RUN_JOB", "STORAGE_EMULATOR_HOST"):
        env.pop(key, None)
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n')
    proc = subprocess.run([sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(tmp_path / "ck"), "--",
                           "sh", "-c", "exit 3"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert proc.stderr.strip().splitlines()[-1] == "slurmagent run: exit 3: the job's own exit code (it ended by itself)"
